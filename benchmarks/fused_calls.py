"""The low-bit update's kernel calls per step and CPU time per parameter: eager, compiled in chunks (the
CPU's way) and compiled one call per tensor (the way off the CPU), at 1x and 13x the parameters.

    .venv/bin/python benchmarks/fused_calls.py --threads 1 --out benchmarks/results/optimizer_states_fused_calls.json

For each format (int8, int4, bf16) and way, three tensors (a weight, a bias-sized vector and a
smaller weight, each ending inside a block) are stepped ``--steps`` times: ``optimizer_kernels`` is
`xirang_ds.step_counts.count_ops`' count of one step (a compiled call counts one), ``ns_per_param``
the median step time over the parameters. The first steps (compilation) are not timed.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from xirang_ds.bench import write_json
from xirang_ds.plugins.optimizer_states import DynamicAdamW
from xirang_ds.plugins.optimizer_states import fused as fused_module
from xirang_ds.step_counts import count_ops

SHAPES = ((255, 1024), (1000,), (64, 1000))
"""About 0.33M elements; the 13x run scales the first dimension."""
WAYS = {"eager": (False, False), "compiled chunks": (True, False), "compiled whole tensors": (True, True)}
"""Way → (``fused``, one call per tensor)."""


def one(dtype: str, way: str, scale: int, steps: int) -> dict[str, Any]:
    fused, whole = WAYS[way]
    fused_module.whole_tensor = (lambda device_type: True) if whole else (lambda device_type: False)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn((scale * s[0],) + s[1:])) for s in SHAPES]
    opt = DynamicAdamW(params, lr=1e-3, states={"schedule": [{"dtype": dtype}], "min_numel": 0, "fused": fused})
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    for _ in range(2):  # states made, graphs compiled
        opt.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    counter = count_ops(opt.step)[1]
    numel = sum(p.numel() for p in params)
    return {"dtype": dtype, "way": way, "scale": scale, "numel": numel, "tensors": len(params),
            "optimizer_kernels": counter.optimizer_kernels, "host_syncs": counter.host_syncs,
            "ns_per_param": round(statistics.median(times) / numel * 1e9, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in ("int8", "int4", "bf16"):
        for way in WAYS:
            for scale in (1, 13):
                row = one(dtype, way, scale, args.steps)
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = {"command": f"python benchmarks/fused_calls.py --threads {args.threads} --steps {args.steps}"
                      + (f" --out {args.out}" if args.out else ""),
           "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "threads": args.threads, "shapes": [list(s) for s in SHAPES], "rows": rows}
    if args.out:
        write_json(out, args.out)


if __name__ == "__main__":
    main()
