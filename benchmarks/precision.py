"""Measurements of the precision plugin, written to JSON (docs/precision.md quotes them).

    .venv/bin/python benchmarks/precision.py [--parts memory,loss,mechanisms] [--out benchmarks/results/precision.json]

* ``memory``: `xirang_ds.bench.run_bench` side by side, DeepSpeed's bf16 mode (the ds_config without
  the block) against the block with ``precision`` on, on tinyshakespeare: the peak by category
  (live-storage tracker, worst rank), weight bytes per parameter at the peak (the ``parameters``
  category: 16-bit weights + fp32 masters for DeepSpeed, fp32 masters + live 16-bit copies for
  the plugin), the peak ratio, the median step-time ratio and the loss difference.
* ``memory_variants``: the same with edited lists (the embedding on the white list), and a model
  whose states dominate its activations.
* ``against_autocast``: the plugin against DeepSpeed's ``torch_autocast`` (fp32 parameters and
  PyTorch's own autocast kernels: the same per-op mixed precision without the plugin's Python
  kernels), no tracker, the two sides alternating ``--repeats`` times: a step-time ratio per repeat.
* ``loss``: fp32, DeepSpeed bf16 and the plugin trained for ``--loss-steps`` steps from the same
  seed and data (no tracker); the mean loss of the last 20 steps, and its relative difference.
* ``mechanisms``: one model's forward+backward (no DeepSpeed) under plain fp32, ``torch.autocast``,
  the plugin's kernels at the autocast dispatch key, and a ``TorchFunctionMode`` applying the same
  lists at the Python level (a prototype kept here for the comparison only), interleaved round by
  round so machine load hits all alike; the median time of each.

Parts already in the output file are kept when other parts are run.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import time
from typing import Any

import torch

from xirang_ds.bench import optimizer_step

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.abspath(os.path.join(HERE, "..", "..", "shared", "data", "tinyshakespeare.txt"))
PRECISION = {"precision": {"enabled": True}}


def ds(stage: int, micro: int, dtype: str = "bf16", gas: int = 1, block: Any = PRECISION) -> dict:
    c: dict = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
               "zero_optimization": {"stage": stage, "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}}
    if dtype in ("bf16", "fp16"):
        c[dtype] = {"enabled": True}
    if block is not None:
        c["xirang"] = copy.deepcopy(block)
    return c


ON_DEMAND = {"precision": {"enabled": True, "weight_copies": "on_demand"}}
MEMORY = [  # (model, ds_config, world size); weight_copies "auto" unless named
    ("gpt-small", ds(0, 8), 1),
    ("gpt-small", ds(0, 2), 1),
    ("gpt-small", ds(2, 8, block=ON_DEMAND), 1),
    ("gpt-small", ds(1, 8, block=ON_DEMAND), 2),
    ("gpt-small", ds(2, 8, block=ON_DEMAND), 2),
    ("gpt-small", ds(2, 8), 2),
    ("gpt-small", ds(2, 4, gas=2), 2),
]
VARIANTS = [
    # the embedding on the white list: the residual stream in bf16, as in DeepSpeed's bf16 mode
    ("gpt-small", ds(0, 8, block={"precision": {"enabled": True, "low_precision_ops": ["default", "embedding"]}}), 1),
    # model states dominate (25M parameters, 32 tokens per micro-batch)
    ("gpt:layers=2,hidden=1024,heads=8,seq=32,vocab=256", ds(0, 1), 1),
]
LOSS_MODEL = "gpt:layers=4,hidden=128,heads=4,seq=128,vocab=256"


def n_params(model: str) -> int:
    from xirang_ds.models import build_model, parse_model_spec

    return sum(p.numel() for p in build_model(parse_model_spec(model)).parameters())


def run_memory(steps: int, matrix: list = MEMORY) -> list[dict]:
    from xirang_ds.bench import format_result, run_bench

    rows = []
    for model, config, world in matrix:
        result = run_bench(model, config, steps=steps, world_size=world, data_path=DATA)
        n = n_params(model)
        base, ours = result["baseline"], result["xirang"]
        row = {"model": model, "params": n, "world_size": world, "zero_stage": config["zero_optimization"]["stage"],
               "precision_section": config["xirang"]["precision"], "summary": ours["summary"],
               "micro_batch": config["train_micro_batch_size_per_gpu"],
               "gradient_accumulation": config["gradient_accumulation_steps"], "steps": steps,
               "weight_bytes_per_param_at_peak": {"deepspeed_bf16": base["peak_by_category"]["parameters"] / n,
                                                  "precision": ours["peak_by_category"]["parameters"] / n},
               "peak_bytes": {"deepspeed_bf16": base["peak_bytes"], "precision": ours["peak_bytes"]},
               "peak_by_category": {"deepspeed_bf16": base["peak_by_category"], "precision": ours["peak_by_category"]},
               "peak_phase": {"deepspeed_bf16": base["peak_phase"], "precision": ours["peak_phase"]},
               "peak_ratio": result["peak_ratio"], "step_time_ratio": result["step_time_ratio"],
               "step_time_median_s": {"deepspeed_bf16": base["step_time_median_s"],
                                      "precision": ours["step_time_median_s"]},
               "final_loss": {"deepspeed_bf16": base["final_loss"], "precision": ours["final_loss"]}}
        print(format_result(result), flush=True)
        rows.append(row)
    return rows


AGAINST_AUTOCAST = [  # (model, stage, micro-batch, world size): small ops, where Python costs the most
    ("gpt-tiny", 0, 8, 1),
    ("gpt-tiny", 2, 8, 2),
]


def torch_autocast_config(stage: int, micro: int) -> dict:
    """DeepSpeed's own per-op mixed precision: fp32 parameters, ``torch.autocast`` around forward."""
    return {**ds(stage, micro, "fp32", block=None), "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}


def time_rank(rank: int, world: int, model_text: str, config: dict, steps: int, use_xirang: bool) -> dict:
    """One rank of one side, without a memory tracker: each step's wall time, and the losses."""
    import deepspeed

    import xirang_ds
    from xirang_ds.data import batches, load_tokens
    from xirang_ds.models import build_model, parse_model_spec

    spec = parse_model_spec(model_text)
    model = build_model(spec, seed=0)
    init = xirang_ds.initialize if use_xirang else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    data = batches(load_tokens(DATA), engine.train_micro_batch_size_per_gpu(), spec.seq, seed=0, vocab=spec.vocab,
                   rank=rank, world_size=world)
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(optimizer_step(engine, data))
        times.append(time.perf_counter() - start)
    return {"times": times, "losses": losses}


def alternate_sides(sides: dict[str, tuple[dict, bool]], model: str, world: int, steps: int,
                    repeats: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each side (name -> ds_config, through xirang) trained in fresh ranks by `time_rank`, the sides
    alternating ``repeats`` times so load hits all alike. Returns, per side, the median step time of
    each repeat (the slowest rank's, first 3 steps not counted) and rank 0's last loss."""
    from xirang_ds.launch import run_ranks

    medians: dict[str, list[float]] = {k: [] for k in sides}
    losses: dict[str, float] = {}
    threads = max(1, (os.cpu_count() or 2) // world)
    for _ in range(repeats):
        for name, (config, use) in sides.items():
            per_rank = run_ranks(time_rank, world, model, config, steps, use, threads=threads)
            step_times = [max(r["times"][i] for r in per_rank) for i in range(steps)]
            medians[name].append(statistics.median(step_times[3:]))
            losses[name] = per_rank[0]["losses"][-1]
            print(model, name, f"{medians[name][-1]:.4f} s/step", flush=True)
    return medians, losses


def run_against_autocast(steps: int, repeats: int) -> list[dict]:
    """The plugin against DeepSpeed's ``torch_autocast`` (the same fp32 parameters and per-op casts,
    with PyTorch's built-in autocast kernels), no tracker on either side, `alternate_sides`: one
    ratio of median step times per repeat."""
    rows = []
    for model, stage, micro, world in AGAINST_AUTOCAST:
        medians, losses = alternate_sides({"deepspeed_torch_autocast": (torch_autocast_config(stage, micro), False),
                                           "precision": (ds(stage, micro), True)}, model, world, steps, repeats)
        ratios = [p / a for p, a in zip(medians["precision"], medians["deepspeed_torch_autocast"])]
        rows.append({"model": model, "params": n_params(model), "world_size": world, "zero_stage": stage,
                     "micro_batch": micro, "steps": steps, "step_time_median_s": medians,
                     "step_time_ratios": ratios, "step_time_ratio_median": statistics.median(ratios),
                     "final_loss": losses})
    return rows


def loss_rank(rank: int, world: int, model_text: str, config: dict, steps: int, use_xirang: bool) -> list[float]:
    return time_rank(rank, world, model_text, config, steps, use_xirang)["losses"]


def run_loss(steps: int) -> dict:
    from xirang_ds.launch import run_ranks

    persistent = {"precision": {"enabled": True, "weight_copies": "persistent"}}
    sides = {"fp32": (ds(2, 8, "fp32", block=None), False), "deepspeed_bf16": (ds(2, 8, "bf16", block=None), False),
             "precision_bf16_on_demand": (ds(2, 8, "bf16", block=ON_DEMAND), True),
             "precision_bf16_persistent": (ds(2, 8, "bf16", block=persistent), True),
             "precision_fp16_on_demand": (ds(2, 8, "fp16", block=ON_DEMAND), True)}
    curves = {}
    for name, (config, use) in sides.items():
        per_rank = run_ranks(loss_rank, 2, LOSS_MODEL, config, steps, use, threads=1)
        curves[name] = [sum(r[i] for r in per_rank) / len(per_rank) for i in range(steps)]
        print(name, "last-20 mean", statistics.mean(curves[name][-20:]), flush=True)
    tail = {k: statistics.mean(v[-20:]) for k, v in curves.items()}
    return {"model": LOSS_MODEL, "steps": steps, "world_size": 2, "zero_stage": 2, "micro_batch": 8,
            "final_loss_last20_mean": tail,
            "relative_difference": {k: tail[k] / tail["fp32"] - 1 for k in tail if k != "fp32"},
            "relative_to_deepspeed_bf16": {k: tail[k] / tail["deepspeed_bf16"] - 1 for k in tail if k.startswith("precision")},
            "curves": curves}


class FunctionModePolicy(torch.overrides.TorchFunctionMode):
    """The same lists applied at the Python level (for the overhead comparison only)."""

    def __init__(self, low: set, fp32: set, dtype: torch.dtype) -> None:
        super().__init__()
        self.low, self.fp32, self.dtype = low, fp32, dtype

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        name = {"__matmul__": "matmul", "cross_entropy": "cross_entropy_loss"}.get(name, name)
        to = self.dtype if name in self.low else torch.float32 if name in self.fp32 else None
        if to is not None:
            def cast(a: Any) -> Any:
                return a.to(to) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in (kwargs or {}).items()}
        return func(*args, **(kwargs or {}))


def run_mechanisms(model_text: str, rounds: int) -> dict:
    from xirang_ds.models import build_model, parse_model_spec
    from xirang_ds.plugins.precision.kernels import CastPolicy, install
    from xirang_ds.plugins.precision.op_lists import build_op_lists, short, torch_cpu_autocast_lists

    spec = parse_model_spec(model_text)
    model = build_model(spec, seed=0)
    x = torch.randint(0, spec.vocab, (8, spec.seq))
    ours, torchs = build_op_lists(("default",), ("default",), "", []), torch_cpu_autocast_lists()
    bf16 = torch.bfloat16

    def autocast() -> Any:
        return torch.autocast("cpu", dtype=bf16, cache_enabled=False)

    def kernels(lists: Any) -> Any:
        @contextlib.contextmanager
        def installed() -> Any:  # registration is set-up, outside the timed step
            handle = install(CastPolicy(lists, "cpu", bf16), contextlib.nullcontext)
            try:
                yield autocast
            finally:
                handle.remove()
        return installed

    def plain(mode: Any) -> Any:
        return lambda: contextlib.nullcontext(mode)

    low, fp32 = {short(o) for o in ours.low}, {short(o) for o in ours.fp32}
    setups = {"fp32": plain(contextlib.nullcontext), "torch_autocast": plain(autocast),
              "kernels_with_torch_lists": kernels(torchs), "kernels_with_default_lists": kernels(ours),
              "function_mode_with_default_lists": plain(lambda: FunctionModePolicy(low, fp32, bf16))}
    times: dict[str, list[float]] = {k: [] for k in setups}
    losses = {}
    for r in range(rounds + 1):
        for name, setup in setups.items():
            with setup() as mode:
                for timed in (False, True):  # each mode's first step after its set-up is not timed
                    for p in model.parameters():
                        p.grad = None
                    start = time.perf_counter()
                    with mode():
                        loss = model(x, x)
                    loss.backward()
                    if timed and r:  # the first round warms up
                        times[name].append(time.perf_counter() - start)
                losses[name] = loss.item()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": model_text, "micro_batch": 8, "rounds": rounds, "threads": torch.get_num_threads(),
            "median_s": med, "ratio_to_torch_autocast": {k: v / med["torch_autocast"] for k, v in med.items()},
            "loss": losses, "times_s": times}


def run_dispatch_overhead(calls: int, rounds: int) -> dict:
    """Per-call cost of one listed op (``mm`` on 8x8 inputs, so the op itself costs next to nothing)
    under ``torch.autocast`` and under the kernels: the mechanism's own overhead, and the same with a
    parameter argument (its copy remade in backward) including the backward."""
    from xirang_ds.plugins.precision.kernels import CastPolicy, install
    from xirang_ds.plugins.precision.op_lists import torch_cpu_autocast_lists

    a = torch.randn(8, 8)
    w = torch.nn.Parameter(torch.randn(8, 8))
    lists = torch_cpu_autocast_lists()

    def forward_only() -> None:
        for _ in range(calls):
            torch.mm(a, a)

    def with_weight() -> None:
        for _ in range(calls):
            torch.mm(a, w).sum().backward()

    results: dict = {}
    for name, body in (("mm", forward_only), ("mm_weight_forward_backward", with_weight)):
        times: dict[str, list[float]] = {"torch_autocast": [], "kernels": []}
        for _ in range(rounds):
            for mode in times:
                handle = install(CastPolicy(lists, "cpu", torch.bfloat16), contextlib.nullcontext) \
                    if mode == "kernels" else None
                try:
                    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                        start = time.perf_counter()
                        body()
                        times[mode].append((time.perf_counter() - start) / calls * 1e6)
                finally:
                    if handle is not None:
                        handle.remove()
        med = {k: statistics.median(v) for k, v in times.items()}
        results[name] = {"median_us_per_call": med, "overhead_us_per_call": med["kernels"] - med["torch_autocast"]}
    return {"calls": calls, "rounds": rounds, **results}


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), and whether it computes bf16 natively (AVX512-BF16
    or AMX): without it, bf16 matmuls take torch's slow reference path and dilute any overhead."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    native = "avx512_bf16" in info or "amx_bf16" in info
    return f"{name}, {os.cpu_count()} cores, bf16 {'native' if native else 'emulated'}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def tables(result: dict) -> str:
    """The markdown tables docs/precision.md quotes, from a results file."""
    out = []
    rows = result.get("memory", {}).get("rows", []) + result.get("memory_variants", {}).get("rows", [])
    if rows:
        out += ["| model | ZeRO | ranks | micro x GA | section | weights B/param DS bf16 | weights B/param xirang | "
                "peak MiB DS bf16 | peak MiB xirang | peak ratio | step time ratio |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            section = {k: v for k, v in r["precision_section"].items() if k != "enabled"} or "defaults"
            layout = "persistent" if "persistent" in r["summary"] else "on_demand"
            w, p = r["weight_bytes_per_param_at_peak"], r["peak_bytes"]
            out.append(f"| {r['model']} | {r['zero_stage']} | {r['world_size']} | {r['micro_batch']} x "
                       f"{r['gradient_accumulation']} | `{json.dumps(section)}` ({layout}) | "
                       f"{w['deepspeed_bf16']:.2f} | {w['precision']:.2f} | {_mib(p['deepspeed_bf16'])} | "
                       f"{_mib(p['precision'])} | {r['peak_ratio']:.3f} | {r['step_time_ratio']:.2f} |")
    loss = result.get("loss")
    if loss:
        out += ["", "| side | mean loss, last 20 of {} steps | vs fp32 | vs DeepSpeed bf16 |".format(loss["steps"]),
                "|---|---|---|---|"]
        for k, v in loss["final_loss_last20_mean"].items():
            rel = loss["relative_difference"].get(k)
            ds_rel = loss.get("relative_to_deepspeed_bf16", {}).get(k)
            out.append(f"| {k} | {v:.4f} | {'' if rel is None else f'{rel:+.2%}'} | "
                       f"{'' if ds_rel is None else f'{ds_rel:+.2%}'} |")
    mech = result.get("mechanisms")
    if mech:
        out += ["", "| model | " + " | ".join(mech["gpt-tiny"]["median_s"]) + " |",
                "|---|" + "---|" * len(mech["gpt-tiny"]["median_s"])]
        for m in ("gpt-tiny", "gpt-small"):
            out.append(f"| {m} (s, ratio to torch.autocast) | " + " | ".join(
                f"{mech[m]['median_s'][k]:.3f} ({mech[m]['ratio_to_torch_autocast'][k]:.2f})"
                for k in mech[m]["median_s"]) + " |")
        d = mech["dispatch_overhead"]
        out += ["", "| per call | torch.autocast µs | kernels µs | overhead µs |", "|---|---|---|---|"]
        for k in ("mm", "mm_weight_forward_backward"):
            med = d[k]["median_us_per_call"]
            out.append(f"| {k} | {med['torch_autocast']:.1f} | {med['kernels']:.1f} | {d[k]['overhead_us_per_call']:.1f} |")
    against = result.get("against_autocast")
    if against:
        out += ["", "| model | ZeRO | ranks | micro | DeepSpeed torch_autocast s/step | precision s/step | "
                    "ratio per repeat | median ratio | final loss (torch_autocast / precision) |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in against["rows"]:
            med = {k: statistics.median(v) for k, v in r["step_time_median_s"].items()}
            out.append(f"| {r['model']} | {r['zero_stage']} | {r['world_size']} | {r['micro_batch']} | "
                       f"{med['deepspeed_torch_autocast']:.4f} | {med['precision']:.4f} | "
                       f"{', '.join(f'{x:.3f}' for x in r['step_time_ratios'])} | {r['step_time_ratio_median']:.3f} | "
                       f"{r['final_loss']['deepspeed_torch_autocast']:.4f} / {r['final_loss']['precision']:.4f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="memory,loss,mechanisms")
    parser.add_argument("--steps", type=int, default=20, help="steps per side of each memory row")
    parser.add_argument("--loss-steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the sides per row (against_autocast)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "precision.json"))
    parser.add_argument("--tables", action="store_true", help="print the markdown tables of --out and exit")
    args = parser.parse_args()
    if args.tables:
        with open(args.out, encoding="utf-8") as f:
            print(tables(json.load(f)))
        return
    result: dict = {}
    if os.path.isfile(args.out):
        with open(args.out, encoding="utf-8") as f:
            result = json.load(f)
    import deepspeed

    result["environment"] = {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                             "python": platform.python_version(), "cpus": os.cpu_count(),
                             "machine": "shared 2-core CPU host, other test suites running (step times noisy)"}
    runs = {"memory": lambda: {"rows": run_memory(args.steps)}, "loss": lambda: run_loss(args.loss_steps),
            "memory_variants": lambda: {"rows": run_memory(args.steps, VARIANTS)},
            "against_autocast": lambda: {"rows": run_against_autocast(args.steps, args.repeats)},
            "mechanisms": lambda: {**{m: run_mechanisms(m, args.rounds) for m in ("gpt-tiny", "gpt-small")},
                                   "dispatch_overhead": run_dispatch_overhead(2000, args.rounds)}}
    for part in args.parts.split(","):
        load = os.getloadavg()
        result[part] = runs[part]()
        result[part]["command"] = (f".venv/bin/python benchmarks/precision.py --parts {part} --steps {args.steps} "
                                   f"--loss-steps {args.loss_steps} --rounds {args.rounds} --repeats {args.repeats}")
        result[part]["load_average_start_end"] = [load, os.getloadavg()]
        result[part]["cpu"] = cpu_name()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
