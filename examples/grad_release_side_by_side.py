"""Step time of grad_release against plain DeepSpeed, side by side in the same processes.

    python examples/grad_release_side_by_side.py --ds-config C.json --model gpt-small --steps 30 --world-size 2

Each rank builds two engines from the same ds_config: plain DeepSpeed (the block removed) and
xirang with the block, and trains them alternately, one optimizer step each, on the same batches.
Load on a shared machine then hits both sides alike, which ``xirang-ds bench`` (one side after the
other, in fresh processes) cannot promise. Prints the median step time of each side (the slowest
rank per step, first two steps left out), their ratio, and how far the parameters of the two sides
are apart at the end: the largest difference, and the distance relative to how far plain DeepSpeed
moved them (0 for exact modes up to float rounding; the deviation of an approximate clipping mode).

``--memory`` instead measures each side in its own processes with the live-storage tracker (as
``xirang-ds bench`` does) and prints, besides the peak, the most bytes each category held at once
during the last step: for gradients that is the figure grad_release changes, which the breakdown
at the peak alone can miss.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Optional

import torch


def side_by_side(rank: int, world: int, model_text: str, ds_config: dict, steps: int,
                 data_path: Optional[str]) -> dict:
    """One rank: both engines, alternate steps, per-step wall times."""
    import deepspeed

    import xirang_ds
    from xirang_ds.data import batches, load_tokens
    from xirang_ds.models import build_model, parse_model_spec

    spec = parse_model_spec(model_text)
    plain_config = copy.deepcopy(ds_config)
    plain_config.pop("xirang", None)
    engines = {}
    for name, init, config in (("plain", deepspeed.initialize, plain_config),
                               ("xirang", xirang_ds.initialize, copy.deepcopy(ds_config))):
        model = build_model(spec, seed=0)
        engines[name], *_ = init(model=model, model_parameters=model.parameters(), config=config)
    plain = engines["plain"]
    data = batches(load_tokens(data_path), plain.train_micro_batch_size_per_gpu(), spec.seq, seed=0,
                   vocab=spec.vocab, rank=rank, world_size=world)
    gas = plain.gradient_accumulation_steps()
    initial = _flat(plain)
    times: dict[str, list[float]] = {name: [] for name in engines}
    losses: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        micro = [next(data) for _ in range(gas)]
        for name, engine in engines.items():
            start = time.perf_counter()
            total = 0.0
            for x, y in micro:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += float(loss.detach())
            times[name].append(time.perf_counter() - start)
            losses[name].append(total / gas)
    flat = {name: _flat(e) for name, e in engines.items()}
    apart = flat["plain"] - flat["xirang"]
    return {"times": times, "losses": losses, "max_param_diff": float(apart.abs().max()),
            "relative_param_distance": float(apart.norm() / (flat["plain"] - initial).norm()),
            "summary": engines["xirang"].xirang.summary()}


def memory(rank: int, world: int, model_text: str, ds_config: dict, steps: int, data_path: Optional[str],
           use_xirang: bool) -> dict:
    """One rank of one side: the last step's peak and the most bytes of each category alive at once."""
    import deepspeed

    import xirang_ds
    from xirang_ds.data import batches, load_tokens
    from xirang_ds.memory.engine_roles import watch_engine
    from xirang_ds.memory.tracker import MemoryTracker
    from xirang_ds.models import build_model, parse_model_spec

    spec = parse_model_spec(model_text)
    config = copy.deepcopy(ds_config)
    if not use_xirang:
        config.pop("xirang", None)
    model = build_model(spec, seed=0)
    engine, *_ = (xirang_ds.initialize if use_xirang else deepspeed.initialize)(
        model=model, model_parameters=model.parameters(), config=config)
    data = batches(load_tokens(data_path), engine.train_micro_batch_size_per_gpu(), spec.seq, seed=0,
                   vocab=spec.vocab, rank=rank, world_size=world)
    if use_xirang:
        tracker = engine.xirang.track_memory()
    else:
        tracker = MemoryTracker()
        watch_engine(tracker, engine)
        tracker.start()
    for step in range(steps):
        if step == steps - 1:
            window = tracker.open_window()
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(data)
            engine.backward(engine(x, y))
            engine.step()
    report = window.report()
    tracker.stop()
    return {"peak_bytes": report.peak_bytes, "peak_phase": report.phase, "at_peak": report.by_category,
            "most_at_once": window.most_at_once()}


def _flat(engine) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds-config", required=True, help="ds_config JSON with a \"xirang\" block")
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--world-size", type=int, default=1, choices=(1, 2))
    p.add_argument("--data", default=None)
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--memory", action="store_true", help="measure memory of each side instead of time")
    args = p.parse_args()
    from xirang_ds.launch import run_ranks

    with open(args.ds_config, encoding="utf-8") as f:
        ds_config = json.load(f)
    if args.memory:
        return _print_memory(args, ds_config)
    per_rank = run_ranks(side_by_side, args.world_size, args.model, ds_config, args.steps, args.data,
                         threads=max(1, 2 // args.world_size))
    medians = {}
    for name in ("plain", "xirang"):
        slowest = [max(r["times"][name][i] for r in per_rank) for i in range(args.steps)]
        medians[name] = statistics.median(slowest[2:] if args.steps > 4 else slowest)
    tail = max(1, args.steps // 5)
    final = {name: sum(statistics.mean(r["losses"][name][-tail:]) for r in per_rank) / len(per_rank)
             for name in ("plain", "xirang")}
    result = {"model": args.model, "world_size": args.world_size, "steps": args.steps,
              "median_step_s": medians, "step_time_ratio": medians["xirang"] / medians["plain"],
              "max_param_diff": max(r["max_param_diff"] for r in per_rank),
              "relative_param_distance": max(r["relative_param_distance"] for r in per_rank),
              "final_loss": final, "loss_delta": final["xirang"] - final["plain"]}
    print(per_rank[0]["summary"])
    print(f"median step: plain {medians['plain'] * 1000:.0f} ms, xirang {medians['xirang'] * 1000:.0f} ms, "
          f"ratio {result['step_time_ratio']:.3f}")
    print(f"parameters apart: largest {result['max_param_diff']:.2e}, relative to plain's update "
          f"{result['relative_param_distance']:.2e}; final loss {final['plain']:.4f} vs {final['xirang']:.4f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


def _print_memory(args: argparse.Namespace, ds_config: dict) -> int:
    from xirang_ds.config.types import format_bytes
    from xirang_ds.launch import run_ranks

    sides = {}
    for name, use in (("plain", False), ("xirang", True)):
        per_rank = run_ranks(memory, args.world_size, args.model, ds_config, args.steps, args.data, use)
        sides[name] = max(per_rank, key=lambda r: r["peak_bytes"])
    print(f"{'':<18}{'plain':>14}{'xirang':>14}   (worst rank; last of {args.steps} steps)")
    print(f"{'peak':<18}{format_bytes(sides['plain']['peak_bytes']):>14}{format_bytes(sides['xirang']['peak_bytes']):>14}")
    print(f"{'peak phase':<18}{sides['plain']['peak_phase']:>14}{sides['xirang']['peak_phase']:>14}")
    for category in sides["plain"]["most_at_once"]:
        a, b = sides["plain"]["most_at_once"][category], sides["xirang"]["most_at_once"][category]
        if a or b:
            print(f"{'most ' + category:<18}{format_bytes(a):>14}{format_bytes(b):>14}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(sides, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
