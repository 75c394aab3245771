"""ZeRO-3's masters where the optimizer step is the peak: fp32 masters, parked masters with the plugin's
sub-groups (``masters: auto``), and parked masters with one sub-group per param group (DeepSpeed's
``sub_group_size`` 1e9), each side by side with the estimate (docs/optimizer_states.md).

    .venv/bin/python benchmarks/masters_step_bound.py --json benchmarks/results/masters_step_bound.json

A small-sequence, embedding-heavy GPT at micro-batch 1 (`gpt:layers=2,hidden=256,heads=4,seq=16,vocab=512`),
ZeRO-3 bf16, int8 states, 2 ranks, 3 steps; the worst rank's peak from the live-storage tracker.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODEL = "gpt:layers=2,hidden=256,heads=4,seq=16,vocab=512"
SIDES = (("fp32 masters", "fp32", None), ("parked, the plugin's sub-groups", "auto", None),
         ("parked, sub_group_size 1e9", "auto", 1e9))


def main() -> int:
    from tests.harness.engine_runs import ds_config
    from xirang_ds.bench import bench_rank
    from xirang_ds.launch import run_ranks
    from xirang_ds.planning.spec import estimate_spec

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for name, masters, sub in SIDES:
        block = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}], "min_numel": 0,
                                      "masters": masters}}
        config = ds_config(stage=3, dtype="bf16", micro=1, bucket=1e6, xirang=block)
        if sub:
            config["zero_optimization"]["sub_group_size"] = sub
        runs = run_ranks(bench_rank, 2, MODEL, config, 3, None, 0, True)
        worst = max(runs, key=lambda r: r["peak_bytes"])
        estimate = estimate_spec(MODEL, config, 2)
        rows.append({"side": name, "peak_bytes": worst["peak_bytes"], "peak_phase": worst["peak_phase"],
                     "predicted_peak_bytes": estimate.predicted_peak_bytes, "predicted_phase": estimate.peak_phase})
        print(f"{name:<34} peak {worst['peak_bytes']:>12,} ({worst['peak_phase']}) "
              f"estimate {estimate.predicted_peak_bytes:>12,} ({estimate.peak_phase})", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"command": " ".join(["python", "benchmarks/masters_step_bound.py"] + sys.argv[1:]),
                       "model": MODEL, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
