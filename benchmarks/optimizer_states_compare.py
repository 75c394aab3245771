"""Side by side on the same tensors: optimizer-state bytes per parameter and update time per parameter
of torch AdamW, DynamicAdamW in each format (eager, and with ``fused: true``: one compiled kernel per
chunk), torchao AdamW8bit/AdamW4bit and bitsandbytes AdamW8bit.

    .venv/bin/python benchmarks/optimizer_states_compare.py --numel 4194304 --rounds 15 \
        --threads 1 --json benchmarks/results/optimizer_states_compare.json
    .venv/bin/python benchmarks/optimizer_states_compare.py --shapes 1024x1024,1024x1024,1024x1024,\
        1024x1024,4096x4096 --rounds 9 --threads 2 --json benchmarks/results/optimizer_states_fused.json

Bytes: every tensor the optimizer keeps in ``state`` after a step (torchao's tensor subclasses are
opened into codes, scales and map). Time: the optimizers step in turn within each round, so a
burst of load on a shared machine hits them alike; the median over rounds is reported (the first
step, with state creation and torchao's compilation, is not timed).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
import warnings
from typing import Any, Callable

import torch

from xirang_ds.bench import write_json


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state``; tensor subclasses counted by their parts."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor:
                names, _ = value.__tensor_flatten__()
                total += sum(getattr(value, n).numel() * getattr(value, n).element_size() for n in names)
            else:
                total += value.numel() * value.element_size()
    return total


def candidates(device: str = "cpu") -> dict[str, Callable[[list], torch.optim.Optimizer]]:
    """Optimizer factories by name; libraries that do not import are left out. Off the CPU also the
    fused formats with 32x longer chunks: how much of the step is per-chunk dispatch."""
    from xirang_ds.plugins.optimizer_states import DynamicAdamW

    out: dict[str, Callable[[list], torch.optim.Optimizer]] = {
        "torch.optim.AdamW (single tensor)": lambda ps: torch.optim.AdamW(ps, foreach=False),
        "torch.optim.AdamW (fused)": lambda ps: torch.optim.AdamW(ps, fused=True),
    }
    for dtype in ("fp32", "bf16", "int8", "int4"):
        out[f"xirang DynamicAdamW {dtype}"] = (
            lambda ps, d=dtype: DynamicAdamW(ps, states={"schedule": [{"dtype": d}], "fused": False}))
    for dtype in ("bf16", "int8", "int4"):
        out[f"xirang DynamicAdamW {dtype} fused"] = (
            lambda ps, d=dtype: DynamicAdamW(ps, states={"schedule": [{"dtype": d}], "fused": True}))
    if device != "cpu":
        for dtype in ("int8", "int4"):
            out[f"xirang DynamicAdamW {dtype} fused, chunk 4,194,304"] = (
                lambda ps, d=dtype: DynamicAdamW(ps, states={"schedule": [{"dtype": d}], "fused": True,
                                                             "chunk_numel": 1 << 22}))
    try:
        from torchao.optim import AdamW4bit, AdamW8bit

        out["torchao AdamW8bit"] = lambda ps: AdamW8bit(ps)
        out["torchao AdamW4bit"] = lambda ps: AdamW4bit(ps)
    except Exception as e:  # pragma: no cover - reported, not fatal
        print(f"torchao not available: {e}")
    try:
        import bitsandbytes as bnb

        out["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps)
    except Exception as e:  # pragma: no cover
        print(f"bitsandbytes not available: {e}")
    return out


def run(shapes: list[tuple[int, ...]], rounds: int, threads: int, device: str = "cpu",
        deadline_s: float = math.inf, progress: Callable[[dict[str, Any]], None] | None = None,
        counts: bool = False) -> dict[str, Any]:
    """Every candidate's first step (states, compilation), then ``rounds`` timed steps each. Past 60%
    of ``deadline_s`` no further candidate is set up (it is reported as skipped), and past the whole
    of it no further round starts once three are done: a time-limited run still reports.
    ``progress`` gets the result so far after every round (a killed run keeps the rounds it did);
    ``counts`` adds each candidate's ops, kernels and host syncs per step (`xirang_ds.step_counts`)."""
    began = time.monotonic()
    torch.set_num_threads(threads)
    gen = torch.Generator(device=device).manual_seed(0)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    makers = candidates(device)
    numel = sum(math.prod(s) for s in shapes)
    params, opts = {}, {}
    skipped = []
    for name, make in makers.items():
        if time.monotonic() - began > 0.6 * deadline_s:
            skipped.append(name)
            continue
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device) * 0.02) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen, device=device) * 1e-3
        opt = make(ps)
        opt.step()  # creates states (and compiles torchao's step and the fused kernels)
        params[name], opts[name] = ps, opt
    times: dict[str, list[float]] = {name: [] for name in opts}
    per_step: dict[str, dict] = {}

    def result() -> dict[str, Any]:
        rows = {}
        for name in opts:
            med = statistics.median(times[name]) if times[name] else math.nan
            rows[name] = {"state_bytes_per_param": state_bytes(opts[name]) / numel,
                          "update_ns_per_param": med * 1e9 / numel,
                          "update_ns_per_param_all_rounds": [t * 1e9 / numel for t in times[name]]}
            if name in per_step:
                rows[name]["counts_per_step"] = per_step[name]
        return {"shapes": [list(s) for s in shapes], "numel": numel, "rounds": rounds, "threads": threads,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
                "machine": f"{platform.machine()}, {os.cpu_count()} cpu(s)", "results": rows,
                "rounds_done": len(next(iter(times.values()), [])), "skipped": skipped}

    for done in range(rounds):
        if done >= 3 and time.monotonic() - began > deadline_s:
            break
        for name, opt in opts.items():
            for p in params[name]:
                p.grad = torch.randn(p.shape, generator=gen, device=device) * 1e-3
            sync()
            start = time.perf_counter()
            opt.step()
            sync()
            times[name].append(time.perf_counter() - start)
        if progress is not None:
            progress(result())
    if counts:
        from xirang_ds.step_counts import count_step

        for name, opt in opts.items():
            per_step[name] = count_step(opt.step, device).as_dict()
            if progress is not None:
                progress(result())
    return result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 22, help="one tensor of this many elements")
    parser.add_argument("--shapes", default=None, help="tensors instead, e.g. 1024x1024,4096x4096")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cpu", help="where the tensors live, e.g. cuda (the GPU check)")
    parser.add_argument("--deadline-s", type=float, default=math.inf, help="stop setting up and timing after this")
    parser.add_argument("--jsonl", default=None, help="append the result so far here after every round")
    parser.add_argument("--counts", action="store_true", help="ops, kernels and host syncs per step, each")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    shapes = ([tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")] if args.shapes
              else [(args.numel,)])
    def progress(partial: dict) -> None:  # kept as it comes: a killed run keeps its rounds
        from xirang_ds.bench import append_jsonl

        append_jsonl(args.jsonl, {"kind": "optimizer", **partial})
    result = run(shapes, args.rounds, args.threads, args.device, args.deadline_s, progress if args.jsonl else None,
                 args.counts)
    width = max(map(len, result["results"]))
    print(f"{'optimizer'.ljust(width)}  state B/param  update ns/param  ({args.threads} thread(s), "
          f"{result['numel']:,} elements, median of {result['rounds_done']})")
    for name, row in result["results"].items():
        print(f"{name.ljust(width)}  {row['state_bytes_per_param']:13.4f}  {row['update_ns_per_param']:15.2f}")
    if result["skipped"]:
        print(f"not set up before the deadline: {', '.join(result['skipped'])}")
    if args.json:
        write_json(result, args.json)


if __name__ == "__main__":
    main()
