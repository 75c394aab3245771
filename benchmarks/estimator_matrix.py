"""Estimator error over a matrix of real DeepSpeed runs on CPU (ZeRO 0-3, bf16/fp32, micro-batch and
sequence sizes, bucket sizes, 1 and 2 ranks, overlap_comm, gradient accumulation).

    .venv/bin/python benchmarks/estimator_matrix.py [--out benchmarks/results/estimator_matrix.json]

Each configuration trains 3 steps of a built-in model with the live-storage tracker on (the worst
rank's peak is the measurement) and is estimated by `xirang_ds.memory.estimator` without running.
Memory on CPU is exact, so the table is reproducible to the byte.
"""
from __future__ import annotations

import argparse
import json
import os

from xirang_ds.bench import bench_rank
from xirang_ds.launch import run_ranks
from xirang_ds.memory.estimator import estimate_spec


def ds(stage: int, dtype: str, micro: int, bucket: float | None, overlap: bool | None = None, gas: int = 1) -> dict:
    c: dict = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
               "zero_optimization": {"stage": stage},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    if bucket is not None:
        c["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
        if stage == 3:
            c["zero_optimization"]["stage3_prefetch_bucket_size"] = bucket
    if overlap is not None:
        c["zero_optimization"]["overlap_comm"] = overlap
    if dtype == "bf16":
        c["bf16"] = {"enabled": True}
    return c


MATRIX = (
    [("gpt-small", ds(s, d, 8, 1e6), 1) for s in (0, 1, 2, 3) for d in ("bf16", "fp32")]
    + [("gpt-small", ds(s, "bf16", 8, 1e6), 2) for s in (0, 1, 2, 3)]
    + [("gpt-small", ds(2, "bf16", 8, None), 1), ("gpt-small", ds(2, "bf16", 8, None), 2),
       ("gpt-small", ds(2, "bf16", 8, 1e5), 1)]
    + [("llama-small", ds(0, "bf16", 4, 1e6), 1), ("llama-small", ds(0, "bf16", 16, 1e6), 1),
       ("llama-small", ds(2, "bf16", 4, 1e6), 2), ("llama-small", ds(2, "bf16", 16, 1e6), 1)]
    + [("gpt-medium", ds(2, "bf16", 2, 1e6), 2), ("gpt-medium", ds(0, "fp32", 2, 1e6), 1)]
    + [("gpt:layers=4,hidden=256,heads=8,seq=256,vocab=256", ds(1, "bf16", 4, 1e6), 1)]
    + [("gpt-small", ds(2, "bf16", 8, 1e6, overlap=True), 2), ("gpt-small", ds(2, "bf16", 4, 1e6, gas=2), 2)]
    + [("gpt-small", ds(1, "fp32", 8, 1e6), 2), ("gpt-small", ds(3, "fp32", 4, 1e6), 2)]
)


def describe(model: str, c: dict, world: int) -> str:
    z = c["zero_optimization"]
    dtype = "bf16" if "bf16" in c else "fp32"
    bucket = z.get("reduce_bucket_size")
    extra = (" overlap" if z.get("overlap_comm") else "") + (f" gas{c['gradient_accumulation_steps']}"
                                                              if c["gradient_accumulation_steps"] > 1 else "")
    return (f"{model} ZeRO-{z['stage']} {dtype} mb{c['train_micro_batch_size_per_gpu']} "
            f"bucket {'default' if bucket is None else f'{bucket:.0e}'} {world} rank(s){extra}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "estimator_matrix.json"))
    args = p.parse_args()
    rows = []
    for model, c, world in MATRIX:
        per_rank = run_ranks(bench_rank, world, model, c, 3, None, 0, False, threads=1)
        worst = max(per_rank, key=lambda r: r["peak_bytes"])
        est = estimate_spec(model, c, world)
        err = (est.predicted_peak_bytes - worst["peak_bytes"]) / worst["peak_bytes"]
        rows.append({"config": describe(model, c, world), "model": model, "ds_config": c, "world_size": world,
                     "measured_peak_bytes": worst["peak_bytes"], "measured_phase": worst["peak_phase"],
                     "predicted_peak_bytes": est.predicted_peak_bytes, "predicted_phase": est.peak_phase,
                     "error": err})
        print(f"{rows[-1]['config']:<70} measured {worst['peak_bytes']:>13,}  predicted "
              f"{est.predicted_peak_bytes:>13,}  {err:+.2%}", flush=True)
    errors = [abs(r["error"]) for r in rows]
    summary = {"configs": len(rows), "max_abs_error": max(errors),
               "within_5_percent": sum(e <= 0.05 for e in errors), "within_10_percent": sum(e <= 0.10 for e in errors)}
    print(summary)
    with open(args.out, "w") as f:
        json.dump({"command": "benchmarks/estimator_matrix.py", "summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
