"""The chunked output head and loss: what the activations planner can reach with and without it, on
a GPT whose logits dominate the saved activations (issue 24's shape), each side in fresh processes.

Rows: plain DeepSpeed (ZeRO-2 bf16, clipping 1.0, micro-batch 2); then the activations plugin alone
with a budget of all the saved bytes (what the planner sees: saved bytes, and the part outside every
candidate), without ``chunk`` and with it; then each preset under ``memory_budget`` at a fraction of the plain peak, once with ``chunk`` taken
out of its options (the planner as it was before the head was a candidate) and once as the preset
stands. Peaks are the tracker's worst-rank peak (CPU), times the median step, the loss the mean of
the last steps.

    .venv/bin/python benchmarks/head_loss.py --steps 6 --world-size 2 \\
        --data ../shared/data/tinyshakespeare.txt --json benchmarks/results/head_loss.json

The same for HF's ``LlamaForCausalLM`` (vocab 32,000, hidden 512, 8 layers; its own ``loss_function``):

    .venv/bin/python benchmarks/head_loss.py --model benchmarks.hf_llama:llama_32k --steps 6 --world-size 2 \\
        --data ../shared/data/tinyshakespeare.txt --json benchmarks/results/head_loss_llama.json

``--only balanced`` runs plain DeepSpeed and the rows whose label holds that word;
``--render JSON`` prints the Markdown table of a saved run.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.hf_llama for --model
from results_table import BASE, TUNED, deep_merge, load_or_run, short_error  # noqa: E402

MODEL = "gpt:layers=12,hidden=768,heads=12,seq=256,vocab=50304"
BUDGETS = (("conservative", 0.75), ("balanced", 0.5))


def without_chunk(preset: str) -> dict:
    from xirang_ds.config.presets import PRESETS

    options = [o for o in PRESETS[preset]["activations"]["options"] if o != "chunk"]
    return {"activations": {"options": options}}


def run(args: argparse.Namespace) -> dict:
    from xirang_ds.bench import run_side
    from xirang_ds.plugins.activations.config import ActivationsConfig

    base = deep_merge(BASE, TUNED)
    base["train_micro_batch_size_per_gpu"] = args.micro
    data = {"command": " ".join(["python", "benchmarks/head_loss.py"] + sys.argv[1:]), "model": args.model,
            "steps": args.steps, "world_size": args.world_size, "micro_batch": args.micro, "rows": []}
    side = lambda config, xirang: run_side(args.model, config, args.steps, args.world_size, args.data, 0, xirang)  # noqa: E731
    print("plain DeepSpeed ...", file=sys.stderr, flush=True)
    plain = side(base, False)
    data["rows"].append({"config": "plain", "peak_bytes": plain.peak_bytes, "step_time_s": plain.step_time_median_s,
                         "final_loss": plain.final_loss})
    alone = {"activations": {"enabled": True, "budget_fraction": 1.0, "profile_steps": 1}}
    options = [o for o in ActivationsConfig().options if o != "chunk"]
    rows = [("activations alone, budget_fraction 1.0, without chunk", deep_merge(alone, {"activations": {
                "options": options}})),
            ("activations alone, budget_fraction 1.0", alone)]
    for preset, fraction in BUDGETS:
        budget = int(fraction * plain.peak_bytes)
        for label, extra in (("without chunk", without_chunk(preset)), ("", {})):
            block = deep_merge({"preset": preset, "memory_budget": budget}, extra)
            rows.append((f"{preset} at {fraction}x the plain peak" + (f", {label}" if label else ""), block))
    for label, block in rows:
        if args.only and not any(word in label for word in args.only):
            continue
        print(f"{label} ...", file=sys.stderr, flush=True)
        row = {"config": label, "block": copy.deepcopy(block)}
        try:
            ours = side({**base, "xirang": block}, True)
        except Exception as e:  # recorded in the table, the next row still runs
            row["error"] = short_error(e)
        else:
            reach = ours.plugin_figures.get("activations", {})
            row.update(peak_bytes=ours.peak_bytes, step_time_s=ours.step_time_median_s, final_loss=ours.final_loss,
                       peak_ratio=ours.peak_bytes / plain.peak_bytes,
                       step_time_ratio=ours.step_time_median_s / plain.step_time_median_s,
                       saved_bytes=reach.get("keep_bytes"), outside_bytes=reach.get("outside_bytes"),
                       heads=reach.get("heads"), summary=ours.summary)
        data["rows"].append(row)
    return data


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def head_cell(heads) -> str:
    """The table's head column: each head's option (and slice rows), ``-`` for none."""
    return ", ".join(f"{n}: {h['option']}" + (f" ({h['rows']} rows)" if h.get("rows") else "")
                     for n, h in (heads or {}).items()) or "-"


def render(data: dict) -> str:
    lines = [f"`{data['command']}` ({data['model']}, micro-batch {data['micro_batch']}, {data['world_size']} ranks, "
             f"{data['steps']} steps)", "",
             "| configuration | peak (worst rank) | peak ratio | step time ratio | final loss | saved activations | "
             "outside the candidates | head |",
             "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        if "error" in row:
            reason = row["error"].split("problem): ", 1)[-1].split("; raise it")[0]
            lines.append(f"| {row['config']} | refused: {reason} | | | | | | |")
            continue
        ratio = lambda key: f"{row[key]:.2f}x" if key in row else "1.00x"  # noqa: E731
        lines.append(f"| {row['config']} | {mib(row['peak_bytes'])} | {ratio('peak_ratio')} | "
                     f"{ratio('step_time_ratio')} | {row['final_loss']:.4f} | {mib(row.get('saved_bytes'))} | "
                     f"{mib(row.get('outside_bytes'))} | {head_cell(row.get('heads'))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--data", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--render", default=None, help="print the table of a saved JSON")
    parser.add_argument("--only", nargs="+", default=None, metavar="WORD",
                        help="run plain DeepSpeed and the rows whose label holds one of these words")
    args = parser.parse_args()
    print(render(load_or_run(args, run)))


if __name__ == "__main__":
    main()
