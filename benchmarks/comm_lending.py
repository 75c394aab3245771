"""comm_buffers.lend_to_activations measured: the same activation plan with and without lending the
reduction arena, against plain DeepSpeed with its default buckets and with hand-tuned ones, at 1 and
2 ranks (gpt-small, ZeRO-2, bf16, every block under ``compress``).

    .venv/bin/python benchmarks/comm_lending.py --steps 10 --data ../shared/data/tinyshakespeare.txt \\
        --json benchmarks/results/comm_buffers/lending.json

Rows: ``default`` / ``hand_tuned`` are plain DeepSpeed (5e8 and 1e6-element buckets);
``auto`` / ``auto_lend``: comm_buffers' rule picks the bucket; ``kept_5e8`` / ``kept_5e8_lend``: the
user keeps DeepSpeed's 5e8 bucket (``zero_optimization.reduce_bucket_size`` set), served from the
arena. Every run uses the same model, data and seed; each side runs in fresh processes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_table import BASE as TABLE_BASE  # noqa: E402
from results_table import deep_merge  # noqa: E402

BASE = {k: v for k, v in TABLE_BASE.items() if k != "gradient_clipping"}
"""The results table's ds_config without clipping (as these runs were made)."""
ACTIVATIONS = {"enabled": True, "planner": False, "compress": ["blocks.*"]}


def block(lend: bool) -> dict:
    return {"xirang": {"comm_buffers": {"enabled": True, "adapt": False, "lend_to_activations": lend},
                       "activations": ACTIVATIONS}}


ROWS = {
    "default": (BASE, False),
    "hand_tuned": (deep_merge(BASE, {"zero_optimization": {"reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6}}),
                   False),
    "auto": (deep_merge(BASE, block(False)), True),
    "auto_lend": (deep_merge(BASE, block(True)), True),
    "kept_5e8": (deep_merge(deep_merge(BASE, {"zero_optimization": {"reduce_bucket_size": 5e8}}), block(False)), True),
    "kept_5e8_lend": (deep_merge(deep_merge(BASE, {"zero_optimization": {"reduce_bucket_size": 5e8}}), block(True)),
                      True),
}


def main(argv=None) -> int:
    from xirang_ds.bench import run_side

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--data", default=None)
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    out = {"command": " ".join(sys.argv), "model": args.model, "steps": args.steps, "data": args.data,
           "machine": f"{platform.machine()} {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"), "runs": {}}
    for world in (int(w) for w in args.world_sizes.split(",")):
        for name, (config, xirang) in ROWS.items():
            result = run_side(args.model, config, args.steps, world, args.data, 0, xirang).as_dict()
            out["runs"][f"{name}_w{world}"] = {"config": config, **result}
            lent = result["plugin_figures"].get("comm_buffers", {}).get("lent_bytes_per_step")
            print(f"{name:14s} w{world}: peak {result['peak_bytes']:>14,}  comm_buffers "
                  f"{result['peak_by_category'].get('comm_buffers', 0):>13,}  activations "
                  f"{result['peak_by_category'].get('activations', 0):>12,}  step {result['step_time_median_s']:.3f} s"
                  f"  loss {result['final_loss']:.4f}" + (f"  lent/step {lent[-1]:,}" if lent else ""), flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
