"""Run ``xirang-ds bench`` for every activations config and print the table of docs/activations.md.

Each row is one invocation of the bench CLI (plain DeepSpeed and the block side by side, fresh
processes per side); the exact command is printed above the table. Memory figures are the
tracker's exact bytes; the CLI's time ratio is the ratio of medians of the two sides, which run
one after the other. ``--interleaved`` adds a time ratio measured in one process: a plain engine
and one with the block, same weights and data, one thread, stepping alternately, so load changes
hit both sides alike; it reports the median of per-pair ratios of CPU time and of wall time.

Example:
    .venv/bin/python examples/bench_activations.py --model gpt-small --steps 20 --world-size 2 \\
        --data ../shared/data/tinyshakespeare.txt --out runs/act-gpt
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Optional

from xirang_ds.config.types import format_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "..", "configs", "activations")


def run(model: str, config: str, steps: int, world: int, data: str, out_dir: str) -> tuple[str, dict]:
    name = os.path.splitext(os.path.basename(config))[0]
    out = os.path.join(out_dir, f"{model}-{name}.json")
    cmd = ["xirang-ds", "bench", "--model", model, "--ds-config", os.path.relpath(config), "--steps", str(steps),
           "--world-size", str(world), "--data", data, "--json", out]
    exe = os.path.join(os.path.dirname(sys.executable), "xirang-ds")
    subprocess.run([exe] + cmd[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out, encoding="utf-8") as f:
        return " ".join(shlex.quote(c) for c in cmd), json.load(f)


def interleaved_rank(rank: int, world: int, model: str, config: dict, steps: int, data: str) -> dict:
    """Two engines stepping alternately; per-step CPU and wall seconds of each (after warm-up)."""
    import deepspeed

    import xirang_ds
    from xirang_ds.bench import strip_block
    from xirang_ds.data import batches, load_tokens
    from xirang_ds.models import build_model, parse_model_spec

    spec = parse_model_spec(model)
    tokens = load_tokens(data)
    sides = {}
    for name, init, cfg in (("plain", deepspeed.initialize, strip_block(config)), ("block", xirang_ds.initialize, config)):
        net = build_model(spec)
        engine, *_ = init(model=net, model_parameters=net.parameters(), config=cfg)
        sides[name] = (engine, batches(tokens, engine.train_micro_batch_size_per_gpu(), spec.seq, seed=0))
    times: dict = {name: {"cpu": [], "wall": []} for name in sides}
    for step in range(steps):
        for name in (("plain", "block") if step % 2 == 0 else ("block", "plain")):
            engine, data_iter = sides[name]
            x, y = next(data_iter)
            cpu, wall = time.process_time(), time.perf_counter()
            engine.backward(engine(x, y))
            engine.step()
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return times


def interleaved(model: str, config_path: str, steps: int, data: str, warmup: int = 4) -> dict:
    """Median over steps of block/plain time ratios (CPU and wall), steps after ``warmup``."""
    from xirang_ds.config.loader import read_ds_config
    from xirang_ds.launch import run_ranks

    times = run_ranks(interleaved_rank, 1, model, read_ds_config(config_path), steps, data, threads=1)[0]
    out = {}
    for kind in ("cpu", "wall"):
        pairs = [b / a for a, b in zip(times["plain"][kind][warmup:], times["block"][kind][warmup:]) if a > 0]
        out[kind] = statistics.median(pairs)
    return out


def forced_rank(rank: int, world: int, model: str, config: dict, option: str, steps: int, data: str) -> dict:
    """Every candidate forced to ``option`` (the planner with only that option and room for it):
    the planner's estimate of the step's worst point against the tracker's activations peak."""
    import copy

    import xirang_ds
    from xirang_ds.data import batches, load_tokens
    from xirang_ds.models import build_model, parse_model_spec

    config = copy.deepcopy(config)
    config["xirang"] = {"activations": {"enabled": True, "budget": "100GB", "profile_steps": 1,
                                        "options": [option], "tolerant": ["*"]}}
    spec = parse_model_spec(model)
    net = build_model(spec)
    engine, *_ = xirang_ds.initialize(model=net, model_parameters=net.parameters(), config=config)
    tracker = engine.xirang.track_memory()
    window = tracker.open_window()
    data = batches(load_tokens(data), engine.train_micro_batch_size_per_gpu(), spec.seq, seed=0)
    for _ in range(steps):
        x, y = next(data)
        engine.backward(engine(x, y))
        engine.step()
    plugin = engine.xirang.plugin("activations")
    return {"planned": max(plugin.planned_peaks), "measured": window.category_peaks()["activations"],
            "options": sorted(set(plugin.plan.values()))}


def planned_vs_measured(model: str, config_path: str, data: str) -> list[str]:
    """Rows of the planned-against-measured table, one per option."""
    from xirang_ds.config.loader import read_ds_config
    from xirang_ds.launch import run_ranks

    rows = ["| option | planned worst point | measured | measured / planned |", "|---|---|---|---|"]
    for option in ("recompute", "selective_recompute", "recompute_offload", "compress", "quantize", "offload"):
        r = run_ranks(forced_rank, 1, model, read_ds_config(config_path), option, 3, data, threads=1)[0]
        rows.append(f"| {option} | {format_bytes(r['planned'])} | {format_bytes(r['measured'])} | "
                    f"{r['measured'] / r['planned']:.3f} |")
        print(rows[-1], flush=True)
    return rows


def row(name: str, result: dict, inter: Optional[dict] = None) -> str:
    base, ours = result["baseline"], result["xirang"]
    act_b, act_o = base["category_peaks"]["activations"], ours["category_peaks"]["activations"]
    host = ours["category_peaks"].get("host", 0)
    plan = ours["summary"].split("activations: ", 1)[-1].strip() if ours.get("summary") else ""
    side_by_side = f"{inter['cpu']:.3f} / {inter['wall']:.3f}" if inter else "-"
    return (f"| {name} | {format_bytes(act_b)} | {format_bytes(act_o)} | {act_b / act_o:.2f}x | {format_bytes(host)} | "
            f"{result['peak_ratio']:.2f} | {result['step_time_ratio']:.2f} | {side_by_side} | "
            f"{result['loss_delta']:+.4f} | {plan} |")


HEADER = ["| config | activations peak, plain | with block | less | host tier peak | step peak ratio | "
          "step time ratio (CLI) | time ratio interleaved, CPU / wall | loss delta | plan |",
          "|---|---|---|---|---|---|---|---|---|---|"]


def render(model: str, dirs: list[str]) -> list[str]:
    """The table from ``<dir>/<model>-<config>.json`` (and ``-interleaved.json``) files."""
    found: dict[str, tuple[dict, Optional[dict]]] = {}
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, f"{model}-*.json"))):
            name = os.path.basename(path)[len(model) + 1:-len(".json")]
            if name.endswith("-interleaved"):
                continue
            inter_path = path[:-len(".json")] + "-interleaved.json"
            inter = None
            if os.path.exists(inter_path):
                with open(inter_path, encoding="utf-8") as f:
                    inter = json.load(f)
            with open(path, encoding="utf-8") as f:
                found[name] = (json.load(f), inter)
    return HEADER + [row(name, *found[name]) for name in sorted(found)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--data", default=os.path.join("..", "shared", "data", "tinyshakespeare.txt"))
    p.add_argument("--out", default=os.path.join("runs", "activations"))
    p.add_argument("--only", nargs="*", help="config names (default: every file in configs/activations)")
    p.add_argument("--render", nargs="+", metavar="DIR",
                   help="only print the table from the JSON files earlier runs wrote (a later DIR wins per config)")
    p.add_argument("--planned-vs-measured", action="store_true",
                   help="only print the planner's estimate against the tracker for each option forced everywhere "
                        "(on the base of configs/activations/keep.json)")
    p.add_argument("--interleaved", type=int, default=0, metavar="STEPS",
                   help="also measure the time ratio with two engines stepping alternately for STEPS steps each")
    args = p.parse_args()
    if args.render:
        print("\n".join(render(args.model, args.render)))
        return 0
    if args.planned_vs_measured:
        print("\n".join(planned_vs_measured(args.model, os.path.join(CONFIGS, "keep.json"), args.data)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    configs = sorted(glob.glob(os.path.join(CONFIGS, "*.json")))
    if args.only:
        configs = [c for c in configs if os.path.splitext(os.path.basename(c))[0] in args.only]
    lines = list(HEADER)
    commands = []
    for config in configs:
        name = os.path.splitext(os.path.basename(config))[0]
        command, result = run(args.model, config, args.steps, args.world_size, args.data, args.out)
        commands.append(command)
        inter = interleaved(args.model, config, args.interleaved, args.data) if args.interleaved else None
        if inter is not None:
            with open(os.path.join(args.out, f"{args.model}-{name}-interleaved.json"), "w", encoding="utf-8") as f:
                json.dump(inter, f)
        lines.append(row(name, result, inter))
        print(lines[-1], flush=True)
    print("\n".join(["", *commands, "", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
