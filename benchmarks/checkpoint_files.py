"""What DeepSpeed's own files in a checkpoint of grad_release, or of optimizer_states alone, cost
(``"deepspeed_files"``, docs/checkpoints.md): the bytes each part of a checkpoint takes on disk, and the
save time with and without them, side by side in one run (the saves alternate, the median of each side
is reported).

    .venv/bin/python benchmarks/checkpoint_files.py --world-size 2 --saves 3 \\
        --json benchmarks/results/checkpoint_files.json
    .venv/bin/python benchmarks/checkpoint_files.py --owner optimizer_states --world-size 2 --saves 3 \\
        --json benchmarks/results/checkpoint_files_optimizer_states.json

``--render JSON`` prints the Markdown table of a saved run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = "gpt:layers=6,hidden=512,heads=8,seq=256,vocab=50304"
OWNERS = {"grad_release": ({"grad_release": {"enabled": True}}, "grad_release_shards", "xirang_grad_release"),
          "optimizer_states": ({"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]}},
                               "optimizer_states_codes", "xirang_optimizer_states")}
"""owner → (its block, its files' key in the JSON, its folder in the tag)."""


def _sizes(tag_dir: str, owner: str) -> dict:
    _, key, folder = OWNERS[owner]
    parts = {"deepspeed_model_states": 0, key: 0, "zero_files": 0}
    for root, _, files in os.walk(tag_dir):
        for name in files:
            size = os.path.getsize(os.path.join(root, name))
            if folder in root:
                parts[key] += size
            elif "optim_states" in name:
                parts["zero_files"] += size
            elif "model_states" in name:
                parts["deepspeed_model_states"] += size
    return parts


def measure(rank: int, world: int, model_spec: str, saves: int, tmp: str, owner: str = "grad_release") -> dict:
    import xirang_ds
    from xirang_ds.bench import optimizer_step
    from xirang_ds.data import batches, load_tokens
    from xirang_ds.models import build_model, parse_model_spec

    import torch.distributed as dist

    spec = parse_model_spec(model_spec)
    model = build_model(spec, seed=0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "xirang": OWNERS[owner][0]}
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    optimizer_step(engine, batches(load_tokens(None), 1, spec.seq, seed=0, rank=rank, world_size=world))
    times: dict[str, list[float]] = {"without": [], "with": []}
    sizes = {}
    for i in range(saves):
        for side, on in (("without", False), ("with", True)):
            engine.xirang.config = dataclasses.replace(engine.xirang.config, deepspeed_files=on)
            save_dir = os.path.join(tmp, f"{side}{i}")
            dist.barrier()
            start = time.perf_counter()
            engine.save_checkpoint(save_dir)
            dist.barrier()
            times[side].append(time.perf_counter() - start)
            sizes[side] = _sizes(os.path.join(save_dir, f"global_step{engine.global_steps}"), owner)
    params = sum(p.numel() for p in model.parameters())
    return {"parameters": params, "save_s": {k: statistics.median(v) for k, v in times.items()}, "bytes": sizes}


def render(data: dict) -> str:
    r = data["result"]
    owner = data.get("owner", "grad_release")
    key = OWNERS[owner][1]
    owned = "grad_release shards" if owner == "grad_release" else "optimizer_states codes (own folder)"
    lines = [f"`{data['command']}` ({r['parameters']:,} parameters, {data['world_size']} ranks, ZeRO-2 bf16, "
             f"{'grad_release' if owner == 'grad_release' else 'int8 optimizer_states alone'})", "",
             f"| deepspeed_files | DeepSpeed model states | {owned} | ZeRO files | save (median) |",
             "|---|---|---|---|---|"]
    for side in ("without", "with"):
        b = r["bytes"][side]
        lines.append(f"| {'true' if side == 'with' else 'false'} | {b['deepspeed_model_states'] / 2**20:,.1f} MiB | "
                     f"{b[key] / 2**20:,.1f} MiB | {b['zero_files'] / 2**20:,.1f} MiB | "
                     f"{r['save_s'][side]:.2f} s |")
    ratio = r["save_s"]["with"] / r["save_s"]["without"]
    lines.append("")
    lines.append(f"Save time with the ZeRO files: {ratio:.2f}x; ZeRO files "
                 f"{r['bytes']['with']['zero_files'] / r['parameters']:.2f} bytes per parameter.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--owner", choices=sorted(OWNERS), default="grad_release",
                        help="the section that holds the optimizer state")
    parser.add_argument("--json", default=None)
    parser.add_argument("--render", default=None, help="print the table of a saved JSON and exit")
    args = parser.parse_args()
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            print(render(json.load(f)))
        return 0
    from xirang_ds.launch import run_ranks

    with tempfile.TemporaryDirectory(prefix="xirang-ckpt-bench-") as tmp:
        results = run_ranks(measure, args.world_size, args.model, args.saves, tmp, args.owner)
    data = {"command": " ".join(["python", "benchmarks/checkpoint_files.py"] + sys.argv[1:]),
            "world_size": args.world_size, "owner": args.owner, "result": {**results[0], "save_s": {
                k: max(r["save_s"][k] for r in results) for k in ("without", "with")}}}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
