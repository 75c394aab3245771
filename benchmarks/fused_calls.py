"""The low-bit update's kernel calls per step and CPU time per parameter: eager, compiled in chunks (the
CPU's way) and compiled one call per tensor (the way off the CPU), at 1x and 13x the parameters.

    .venv/bin/python benchmarks/fused_calls.py --threads 1 --out benchmarks/results/optimizer_states_fused_calls.json

For each format (int8, int4, bf16) and way, three tensors (a weight, a bias-sized vector and a
smaller weight, each ending inside a block) are stepped ``--steps`` times: ``optimizer_kernels`` is
`xirang_ds.step_counts.count_ops`' count of one step (a compiled call counts one), ``ns_per_param``
the median step time over the parameters. The first steps (compilation) are not timed.

``--no-master`` runs only the rows of issue 58's no-master update and merges them into ``--out``: int8 states
rounded stochastically, bf16 weights updated in place and rounded stochastically (grad_release's
``masters: none`` with optimizer_states, its ``xirang_weight_noise`` and ``xirang_write_back`` set as
`grad_release.masters.MasterSlices` sets them), dtype ``"int8 no master"``; and the same with fp32 states (the
norms and biases a preset keeps in fp32 there), dtype ``"fp32 no master"``.
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


NO_MASTER = {"int8 no master": "int8", "fp32 no master": "fp32"}
"""The no-master rows' dtypes → their states' format."""


def _no_master(params: list[torch.Tensor], steps: list[int]) -> None:
    """Make bf16 ``params`` grad_release's in-place ``masters: none`` views: rounded stochastically with the
    noise of a bucket's seed at step ``steps[0]``."""
    from xirang_ds.plugins.grad_release.masters import MasterSlices
    from xirang_ds.plugins.grad_release.stochastic import noise_seed

    for i, p in enumerate(params):
        p.xirang_weight_noise = lambda i=i: (noise_seed(i, steps[0], 0), 0)
        p.xirang_write_back = MasterSlices._stochastic_write_back(p)


def one(dtype: str, way: str, scale: int, steps: int) -> dict[str, Any]:
    fused, whole = WAYS[way]
    fused_module.whole_tensor = (lambda device_type: True) if whole else (lambda device_type: False)
    torch.manual_seed(0)
    no_master = dtype in NO_MASTER
    params = [torch.nn.Parameter(torch.randn((scale * s[0],) + s[1:]).to(torch.bfloat16 if no_master else torch.float32))
              for s in SHAPES]
    done = [0]
    if no_master:
        _no_master(params, done)
    opt = DynamicAdamW(params, lr=1e-3, states={"schedule": [{"dtype": NO_MASTER.get(dtype, dtype)}], "min_numel": 0,
                                                "fused": fused, "stochastic_rounding": no_master})
    opt.register_step_post_hook(lambda *args: done.__setitem__(0, done[0] + 1))
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
    parser.add_argument("--no-master", action="store_true", help="only the no-master rows, merged into --out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in tuple(NO_MASTER) if args.no_master else ("int8", "int4", "bf16"):
        for way in WAYS:
            for scale in (1, 13):
                row = one(dtype, way, scale, args.steps)
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = {"command": f"python benchmarks/fused_calls.py --threads {args.threads} --steps {args.steps}"
                      + (f" --out {args.out}" if args.out else ""),
           "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "threads": args.threads, "shapes": [list(s) for s in SHAPES], "rows": rows}
    if args.out and args.no_master:  # the other rows as they were measured
        with open(args.out) as f:
            old = json.load(f)
        old["rows"] = [r for r in old["rows"] if r["dtype"] not in NO_MASTER] + rows
        old["no_master_command"] = out["command"].replace(" --out", " --no-master --out")
        out = old
    if args.out:
        write_json(out, args.out)


if __name__ == "__main__":
    main()
