"""The memory pool's effect on CPU: gpt-small, 2 ranks, ZeRO-2 bf16, gradient accumulation 2, int8
optimizer states and activation payloads (int8 on the MLPs, lossless on attention), with and without
``memory_pool``.

    .venv/bin/python benchmarks/memory_pool.py [--steps 8] [--out benchmarks/results/memory_pool.json]

Per side and rank: the step peak and its breakdown (live-storage tracker, exact on CPU), the
device storages allocated per optimizer step (tracker records created in the step), the pool's
per-step counts, and the losses (which must be equal). No GPU was available: there is no
fragmentation figure (on CPU every allocation is exact; the caching allocator is not involved).
"""
from __future__ import annotations

import argparse
import json
import os

BLOCK = {
    "activations": {"enabled": True, "planner": False, "quantize": ["blocks.*.mlp"], "compress": ["blocks.*.attn"],
                    "tolerant": ["blocks.*"]},
    "optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]},
}


def config(pool: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "bf16": {"enabled": True},
        "xirang": {**BLOCK, **({"memory_pool": {"enabled": True}} if pool else {})},
    }


def side(rank: int, world: int, pool: bool, steps: int) -> dict:
    import xirang_ds
    from xirang_ds.bench import optimizer_step
    from xirang_ds.data import batches, load_tokens
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-small"]
    model = build_model(spec, seed=0)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config(pool))
    session = engine.xirang
    tracker = session.track_memory()
    window = tracker.open_window()
    data = batches(load_tokens(None), 8, spec.seq, seed=0, rank=rank, world_size=world)
    losses, allocations = [], []
    for _ in range(steps):
        start = tracker.clock
        losses.append(optimizer_step(engine, data))
        allocations.append(sum(1 for r in tracker.records if r.created > start and not r.host))
    report = window.report()
    the_pool = session.pool()
    out = {"losses": losses, "allocations_per_step": allocations, "peak_bytes": report.peak_bytes,
           "peak_by_category": report.by_category, "category_peaks": window.category_peaks(),
           "pool": the_pool.stats() if the_pool is not None else None,
           "pool_history": list(the_pool.history) if the_pool is not None else None}
    window.close()
    session.remove()
    return out


def main() -> None:
    from xirang_ds.launch import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "memory_pool.json"))
    args = parser.parse_args()
    result = {}
    for name, pool in (("without_pool", False), ("with_pool", True)):
        result[name] = run_ranks(side, 2, pool, args.steps, threads=1)
    result["losses_equal"] = all(a["losses"] == b["losses"] for a, b in zip(result["without_pool"], result["with_pool"]))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    for name in ("without_pool", "with_pool"):
        r = result[name][0]
        print(f"{name}: peak {r['peak_bytes']} B (rank 0), allocations per step {r['allocations_per_step']}")
        if r["pool"]:
            print(f"  pool: {r['pool']}")
    print("losses equal:", result["losses_equal"])


if __name__ == "__main__":
    main()
