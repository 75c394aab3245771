"""The fused update's kernel on the CPU with a static and a dynamic length, side by side: why a
tensor stays in static chunks on the CPU (plugins/optimizer_states/fused.py).

    .venv/bin/python benchmarks/fused_dynamic_tail.py --threads 2

For each format: the first call's time (compilation) and the median time of one 131,072-element
chunk over ``--rounds`` calls, the static graph (``dynamic=False``, what full chunks use) against the
dynamic-length one (``dynamic=True``, what a whole tensor uses off the CPU).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from xirang_ds.plugins.optimizer_states.formats import make_format
from xirang_ds.plugins.optimizer_states.fused import chunk_step, hyper_tensor, whole_step
from xirang_ds.plugins.optimizer_states.update import AdamHyper


def one(fmt_name: str, dynamic: bool, numel: int, rounds: int) -> tuple[float, float]:
    fmt = make_format(fmt_name)
    kernel = torch.compile(whole_step if dynamic else chunk_step, dynamic=dynamic, fullgraph=True)
    p, g = torch.randn(numel), torch.randn(numel)
    bufs = {k: v for m in ("exp_avg", "exp_avg_sq") for k, v in fmt.zeros(m, numel, p.device).items()}
    args = (fmt, p, g, fmt.window("exp_avg", bufs, 0, numel), fmt.window("exp_avg_sq", bufs, 0, numel),
            hyper_tensor(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True), 1, p.device))
    start = time.perf_counter()
    kernel(*args)
    first = time.perf_counter() - start
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        kernel(*args)
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=131072)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"format  length   first call  per call ({args.numel:,} elements, {args.threads} thread(s))")
    for name in ("bf16", "int8", "int4"):
        for dynamic in (False, True):
            first, per = one(name, dynamic, args.numel, args.rounds)
            print(f"{name:6}  {'dynamic' if dynamic else 'static':7}  {first:8.1f} s  {per * 1e3:8.2f} ms", flush=True)


if __name__ == "__main__":
    main()
