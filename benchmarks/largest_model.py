"""The largest GPT (layers at the bench GPT's width) that trains under a fixed per-rank budget, with
plain DeepSpeed, each preset and the main plugins and peers.

For each configuration the layer count doubles from 2 while a short run (``--steps`` real steps in
fresh processes, `xirang_ds.bench.run_side`) fits, then bisects between the last fit and the first
miss. A run fits when it trains and its measured peak (worst rank, the tracker's exact bytes) is
within the budget; preset rows also get the budget as ``memory_budget``, so their planner plans
under it (a budget their model states cannot meet is refused, which counts as a miss).

    .venv/bin/python benchmarks/largest_model.py --budget 128MiB --world-size 2 \\
        --json benchmarks/results/largest_model.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_table import BASE, TUNED, deep_merge, short_error  # noqa: E402

ROWS = [
    ("DeepSpeed, default buckets", BASE, False, None),
    ("DeepSpeed, hand-tuned buckets", deep_merge(BASE, TUNED), False, None),
    ("optimizer_states int8", deep_merge(BASE, {**TUNED, "xirang": {"optimizer_states": {
        "enabled": True, "schedule": [{"dtype": "int8"}]}}}), True, None),
    ("grad_release", deep_merge(BASE, {**TUNED, "xirang": {"grad_release": {"enabled": True}}}), True, None),
    ("preset conservative", deep_merge(BASE, {"xirang": {"preset": "conservative"}}), True, None),
    ("preset balanced", deep_merge(BASE, {"xirang": {"preset": "balanced"}}), True, None),
    ("preset aggressive", deep_merge(BASE, {"xirang": {"preset": "aggressive"}}), True, None),
    ("bitsandbytes AdamW8bit", deep_merge(BASE, TUNED), False, "bnb_adamw8bit"),
    ("torch.utils.checkpoint, every block", deep_merge(BASE, TUNED), False, "torch_checkpoint"),
]


def spec(layers: int, hidden: int) -> str:
    return f"gpt:layers={layers},hidden={hidden},heads=8,seq=128,vocab=256"


def fits(layers: int, row: tuple, args: argparse.Namespace, budget: int, log: list) -> bool:
    from xirang_ds.bench import run_side

    name, ds, xirang, peer = row
    cfg = copy.deepcopy(ds)
    if xirang and "preset" in cfg.get("xirang", {}):
        cfg["xirang"]["memory_budget"] = budget
    try:
        side = run_side(spec(layers, args.hidden), cfg, args.steps, args.world_size, args.data, 0, xirang, peer)
        ok = side.peak_bytes <= budget
        log.append({"layers": layers, "peak_bytes": side.peak_bytes, "fits": ok})
    except Exception as e:
        log.append({"layers": layers, "error": short_error(e), "fits": False})
        ok = False
    print(f"  {name}: {layers} layers -> {'fits' if ok else 'no'}", file=sys.stderr, flush=True)
    return ok


def largest(row: tuple, args: argparse.Namespace, budget: int) -> dict:
    log: list = []
    lo, hi = 0, None
    layers = 2
    while hi is None and layers <= args.max_layers:
        if fits(layers, row, args, budget, log):
            lo, layers = layers, layers * 2
        else:
            hi = layers
    hi = hi or args.max_layers + 1
    while hi - lo > 1 and lo:
        mid = (lo + hi) // 2
        if fits(mid, row, args, budget, log):
            lo = mid
        else:
            hi = mid
    return {"name": row[0], "largest_layers": lo, "trials": log}


def main() -> int:
    from xirang_ds.config.types import parse_byte_size

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="128MiB")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--world-size", type=int, default=2, choices=(1, 2))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-layers", type=int, default=64)
    p.add_argument("--data", default=None)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--render", default=None, metavar="JSON")
    args = p.parse_args()
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            data = json.load(f)
    else:
        budget = parse_byte_size(args.budget)
        data = {"command": " ".join(["python", "benchmarks/largest_model.py"] + sys.argv[1:]), "budget_bytes": budget,
                "hidden": args.hidden, "world_size": args.world_size, "steps": args.steps, "rows": []}
        for row in ROWS:
            if args.only and not any(o in row[0] for o in args.only):
                continue
            print(row[0], file=sys.stderr, flush=True)
            data["rows"].append(largest(row, args, budget))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
    print(render(data))
    return 0


def render(data: dict) -> str:
    from xirang_ds.config.types import format_bytes
    from xirang_ds.models import build_model, parse_model_spec

    def params(layers: int) -> int:
        return sum(p.numel() for p in build_model(parse_model_spec(spec(layers, data["hidden"]))).parameters())

    lines = [f"Largest GPT (hidden {data['hidden']}, 8 heads, sequence 128, micro-batch "
             f"{BASE['train_micro_batch_size_per_gpu']}, ZeRO-2 bf16, {data['world_size']} rank(s)) whose measured peak "
             f"fits {format_bytes(data['budget_bytes'])} per rank; `{data['command']}`", "",
             "| configuration | layers | parameters |", "|---|---|---|"]
    for r in data["rows"]:
        n = r["largest_layers"]
        lines.append(f"| {r['name']} | {n} | {params(n) / 1e6:.1f} M |" if n else f"| {r['name']} | none fits | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
