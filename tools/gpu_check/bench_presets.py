"""The GPU check's bench: plain DeepSpeed once, then each preset under a budget that is a fraction of
the plain peak (as in README's results table), one fresh process per side, on one GPU.

    python tools/gpu_check/bench_presets.py --model gpt:... --json bench.json --deadline-s 200

Every side's result (or its error) goes into one JSON; a side that would start after the deadline is
recorded as skipped, so a slow machine still returns what it measured.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

from xirang_ds.bench import run_side

BASE_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1000,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
    # torch_adam: the GPU machine has no DeepSpeed ops built (prepare.sh builds the wheel without them)
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
}
PRESET_BUDGETS = (("conservative", 0.75), ("balanced", 0.5), ("aggressive", 0.6))
"""Each preset under ``memory_budget`` = this fraction of the plain side's peak (README's table)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", required=True)
    p.add_argument("--deadline-s", type=float, default=200.0, help="start no side after this many seconds")
    args = p.parse_args(argv)
    start = time.monotonic()
    out: dict = {"model": args.model, "steps": args.steps, "world_size": 1, "ds_config": BASE_CONFIG, "sides": {}}

    def side(name: str, ds_config: dict, use_xirang: bool):
        if time.monotonic() - start > args.deadline_s:
            out["sides"][name] = {"skipped": f"deadline of {args.deadline_s:.0f} s passed"}
            return None
        began = time.monotonic()
        try:
            result = run_side(args.model, ds_config, args.steps, 1, None, 0, use_xirang).as_dict()
        except Exception as e:  # recorded, and the next side still runs
            out["sides"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            return None
        result["wall_s"] = time.monotonic() - began
        out["sides"][name] = result
        print(f"{name}: peak {result['peak_bytes']:,} bytes (allocator {result['allocator_peak_bytes']}), "
              f"step {result['step_time_median_s'] * 1000:.0f} ms, loss {result['final_loss']:.4f}", flush=True)
        return result

    plain = side("plain", BASE_CONFIG, False)
    for preset, fraction in PRESET_BUDGETS:
        if plain is None:
            break
        budget = int(plain["peak_bytes"] * fraction)
        config = {**BASE_CONFIG, "xirang": {"preset": preset, "memory_budget": budget}}
        ours = side(f"{preset} (memory_budget {fraction}x)", config, True)
        if ours is not None:
            ours["peak_ratio"] = ours["peak_bytes"] / plain["peak_bytes"]
            ours["step_time_ratio"] = ours["step_time_median_s"] / plain["step_time_median_s"]
            ours["loss_delta"] = ours["final_loss"] - plain["final_loss"]
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
    return 0 if all("error" not in s for s in out["sides"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
