"""End-to-end step time with low-bit optimizer states, side by side: plain DeepSpeed AdamW, xirang
int8/int4 states (eager and ``fused: true``), bitsandbytes AdamW8bit and torchao AdamW8bit/AdamW4bit
as client optimizers, on the same model, data and ranks.

    .venv/bin/python benchmarks/optimizer_states_step_time.py --steps 12 \\
        --json benchmarks/results/optimizer_states_step_time.json

Every variant's engine is built in the same two rank processes and the variants take their steps in
turn (step 1 of each, then step 2 of each, ...), so a burst of load on a shared machine hits them
alike. No memory tracker runs (``xirang-ds bench`` times its steps under the tracker, whose per-op
bookkeeping costs most where a step has most ops, and under which the fused kernel falls back to
eager). A step's time is the slowest rank's; the median excludes the first two steps (state
creation, compilation). fp32 training: this CPU has no bf16 arithmetic, which would dominate.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

from xirang_ds.bench import write_json
from xirang_ds.launch import run_ranks

BASE = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 10**6,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
}
VARIANTS = ("plain", "int8", "int8 fused", "int4", "int4 fused", "bnb_adamw8bit", "torchao_adamw8bit",
            "torchao_adamw4bit")


def _engine(name: str, model_text: str):
    import deepspeed

    import xirang_ds
    from xirang_ds.bench import PEERS
    from xirang_ds.models import build_model, parse_model_spec

    model = build_model(parse_model_spec(model_text), seed=0)
    config, optimizer, init = copy.deepcopy(BASE), None, deepspeed.initialize
    if name.startswith("int"):
        dtype, _, fused = name.partition(" ")
        config["xirang"] = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": dtype}],
                                                 "fused": bool(fused)}}
        init = xirang_ds.initialize
    elif name != "plain":
        config, optimizer = PEERS[name](model, config)
    return init(model=model, model_parameters=model.parameters(), config=config, optimizer=optimizer)[0]


def _rank(rank: int, world: int, model_text: str, variants: list[str], steps: int) -> dict:
    from xirang_ds.bench import optimizer_step
    from xirang_ds.data import batches, load_tokens

    tokens = load_tokens(None)
    runs = {}
    for name in variants:
        runs[name] = (_engine(name, model_text), batches(tokens, BASE["train_micro_batch_size_per_gpu"], 128, seed=0,
                                                         rank=rank, world_size=world))
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(steps):
        for name, (engine, data) in runs.items():
            start = time.perf_counter()
            losses[name].append(optimizer_step(engine, data))
            times[name].append(time.perf_counter() - start)
    return {"times": times, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    variants = args.variants.split(",")
    per_rank = run_ranks(_rank, 2, args.model, variants, args.steps, threads=1)
    rows = {}
    for name in variants:
        steps = [max(r["times"][name][i] for r in per_rank) for i in range(args.steps)]
        rows[name] = {"step_time_median_s": statistics.median(steps[2:]), "step_times_s": steps,
                      "final_loss": per_rank[0]["losses"][name][-1]}
    base = rows[variants[0]]["step_time_median_s"]
    print(f"{args.model}, 2 ranks, ZeRO-2 fp32, {args.steps} steps in turn; ratio against {variants[0]}")
    for name, row in rows.items():
        row["ratio"] = row["step_time_median_s"] / base
        print(f"{name:20s} {row['step_time_median_s'] * 1e3:8.0f} ms  {row['ratio']:.3f}  loss {row['final_loss']:.4f}")
    if args.json:
        write_json({"command": "benchmarks/optimizer_states_step_time.py", "model": args.model, "world_size": 2,
                    "steps": args.steps, "torch": torch.__version__, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
