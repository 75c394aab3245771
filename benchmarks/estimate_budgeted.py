"""The estimate of a budgeted run against the run, per preset and budget (issue 57's hold-out cases):
the plan ``xirang-ds estimate`` makes before the run, the one the run took, the predicted peak and the
measured one.

    .venv/bin/python benchmarks/estimate_budgeted.py [--models M ...] [--fractions F ...] \\
        [--out benchmarks/results/activations/estimate_budgeted.json]

For each model: plain DeepSpeed is measured (2 ranks, ZeRO-2 bf16 with 5e5-element buckets, so that its
peak is the model's and not DeepSpeed's default 5e8-element buckets; clipping 1.0, micro-batch 4, 3 steps,
the worst rank's tracker peak); then each preset under ``memory_budget`` = fraction x that peak is
estimated (`xirang_ds.planning.spec.estimate_spec`, 2 ranks, CPU profile) and, where the estimate says
it fits, run the same way. Memory on the CPU is exact, so each row reproduces to the byte.

``bound_peak_bytes`` is the estimate's peak with what only the data decide at its bound (a measured embedding's
optimizer states in fp32), on which the plan and ``fits`` stand; ``null`` where it is the predicted peak.

Each row gives the device bytes per category at the predicted peak (``predicted_by_category``, in
``predicted_phase``) and at the measured one (``measured_by_category``, ``measured_phase``), and their
difference (``miss_by_category``), so the JSON shows where a miss comes from.
"""
from __future__ import annotations

import argparse
import json
import os

from xirang_ds.bench import bench_rank
from xirang_ds.launch import run_ranks
from xirang_ds.memory.categories import DEVICE_CATEGORIES
from xirang_ds.planning.spec import estimate_spec

MODELS = ("gpt-small", "gpt:layers=3,hidden=320,heads=5,seq=96,vocab=1000")
PRESETS = ("conservative", "balanced", "aggressive")
FRACTIONS = (0.35, 0.5, 0.75)
STEPS = 3


def ds_config(block=None) -> dict:
    c = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
         "gradient_clipping": 1.0, "bf16": {"enabled": True},
         "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e5, "allgather_bucket_size": 5e5},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}}
    if block is not None:
        c["xirang"] = block
    return c


def measure(model: str, config: dict) -> dict:
    ranks = run_ranks(bench_rank, 2, model, config, STEPS, None, 0, "xirang" in config)
    worst = max(ranks, key=lambda r: r["peak_bytes"])
    return {"peak_bytes": worst["peak_bytes"], "peak_phase": worst["peak_phase"],
            "peak_by_category": worst["peak_by_category"],
            "plan": (worst.get("plugin_figures") or {}).get("activations", {}).get("plan")}


def _device(by_category: dict) -> dict:
    """Device bytes per category (host memory is off the device and outside the peak)."""
    return {c: int(by_category.get(c, 0)) for c in DEVICE_CATEGORIES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--fractions", nargs="*", type=float, default=list(FRACTIONS))
    ap.add_argument("--presets", nargs="*", default=list(PRESETS))
    ap.add_argument("--out", default="benchmarks/results/activations/estimate_budgeted.json")
    args = ap.parse_args()
    rows = []
    for model in args.models:
        plain = measure(model, ds_config())
        print(f"{model}: plain {plain['peak_bytes']:,} bytes", flush=True)
        for preset in args.presets:
            for fraction in args.fractions:
                budget = int(fraction * plain["peak_bytes"])
                config = ds_config({"preset": preset, "memory_budget": budget})
                est = estimate_spec(model, config, 2)
                plan = est.plans.get("activations")
                row = {"model": model, "preset": preset, "fraction": fraction, "budget_bytes": budget,
                       "plain_peak_bytes": plain["peak_bytes"], "fits": est.fits,
                       "predicted_peak_bytes": est.predicted_peak_bytes, "bound_peak_bytes": est.bound_peak_bytes,
                       "least_budget_bytes": est.least_budget_bytes,
                       "estimate_plan": plan.plan if plan is not None else None,
                       "predicted_phase": est.peak_phase, "predicted_by_category": _device(est.by_category)}
                if est.fits:
                    run = measure(model, config)
                    row.update(measured_peak_bytes=run["peak_bytes"], run_plan=run["plan"],
                               same_plan=run["plan"] == row["estimate_plan"],
                               error=(est.predicted_peak_bytes - run["peak_bytes"]) / run["peak_bytes"],
                               measured_phase=run["peak_phase"], measured_by_category=_device(run["peak_by_category"]))
                    # where the miss comes from: predicted less measured, per category at each side's peak
                    row["miss_by_category"] = {c: row["predicted_by_category"][c] - row["measured_by_category"][c]
                                               for c in DEVICE_CATEGORIES}
                rows.append(row)
                shown = f"{row['error']:+.1%}" if "error" in row else "refused before the run"
                print(f"  {preset} at {fraction}: predicted {est.predicted_peak_bytes:,}, "
                      f"measured {row.get('measured_peak_bytes', '-')}, {shown}, same plan {row.get('same_plan')}",
                      flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"command": "benchmarks/estimate_budgeted.py", "models": args.models, "presets": args.presets,
                   "fractions": args.fractions, "steps": STEPS, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
