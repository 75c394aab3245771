"""grad_release's step time against plain ZeRO-2 in one run (issue 22 item 4), no memory tracker.

    .venv/bin/python benchmarks/grad_release_step_time.py --model gpt-small --world-size 2 --steps 12 \\
        --repeats 3 --json benchmarks/results/grad_release/step_time.json

Sides, alternating ``--repeats`` times, each a fresh 2-rank run: plain DeepSpeed ZeRO-2 (fp32 by
default, ``--dtype``; clipping 1.0; ``reduce_bucket_size`` and ``allgather_bucket_size``
``--bucket``), grad_release with its ``auto`` bucket size (1/16 of the trainable elements raised toward the link's
90%-bandwidth size, at most 1/8: 415,424 elements on gpt-small over gloo at 2 ranks), and
grad_release with ``bucket_size_numel`` equal to plain's ``reduce_bucket_size`` (the same number of
collectives). Each run gives the median of its steps after the third (the slowest rank's time per
step); the table shows each side's median over repeats and its ratio to plain per repeat.

fp32 is the default because this machine's CPU has no native bf16 (an AMD EPYC without
AVX512-BF16): its bf16 matmuls take torch's reference path, about 20x slower than fp32 on
gpt-small, which would dilute every fixed cost of grad_release into the noise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from precision import alternate_sides, cpu_name, ds  # noqa: E402


def config(dtype: str, micro: int, bucket: float, block: dict | None) -> dict:
    cfg = {**ds(2, micro, dtype, block=block), "gradient_clipping": 1.0}
    cfg["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    return cfg


def run(model: str, world: int, steps: int, repeats: int, dtype: str, micro: int, bucket: float) -> dict:
    sides = {"plain_zero2": (config(dtype, micro, bucket, None), False),
             "grad_release_auto_buckets": (config(dtype, micro, bucket, {"grad_release": {"enabled": True}}), True),
             "grad_release_plain_buckets": (config(dtype, micro, bucket, {"grad_release": {
                 "enabled": True, "bucket_size_numel": int(bucket)}}), True)}
    medians, losses = alternate_sides(sides, model, world, steps, repeats)
    ratios = {k: [t / p for t, p in zip(v, medians["plain_zero2"])] for k, v in medians.items() if k != "plain_zero2"}
    return {"model": model, "world_size": world, "zero_stage": 2, "dtype": dtype, "micro_batch": micro,
            "gradient_clipping": 1.0, "plain_bucket_numel": int(bucket), "steps": steps, "repeats": repeats,
            "step_time_median_s": medians, "ratio_to_plain": ratios,
            "ratio_to_plain_median": {k: statistics.median(v) for k, v in ratios.items()},
            "final_loss_rank0": losses, "cpu": cpu_name()}


def render(result: dict) -> str:
    lines = [f"{result['model']}, {result['world_size']} ranks, ZeRO-2 {result['dtype']}, micro-batch "
             f"{result['micro_batch']}, clipping 1.0, plain buckets {result['plain_bucket_numel']:,} elements:", "",
             "| side | s/step (median of repeats) | ratio to plain per repeat | median ratio |", "|---|---|---|---|"]
    for name, times in result["step_time_median_s"].items():
        ratios = result["ratio_to_plain"].get(name, [])
        median = result["ratio_to_plain_median"].get(name, 1.0)
        lines.append(f"| {name} | {statistics.median(times):.4f} | {', '.join(f'{r:.3f}' for r in ratios)} | "
                     f"{median:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--bucket", type=float, default=5e5, help="plain ZeRO-2's reduce/allgather bucket size")
    parser.add_argument("--json")
    parser.add_argument("--render", help="print the table of a saved run")
    args = parser.parse_args()
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            print(render(json.load(f)))
        return
    result = run(args.model, args.world_size, args.steps, args.repeats, args.dtype, args.micro_batch, args.bucket)
    result["command"] = " ".join(["python", *sys.argv])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(render(result))


if __name__ == "__main__":
    main()
