"""A compiled chunk's stochastic rounding on the CPU: the counter hash inside the update against the draws made
in a call of their own (`formats.draw_chunk`, what `FusedStep` runs), and the step against the eager path.

    .venv/bin/python benchmarks/fused_draws.py --out benchmarks/results/optimizer_states_fused_draws.json

One thread, chunks of 131,072 elements. ``parts`` (int8, one chunk): the compiled update with the hash inside,
with the draws given as an input, and the draws alone, ns an element, the median of ``--repeats`` calls after
the compile. ``steps`` (each format, four chunks, stochastic states): `FusedStep.run` (``fused: true``) against
`chunk_step` eagerly, ns an element, the median of ``--repeats`` steps.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from xirang_ds.bench import write_json
from xirang_ds.plugins.grad_release.stochastic import noise_keys
from xirang_ds.plugins.optimizer_states import fused as fused_module
from xirang_ds.plugins.optimizer_states.formats import Draws, draw_chunk, make_format
from xirang_ds.plugins.optimizer_states.fused import FusedStep, chunk_step, hyper_tensor
from xirang_ds.plugins.optimizer_states.update import AdamHyper

CHUNK = 131072
HYPER = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True)


def _ns(call, repeats: int, n: int) -> float:
    call()  # compile, or warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) / n * 1e9, 2)


def _state(fmt, n):
    torch.manual_seed(0)
    p, g = torch.randn(n), torch.randn(n)
    bufs = {k: v for m in ("exp_avg", "exp_avg_sq") for k, v in fmt.zeros(m, n, p.device).items()}
    return p, g, bufs


def parts(repeats: int) -> dict:
    fmt = make_format("int8")
    p, g, bufs = _state(fmt, CHUNK)
    scalars, keys, offset = hyper_tensor(HYPER, 1, p.device), noise_keys(5), torch.tensor(0)
    windows = (fmt.window("exp_avg", bufs, 0, CHUNK), fmt.window("exp_avg_sq", bufs, 0, CHUNK))
    inside = torch.compile(fused_module._variant(chunk_step, "bench_inside"), dynamic=False, fullgraph=True)
    given = torch.compile(fused_module._variant(chunk_step, "bench_given"), dynamic=False, fullgraph=True)
    draws = torch.compile(draw_chunk, dynamic=False, fullgraph=True)
    drawn = draws(keys, offset, CHUNK, fmt.draw_bits)
    return {"hash inside the update": _ns(lambda: inside(fmt, p, g, *windows, scalars, Draws(keys, offset)),
                                          repeats, CHUNK),
            "draws given": _ns(lambda: given(fmt, p, g, *windows, scalars, Draws(keys, offset, drawn)), repeats, CHUNK),
            "draws alone": _ns(lambda: draws(keys, offset, CHUNK, fmt.draw_bits), repeats, CHUNK)}


def steps(repeats: int) -> dict:
    out = {}
    n = 4 * CHUNK
    for name in ("int8", "int4", "bf16"):
        fmt = make_format(name)
        p, g, bufs = _state(fmt, n)
        fused, draws = FusedStep(True), Draws(noise_keys(5), 0)

        def eager():
            scalars = hyper_tensor(HYPER, 2, p.device)
            for s in range(0, n, CHUNK):
                chunk_step(fmt, p[s:s + CHUNK], g[s:s + CHUNK], fmt.window("exp_avg", bufs, s, s + CHUNK),
                           fmt.window("exp_avg_sq", bufs, s, s + CHUNK), scalars, Draws(draws.keys, s))

        out[name] = {"eager": _ns(eager, repeats, n),
                     "compiled": _ns(lambda: fused.run(fmt, p, g, bufs, 2, HYPER, CHUNK, draws), repeats, n)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"command": "python benchmarks/fused_draws.py" + (f" --out {args.out}" if args.out else ""),
              "torch": torch.__version__, "threads": 1, "chunk": CHUNK, "ns_per_element": {
                  "parts": parts(args.repeats), "steps": steps(args.repeats)}}
    print(result["ns_per_element"])
    if args.out:
        write_json(result, args.out)


if __name__ == "__main__":
    main()
