"""Each preset at ZeRO-2 and ZeRO-3 against plain DeepSpeed at the same stage (the results table's
ds_config: bf16, clipping 1.0, hand-tuned 1e6-element buckets, micro-batch 8 unless --micro-batch), every side in fresh
processes: the worst rank's peak, the median step time and the final loss, with what each preset
left out at that stage (grad_release cannot run at ZeRO-3, so the presets there run without it).

    .venv/bin/python benchmarks/presets_zero.py --model gpt-small --steps 10 --world-size 2 \\
        --data ../shared/data/tinyshakespeare.txt --json benchmarks/results/presets_zero.json
    .venv/bin/python benchmarks/presets_zero.py --model gpt:layers=12,hidden=768,heads=12,seq=256,vocab=50304 \\
        --micro-batch 2 --steps 6 --world-size 2 --data ../shared/data/tinyshakespeare.txt

(the 162M-parameter GPT of issues 18 and 25; on a 2-core CPU without native bf16, such as the
AMD EPYC this ran on, bf16 matmuls take torch's reference path, about 20x slower than fp32 on
gpt-small, and its plain ZeRO-2 side alone runs more than ten minutes, so the eight sides take well
over an hour; `benchmarks/precision.py`'s ``cpu_name`` says which kind a machine is). ``--dtype fp32``
drops the bf16 section; README's 162M table was made that way, at 3 steps.

``--stages 2`` runs one stage, ``--presets aggressive`` one preset; ``--budget balanced=0.5``
(repeatable) gives that preset a ``memory_budget`` of the fraction times plain DeepSpeed's measured
peak at the same stage (issue 18's goals: balanced at 0.5x, aggressive at 0.3x of the 162M GPT's plain ZeRO-2 bf16 peak):

    .venv/bin/python benchmarks/presets_zero.py --model gpt:layers=12,hidden=768,heads=12,seq=256,vocab=50304 \\
        --micro-batch 2 --steps 6 --stages 2 --budget balanced=0.5 --budget aggressive=0.3 --world-size 2 \\
        --data ../shared/data/tinyshakespeare.txt --json benchmarks/results/presets_zero_162m_bf16.json

``--plain-from JSON`` takes plain DeepSpeed's rows from a saved run of the same shape (its bytes
are exact and no plugin changes them; its step time is another run's):

    .venv/bin/python benchmarks/presets_zero.py --model gpt:layers=12,hidden=768,heads=12,seq=256,vocab=50304 \\
        --micro-batch 2 --steps 6 --stages 2 --presets aggressive --budget aggressive=0.3 --world-size 2 \\
        --data ../shared/data/tinyshakespeare.txt --plain-from benchmarks/results/presets_zero_162m_bf16.json

``--extra JSON`` lays keys over every preset's block, for a side by side of one setting (ZeRO-3's
masters as remainders against DeepSpeed's fp32 masters, docs/optimizer_states.md):

    .venv/bin/python benchmarks/presets_zero.py --model gpt-small --steps 10 --stages 3 \
        --presets balanced aggressive --world-size 2 --data ../shared/data/tinyshakespeare.txt \
        --extra '{"optimizer_states": {"masters": "fp32"}}' --json benchmarks/results/presets_zero3_masters_fp32.json

``--render JSON`` prints the Markdown table of a saved run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_table import BASE, TUNED, deep_merge, load_or_run, short_error  # noqa: E402

PRESETS = ("conservative", "balanced", "aggressive")
STAGES = (2, 3)
MODEL_STATES = ("parameters", "gradients", "optimizer_states")
"""The tracker's categories counted as model states at the peak. The memory pool's reservation is shown
apart: it holds the int8/int4 states when the pool is on, and the activations' payloads too."""


def parameter_count(model: str) -> int:
    import torch

    from xirang_ds.models import build_model, parse_model_spec

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(parse_model_spec(model), seed=0).parameters())


def states_per_param(row: dict, params: int, key: str = "peak_by_category") -> str:
    by = row.get(key)
    if not by or not params:
        return ""
    pool = by.get("memory_pool", 0)
    return f"{sum(by.get(k, 0) for k in MODEL_STATES) / params:.2f}" + (f" + pool {pool / 2**20:.2f} MiB" if pool else "")


def stage_config(stage: int, micro_batch: int = BASE["train_micro_batch_size_per_gpu"], dtype: str = "bf16") -> dict:
    config = deep_merge(BASE, TUNED)
    config["train_micro_batch_size_per_gpu"] = micro_batch
    if dtype == "fp32":
        del config["bf16"]
    config["zero_optimization"] = {**config["zero_optimization"], "stage": stage}
    if stage == 3:  # ZeRO-3's own buckets at the same size
        config["zero_optimization"].update(stage3_prefetch_bucket_size=1e6, stage3_param_persistence_threshold=0)
    return config


def left_out(summary: str) -> list[str]:
    return [line.strip().split(":")[0] for line in summary.splitlines() if ": left out of preset " in line]


def run(args: argparse.Namespace) -> dict:
    from xirang_ds.bench import run_side

    data = {"command": shlex.join(["python", "benchmarks/presets_zero.py"] + sys.argv[1:]), "model": args.model,
            "steps": args.steps, "world_size": args.world_size, "micro_batch": args.micro_batch, "dtype": args.dtype,
            "parameters": parameter_count(args.model), "budgets": dict(args.budget), "extra": args.extra, "rows": []}
    for stage in args.stages:
        base = stage_config(stage, args.micro_batch, args.dtype)
        if args.plain_from:
            plain = saved_plain(args, stage)
            data["plain_from"] = args.plain_from
        else:
            print(f"ZeRO-{stage}: plain DeepSpeed ...", file=sys.stderr, flush=True)
            plain = run_side(args.model, base, args.steps, args.world_size, args.data, 0, False)
        data["rows"].append({"stage": stage, "config": "plain", "peak_bytes": plain.peak_bytes,
                             "step_time_s": plain.step_time_median_s, "final_loss": plain.final_loss,
                             "peak_phase": plain.peak_phase, "peak_by_category": plain.peak_by_category,
                             **steady_of(plain)})
        for preset in args.presets:
            print(f"ZeRO-{stage}: preset {preset} ...", file=sys.stderr, flush=True)
            row = {"stage": stage, "config": preset}
            block = deep_merge({"preset": preset}, args.extra or {})
            if preset in data["budgets"]:
                block["memory_budget"] = row["memory_budget"] = int(data["budgets"][preset] * plain.peak_bytes)
            try:
                ours = run_side(args.model, {**base, "xirang": block}, args.steps, args.world_size, args.data, 0, True)
            except Exception as e:  # recorded in the table, the next row still runs
                row["error"] = short_error(e)
            else:
                row.update(peak_bytes=ours.peak_bytes, step_time_s=ours.step_time_median_s,
                           final_loss=ours.final_loss, peak_phase=ours.peak_phase,
                           peak_by_category=ours.peak_by_category,
                           peak_ratio=ours.peak_bytes / plain.peak_bytes,
                           step_time_ratio=ours.step_time_median_s / plain.step_time_median_s,
                           loss_delta=ours.final_loss - plain.final_loss, left_out=left_out(ours.summary),
                           **steady_of(ours))
            data["rows"].append(row)
    return data


def steady_of(side) -> dict:
    """The side's peak over the steps after the first (`bench.SideResult.steady_peak_bytes`), if measured."""
    if getattr(side, "steady_peak_bytes", None) is None:
        return {}
    return {"steady_peak_bytes": side.steady_peak_bytes, "steady_peak_by_category": side.steady_peak_by_category}


def saved_plain(args: argparse.Namespace, stage: int) -> argparse.Namespace:
    """The plain DeepSpeed row of a saved run of the same model, micro-batch, dtype, ranks and steps
    (``--plain-from``: the plain side of the 162M GPT takes most of an hour here; its bytes are exact
    and no plugin changes it). Its step time was measured in another run: compare step times with care."""
    with open(args.plain_from, encoding="utf-8") as f:
        saved = json.load(f)
    want = {"model": args.model, "micro_batch": args.micro_batch, "dtype": args.dtype,
            "world_size": args.world_size, "steps": args.steps}
    differs = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
    rows = [r for r in saved["rows"] if r["stage"] == stage and r["config"] == "plain"]
    if differs or not rows:
        raise SystemExit(f"--plain-from {args.plain_from}: no plain ZeRO-{stage} row of this run "
                         f"(saved vs asked: {differs or 'no such row'})")
    r = rows[0]
    return argparse.Namespace(peak_bytes=r["peak_bytes"], step_time_median_s=r["step_time_s"],
                              final_loss=r["final_loss"], peak_phase=r["peak_phase"],
                              peak_by_category=r["peak_by_category"], steady_peak_bytes=r.get("steady_peak_bytes"),
                              steady_peak_by_category=r.get("steady_peak_by_category"))


def render(data: dict) -> str:
    mib = 2 ** 20
    lines = [f"`{data['model']}`, {data['world_size']} rank(s) over gloo on CPU, {data.get('dtype', 'bf16')}, "
             f"clipping 1.0, 1e6-element buckets, micro-batch {data.get('micro_batch', 8)}, {data['steps']} steps, "
             f"{budget_words(data.get('budgets'))}"
             + (f", every preset with `{json.dumps(data['extra'])}`" if data.get("extra") else "") + "; made by "
             f"`{data['command']}`" + (f" (plain DeepSpeed's rows from `{data['plain_from']}`, another run: its step "
                                       f"time ratios compare runs made at different times)"
                                       if data.get("plain_from") else "") + ".", "",
             "| ZeRO | configuration | peak (worst rank) | peak ratio | model states at the peak (B/param) | "
             "peak phase | step time ratio | final loss (Δ) | left out |",
             "|---|---|---|---|---|---|---|---|---|"]
    params = data.get("parameters", 0)
    steady = any(r.get("steady_peak_bytes") for r in data["rows"])
    if steady:  # the steady steps' peak and model states, after the peak's
        lines[-2] = lines[-2].replace(" peak phase |", " steady peak, model states (B/param) | peak phase |")
        lines[-1] += "---|"
    for r in data["rows"]:
        states, phase = states_per_param(r, params), r.get("peak_phase", "")
        if steady and r.get("steady_peak_bytes"):
            states += (f" | {r['steady_peak_bytes'] / mib:.2f} MiB, "
                       f"{states_per_param(r, params, 'steady_peak_by_category')}")
        elif steady:
            states += " |"
        fraction = r.get("budget_fraction", (data.get("budgets") or {}).get(r["config"]))
        budget = f" (memory_budget {fraction}x)" if "memory_budget" in r else ""
        if "error" in r:
            reason = r["error"].split("problem): ", 1)[-1].split("; raise")[0]
            reason = reason.split(": inputs kept")[0] + ")" if ": inputs kept" in reason else reason
            lines.append(f"| {r['stage']} | preset {r['config']}{budget} | refused: {reason} | | | | | | |"
                         + (" |" if steady else ""))
        elif r["config"] == "plain":
            lines.append(f"| {r['stage']} | plain DeepSpeed | {r['peak_bytes'] / mib:.2f} MiB | 1.00 | {states} | "
                         f"{phase} | 1.00 | {r['final_loss']:.4f} | |")
        else:
            lines.append(f"| {r['stage']} | preset {r['config']}{budget} | {r['peak_bytes'] / mib:.2f} MiB | "
                         f"{r['peak_ratio']:.2f} | {states} | {phase} | {r['step_time_ratio']:.2f} | "
                         f"{r['final_loss']:.4f} ({r['loss_delta']:+.4f}) | {', '.join(r['left_out']) or '-'} |")
    if params:
        lines += ["", f"{params:,} parameters; model states at the peak: the tracker's parameters, gradients and "
                      "optimizer states in the peak's mix, per parameter, worst rank; the memory pool's reservation "
                      "(int8/int4 states and activation payloads, when on) beside it."
                      + (" Steady peak: the same over the steps after the first (the first step's measuring and "
                         "profiling passes left out)." if steady else "")]
    return "\n".join(lines)


def budget_words(budgets: dict | None) -> str:
    if not budgets:
        return "no memory_budget"
    return "memory_budget " + ", ".join(f"{f}x the plain peak for {p}" for p, f in budgets.items()) + \
        (", none for the others" if len(budgets) < len(PRESETS) else "")


def budget_arg(text: str) -> tuple[str, float]:
    preset, _, fraction = text.partition("=")
    if preset not in PRESETS or not fraction:
        raise argparse.ArgumentTypeError(f"--budget {text!r}: expected PRESET=FRACTION with PRESET one of {PRESETS}")
    return preset, float(fraction)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=BASE["train_micro_batch_size_per_gpu"])
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                   help="fp32: the same ds_config without its bf16 section (for CPUs without native bf16)")
    p.add_argument("--world-size", type=int, default=2, choices=(1, 2))
    p.add_argument("--stages", type=int, nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--budget", type=budget_arg, action="append", default=[], metavar="PRESET=FRACTION",
                   help="memory_budget for PRESET as FRACTION of plain DeepSpeed's peak at the same stage")
    p.add_argument("--extra", type=json.loads, default=None, metavar="JSON",
                   help="keys laid over every preset's block (a JSON object)")
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS,
                   help="the presets to run beside plain DeepSpeed (default: all)")
    p.add_argument("--plain-from", default=None, metavar="JSON",
                   help="take plain DeepSpeed's rows from a saved run of the same shape instead of running them")
    p.add_argument("--data", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--render", default=None, metavar="JSON")
    print(render(load_or_run(p.parse_args(), run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
