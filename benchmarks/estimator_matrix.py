"""Estimator error over a matrix of real DeepSpeed runs on CPU (a regression matrix: first run as a
hold-out, some of its rows have driven estimator fixes since, docs/observability.md).

    .venv/bin/python benchmarks/estimator_matrix.py [--only SUBSTRING] [--out benchmarks/results/estimator_matrix.json]

Two models that no estimator change was made against before the matrix's first run (a GPT and a
Llama decoder with their own widths, sequence lengths and vocabularies), and a design that crosses every ZeRO stage with
micro-batch 1 to 8, gradient accumulation 1 and 4, clipping on and off, torch's Adam and DeepSpeed's
fused Adam (its CPU build), reduction buckets of 5e5, 1e6, 3e7 and DeepSpeed's default, overlap_comm,
bf16 and fp32, 1 and 2 ranks; then each xirang section alone and each preset, over both models.

Each configuration trains 3 steps with the live-storage tracker on (the worst rank's peak and its
phase are the measurement) and is estimated by `xirang_ds.planning.estimator` without running. Memory on
CPU is exact, so the table is reproducible to the byte. The configurations the estimator's changes
were made against (gpt-small, llama-small, gpt-medium and others) are `DEV`, run with ``--dev``.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from xirang_ds.bench import bench_rank
from xirang_ds.launch import run_ranks
from xirang_ds.planning.spec import estimate_spec

MODELS = ("gpt:layers=3,hidden=320,heads=5,seq=96,vocab=1000", "llama:layers=3,hidden=256,heads=4,seq=160,vocab=768")


def ds(stage: int, dtype: str, micro: int, bucket: Optional[float], overlap: Optional[bool] = None, gas: int = 1,
       clip: float = 0.0, fused: bool = False, block: Optional[dict] = None) -> dict:
    params: dict = {"lr": 1e-3, "weight_decay": 0.01}
    if not fused:
        params["torch_adam"] = True
    c: dict = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
               "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": params}}
    if bucket is not None:
        c["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
        if stage == 3:
            c["zero_optimization"]["stage3_prefetch_bucket_size"] = bucket
    if overlap is not None:
        c["zero_optimization"]["overlap_comm"] = overlap
    if clip:
        c["gradient_clipping"] = clip
    if dtype == "bf16":
        c["bf16"] = {"enabled": True}
    if block is not None:
        c["xirang"] = block
    return c


# (stage-independent) plain variants: micro-batch, accumulation, clipping, optimizer, bucket, ranks, dtype, overlap
PLAIN = (
    dict(micro=1, bucket=5e5, world=1),
    dict(micro=8, bucket=3e7, world=2, clip=1.0),
    dict(micro=3, bucket=5e5, world=2, gas=4, clip=1.0, fused=True),
    dict(micro=2, bucket=None, world=1, fused=True),
    dict(micro=5, bucket=3e7, world=1, gas=4, dtype="fp32"),
    dict(micro=4, bucket=1e6, world=2, clip=0.5, fused=True, overlap=True),
)

SECTIONS = {
    "optimizer_states": {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]}},
    "grad_release": {"grad_release": {"enabled": True}},
    "comm_buffers": {"comm_buffers": {"enabled": True}},
    "memory_pool": {"memory_pool": {"enabled": True}},
    "monitor": {"monitor": {"enabled": True}},
    "activations": {"activations": {"enabled": True}},
    "precision": {"precision": {"enabled": True}},
    "preset conservative": {"preset": "conservative"},
    "preset balanced": {"preset": "balanced"},
    "preset aggressive": {"preset": "aggressive"},
}


def _matrix() -> list[tuple[str, str, dict, int]]:
    rows = []
    for model in MODELS:
        for stage in (0, 1, 2, 3):
            for v in PLAIN:
                v = dict(v)
                world = v.pop("world")
                dtype = v.pop("dtype", "bf16")
                c = ds(stage, dtype, v.pop("micro"), v.pop("bucket"), **v)
                rows.append((describe(model, c, world), model, c, world))
    for model, (stage, micro, gas, clip) in zip(MODELS, ((2, 4, 1, 1.0), (1, 2, 4, 0.0))):
        for name, block in SECTIONS.items():
            c = ds(stage, "bf16", micro, 1e6, gas=gas, clip=clip, block=block)
            rows.append((describe(model, c, 2) + f" + {name}", model, c, 2))
    return rows


def _dev() -> list[tuple[str, str, dict, int]]:
    plain = (
        [("gpt-small", ds(s, d, 8, 1e6), 1) for s in (0, 1, 2, 3) for d in ("bf16", "fp32")]
        + [("gpt-small", ds(s, "bf16", 8, 1e6), 2) for s in (0, 1, 2, 3)]
        + [("gpt-small", ds(2, "bf16", 8, None), 1), ("gpt-small", ds(2, "bf16", 8, None), 2),
           ("gpt-small", ds(2, "bf16", 8, 1e5), 1)]
        + [("llama-small", ds(0, "bf16", 4, 1e6), 1), ("llama-small", ds(0, "bf16", 16, 1e6), 1),
           ("llama-small", ds(2, "bf16", 4, 1e6), 2), ("llama-small", ds(2, "bf16", 16, 1e6), 1)]
        + [("gpt-medium", ds(2, "bf16", 2, 1e6), 2), ("gpt-medium", ds(0, "fp32", 2, 1e6), 1)]
        + [("gpt-small", ds(2, "bf16", 8, 1e6, overlap=True), 2), ("gpt-small", ds(2, "bf16", 4, 1e6, gas=2), 2)]
        + [("gpt-small", ds(1, "fp32", 8, 1e6), 2), ("gpt-small", ds(3, "fp32", 4, 1e6), 2)]
        + [("gpt-small", ds(s, "bf16", 2, 5e5, fused=True), w) for s in (0, 1, 3) for w in (1, 2)]
        + [("gpt-small", ds(s, "bf16", 1, 3e7, gas=4), w) for s in (1, 2) for w in (1, 2)]
    )
    return [(describe(m, c, w), m, c, w) for m, c, w in plain]


def describe(model: str, c: dict, world: int) -> str:
    z = c["zero_optimization"]
    dtype = "bf16" if "bf16" in c else "fp32"
    bucket = z.get("reduce_bucket_size")
    opt = "torch_adam" if c["optimizer"]["params"].get("torch_adam") else "fused_adam"
    extra = ((" overlap" if z.get("overlap_comm") else "")
             + (f" gas{c['gradient_accumulation_steps']}" if c["gradient_accumulation_steps"] > 1 else "")
             + (f" clip{c['gradient_clipping']}" if c.get("gradient_clipping") else ""))
    return (f"{model} ZeRO-{z['stage']} {dtype} mb{c['train_micro_batch_size_per_gpu']} {opt} "
            f"bucket {'default' if bucket is None else f'{bucket:.0e}'} {world} rank(s){extra}")


def measure(label: str, model: str, c: dict, world: int) -> dict:
    per_rank = run_ranks(bench_rank, world, model, c, 3, None, 0, "xirang" in c, threads=1)
    worst = max(per_rank, key=lambda r: r["peak_bytes"])
    est = estimate_spec(model, c, world)
    err = (est.predicted_peak_bytes - worst["peak_bytes"]) / worst["peak_bytes"]
    unmodelled = [n for n in est.notes if "not modelled" in n]
    return {"config": label, "model": model, "ds_config": c, "world_size": world,
            "measured_peak_bytes": worst["peak_bytes"], "measured_phase": worst["peak_phase"],
            "predicted_peak_bytes": est.predicted_peak_bytes, "predicted_phase": est.peak_phase,
            "error": err, "modelled": not unmodelled, "notes": unmodelled}


def summarize(rows: list[dict]) -> dict:
    modelled = [r for r in rows if r["modelled"]]
    errors = [abs(r["error"]) for r in modelled]
    return {"configs": len(rows), "modelled": len(modelled), "max_abs_error": max(errors, default=0.0),
            "within_2_percent": sum(e <= 0.02 for e in errors), "within_5_percent": sum(e <= 0.05 for e in errors),
            "phase_right": sum(r["measured_phase"] == r["predicted_phase"] for r in modelled),
            "not_modelled": [r["config"] for r in rows if not r["modelled"]]}


def render(data: dict) -> str:
    lines = ["| configuration | measured peak (bytes) | phase | predicted (bytes) | phase | error |",
             "|---|---:|---|---:|---|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['config']} | {r['measured_peak_bytes']:,} | {r['measured_phase']} | "
                     f"{r['predicted_peak_bytes']:,} | {r['predicted_phase']} | {r['error'] * 100:+.2f}% |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dev", action="store_true", help="the configurations the estimator was fitted on")
    p.add_argument("--only", default="", help="run the configurations whose label contains this")
    p.add_argument("--render", metavar="JSON", help="print the Markdown table of a saved run (docs/observability.md)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            print(render(json.load(f)))
        return
    name = "estimator_dev.json" if args.dev else "estimator_matrix.json"
    out = args.out or os.path.join(os.path.dirname(__file__), "results", name)
    rows = []
    for label, model, c, world in (_dev() if args.dev else _matrix()):
        if args.only not in label:
            continue
        rows.append(measure(label, model, c, world))
        r = rows[-1]
        print(f"{label:<110} measured {r['measured_peak_bytes']:>13,} ({r['measured_phase']})  predicted "
              f"{r['predicted_peak_bytes']:>13,} ({r['predicted_phase']})  {r['error']:+.2%}"
              + ("" if r["modelled"] else "  [not modelled]"), flush=True)
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    if not args.only:
        cmd = "benchmarks/estimator_matrix.py" + (" --dev" if args.dev else "")
        with open(out, "w") as f:
            json.dump({"command": cmd, "summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
