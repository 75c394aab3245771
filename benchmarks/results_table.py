"""The results table of docs/results.md: every preset and every plugin alone against plain DeepSpeed (default
and hand-tuned buckets) and the tools users pick today, on the bench GPT.

One invocation runs every row in fresh processes, one after the other, with the same model, data
and seed (``xirang_ds.bench.run_side``, the machinery of ``xirang-ds bench``), writes the JSON and
prints the Markdown table; ``benchmarks/results_doc.py`` then puts it in docs/results.md.

    make bench-env    # torchao and bitsandbytes for the peers' rows (left out without them)
    .venv/bin/python benchmarks/results_table.py --steps 30 --world-size 2 \\
        --data ../shared/data/tinyshakespeare.txt --json benchmarks/results/results_table.json
    .venv/bin/python benchmarks/results_table.py --render benchmarks/results/results_table.json
    .venv/bin/python benchmarks/results_doc.py

Ratios are against the hand-tuned baseline (plain DeepSpeed ZeRO-2 bf16 with 1e6-element buckets,
what a user who read DeepSpeed issue 3338 writes); the default-bucket baseline's own ratio shows what
DeepSpeed's defaults cost. State bytes per parameter: optimizer-state bytes at the peak summed over
ranks, per model parameter (plain fp32 AdamW: 8); in the memory_pool row the states live in the
pool's reservation, so its bytes count there.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

BASE = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1000000,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
}
TUNED = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6}}


from xirang_ds.config.loader import deep_merge  # noqa: E402


PRESET_BUDGETS = {"conservative": (0.75,), "balanced": (0.5,), "aggressive": (0.25, 0.6)}
"""Each preset row runs with ``memory_budget`` at these fractions of the hand-tuned baseline's measured
peak (the targets: balanced <= 0.5x, aggressive <= 0.25x). On gpt-small at ZeRO-2 over 2 ranks the
16-bit parameters and the fp32 master shard alone are 0.30x and aggressive's profiling passes need
0.47x besides saved activations (plus 4 MiB that any plan keeps), so 0.25x is refused with the
budget error and 0.6x shows what aggressive reaches; the planner plans activations under the
budget."""


def short_error(e: Exception) -> str:
    """The last ``SomeError: message`` of a failed run's text (run_ranks joins the ranks' tracebacks)."""
    text = " ".join(str(e).split())
    cut = max(text.rfind("Error: "), text.rfind("Exception: "))
    return (text[text.rfind(" ", 0, cut) + 1:] if cut > 0 else text)[:300]


def load_or_run(args: argparse.Namespace, run_fn, indent: int = 2) -> dict:
    """The data of ``--render JSON``, or a fresh ``run_fn(args)`` written to ``--json`` when given
    (every benchmark script's main)."""
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            return json.load(f)
    data = run_fn(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=indent)
    return data


def rows() -> list[dict]:
    """(name, group, ds_config, xirang?, peer) for every row, baselines first."""
    from xirang_ds.registry import built_sections

    built = built_sections()
    tuned = deep_merge(BASE, TUNED)
    out = [
        dict(name="DeepSpeed, default buckets", group="baseline", ds=BASE, xirang=False),
        dict(name="DeepSpeed, hand-tuned buckets", group="baseline", ds=tuned, xirang=False),
    ]
    plugin_rows = [
        ("comm_buffers", {"comm_buffers": {"enabled": True}}, BASE),
        ("optimizer_states int8", {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]}}, tuned),
        ("optimizer_states int4", {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int4"}]}}, tuned),
        ("grad_release", {"grad_release": {"enabled": True}}, tuned),
        ("precision", {"precision": {"enabled": True}}, tuned),
        ("activations (planner, budget 25%)", {"activations": {"enabled": True, "budget_fraction": 0.25}}, tuned),
        ("comm_buffers lending to activations (every block compress)",
         {"comm_buffers": {"enabled": True, "lend_to_activations": True},
          "activations": {"enabled": True, "planner": False, "compress": ["blocks.*"]}}, BASE),
        ("memory_pool (with int8 optimizer states)",
         {"memory_pool": {"enabled": True}, "optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]}},
         tuned),
    ]
    for name, block, ds in plugin_rows:
        if next(iter(block)) in built:
            out.append(dict(name=name, group="plugin alone", ds=deep_merge(ds, {"xirang": block}), xirang=True))
    for preset, fractions in PRESET_BUDGETS.items():
        for fraction in fractions:
            out.append(dict(name=f"preset {preset}", group="preset", ds=deep_merge(BASE, {"xirang": {"preset": preset}}),
                            xirang=True, budget_fraction=fraction))
    for peer, name in (("torchao_adamw8bit", "torchao AdamW8bit"), ("torchao_adamw4bit", "torchao AdamW4bit"),
                       ("bnb_adamw8bit", "bitsandbytes AdamW8bit"),
                       ("torch_checkpoint", "torch.utils.checkpoint, every block")):
        out.append(dict(name=name, group="peer", ds=tuned, xirang=False, peer=peer))
    return out


def run(args: argparse.Namespace) -> dict:
    from xirang_ds.bench import run_side
    from xirang_ds.models import build_model, parse_model_spec

    params = sum(p.numel() for p in build_model(parse_model_spec(args.model)).parameters())
    results = []
    for i, row in enumerate(rows()):
        shown = (f"{row['name']} (memory_budget {row['budget_fraction']:g}x)" if row.get("budget_fraction")
                 else row["name"])
        if args.only and not any(o in shown for o in args.only):
            continue
        print(f"[{i + 1}] {row['name']} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        entry = {k: row.get(k) for k in ("name", "group", "xirang", "peer")}
        if row.get("budget_fraction"):
            ref = next((r["result"] for r in results if r["name"] == "DeepSpeed, hand-tuned buckets" and "result" in r),
                       None)
            if ref is None:
                raise SystemExit("preset rows need the hand-tuned baseline row (do not leave it out with --only)")
            row["ds"] = deep_merge(row["ds"], {"xirang": {"memory_budget": int(row["budget_fraction"] * ref["peak_bytes"])}})
            entry["name"] = shown
        entry["ds_config"] = row["ds"]
        try:
            side = run_side(args.model, row["ds"], args.steps, args.world_size, args.data, args.seed, row["xirang"],
                            row.get("peer"))
            entry["result"] = side.as_dict()
        except Exception as e:  # a row that cannot run says why in the table
            entry["error"] = short_error(e)
        entry["wall_s"] = time.perf_counter() - t0
        results.append(entry)
    return {
        "command": shlex.join([os.path.relpath(sys.executable, ROOT)] + [os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
        "model": args.model, "parameters": params, "world_size": args.world_size, "steps": args.steps,
        "data": args.data, "seed": args.seed,
        "environment": {"python": platform.python_version(), "cpus": os.cpu_count(), **_versions()},
        "rows": results,
    }


def _versions() -> dict:
    import deepspeed
    import torch

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__}


def render(data: dict) -> str:
    from xirang_ds.config.types import format_bytes

    by_name = {r["name"]: r for r in data["rows"]}
    ref = by_name.get("DeepSpeed, hand-tuned buckets", {}).get("result")
    params, world = data["parameters"], data["world_size"]
    lines = [f"`{data['model']}` ({params:,} parameters), {world} rank(s) over gloo on CPU, ZeRO-2 bf16, "
             f"micro-batch {BASE['train_micro_batch_size_per_gpu']}, {data['steps']} steps; ratios against "
             "DeepSpeed with hand-tuned buckets; made by `" + data["command"] + "`.", "",
             "| configuration | kind | peak (worst rank) | peak ratio | state bytes/param | step time ratio | "
             "final loss (Δ) |", "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        res = r.get("result")
        if res is None:
            lines.append(f"| {r['name']} | {r['group']} | fails: {r.get('error', '')[:160]} | | | | |")
            continue
        held = res["peak_by_category"].get("optimizer_states", 0)
        block = (r.get("ds_config") or {}).get("xirang", {})
        if "memory_pool" in block and "activations" not in block:
            held += res["peak_by_category"].get("memory_pool", 0)  # the pool holds only the states here
        states = held * world / params
        if ref:
            ratio = f"{res['peak_bytes'] / ref['peak_bytes']:.2f}"
            time_ratio = f"{res['step_time_median_s'] / ref['step_time_median_s']:.2f}"
            loss = f"{res['final_loss']:.4f} ({(res['final_loss'] / ref['final_loss'] - 1) * 100:+.2f}%)"
        else:
            ratio = time_ratio = "-"
            loss = f"{res['final_loss']:.4f}"
        lines.append(f"| {r['name']} | {r['group']} | {format_bytes(res['peak_bytes'])} | {ratio} | {states:.2f} | "
                     f"{time_ratio} | {loss} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--world-size", type=int, default=2, choices=(1, 2))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--data", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", default=None,
                   help="run only rows whose name (as the table shows it) contains one of these")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--render", default=None, metavar="JSON", help="render an earlier run instead of running")
    args = p.parse_args()
    data = load_or_run(args, run, indent=1)
    table = render(data)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
