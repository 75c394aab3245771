"""The estimate against the measured peak where grad_release's buckets update in backward (no held pass), beside a
held pass as a control: the miss the estimate had there and what it is now.

    .venv/bin/python benchmarks/estimate_in_backward.py --label after \\
        --out benchmarks/results/grad_release/estimate_in_backward.json

gpt-small, 2 ranks over gloo, ZeRO-2 bf16, micro-batch 1, 1e6-element DeepSpeed buckets, clipping 1.0, 3 steps
(the setup of the ``PREVIOUS_STEP`` cases of ``tests/memory/test_deepspeed_estimator.py``); the worst rank's
tracker peak against `xirang_ds.planning.spec.estimate_spec`'s prediction. Cases: clipping by the previous
step's norm (each bucket updates as it is reduced) with the optimizer states on the device and in host memory,
and exact clipping (a held pass: updates after backward) with the states in host memory. ``--label`` names the
run in the JSON, which keeps the runs of other labels already there (``before``: this script run against the
package at commit 00e6da5, with ``PYTHONPATH`` set to a checkout of it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

from xirang_ds.bench import bench_rank, write_json
from xirang_ds.launch import run_ranks
from xirang_ds.planning.spec import estimate_spec

MODEL = "gpt-small"
CASES = {
    "previous_step, states device": {"enabled": True, "clipping": "previous_step"},
    "previous_step, states host": {"enabled": True, "clipping": "previous_step", "states": "host"},
    "exact (held pass), states host": {"enabled": True, "states": "host"},
}


def ds_config(grad_release: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
            "gradient_clipping": 1.0, "bf16": {"enabled": True}, "xirang": {"grad_release": dict(grad_release)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = {}
    for name, block in CASES.items():
        config = ds_config(block)
        worst = max(run_ranks(bench_rank, 2, MODEL, config, 3, None, 0, True), key=lambda r: r["peak_bytes"])
        est = estimate_spec(MODEL, config, 2)
        rows[name] = {"measured_bytes": worst["peak_bytes"], "measured_phase": worst["peak_phase"],
                      "measured_by_category": worst["peak_by_category"], "predicted_bytes": est.predicted_peak_bytes,
                      "predicted_phase": est.peak_phase,
                      "error": round(est.predicted_peak_bytes / worst["peak_bytes"] - 1, 4)}
        print(name, json.dumps(rows[name]), flush=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import xirang_ds
    package = os.path.dirname(os.path.dirname(os.path.abspath(xirang_ds.__file__)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=package, capture_output=True,
                            text=True).stdout.strip()
    out = {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)
    out.setdefault("setup", "gpt-small, 2 ranks, ZeRO-2 bf16, micro-batch 1, 1e6-element buckets, clipping 1.0, "
                            "3 steps; worst rank's tracker peak against estimate_spec")
    out.setdefault("runs", {})[args.label] = {
        "command": f"python benchmarks/estimate_in_backward.py --label {args.label}"
                   + (f" --out {args.out}" if args.out else ""),
        "package_commit": commit, "rows": rows}
    if args.out:
        write_json(out, os.path.join(root, args.out) if not os.path.isabs(args.out) else args.out)


if __name__ == "__main__":
    main()
