"""A length-skewed run that runs out of memory, and the same ds_config surviving it with ``on_oom``.

    python examples/oom_survival.py                 # 2 CPU ranks (gloo), about a minute
    python examples/oom_survival.py --json out.json

Every ``--long-every`` steps one micro-batch of rank 1 holds sequences ``--long`` tokens long instead of
``--short`` (the batch that kills real runs hours in). Three runs of one ds_config, ZeRO-2, 2 ranks:

1. unconstrained: measures the peak of short steps and of the long step;
2. ``memory_budget`` half-way between the two, ``enforce_budget`` on (on CPU the live-storage tracker
   raises ``torch.OutOfMemoryError`` past it, as CUDA's allocator does when the device is full) and
   ``on_oom: "raise"``: stops at the first long step, as plain DeepSpeed would on a full device;
3. the same with ``on_oom: "halve_micro_batch"``: every rank drops the micro-step, the micro-batch runs
   as two pieces and the step's micro-batches run again; ``restore_after_steps`` makes it whole again
   after quiet steps. It finishes with the same global batch, and its final loss is compared with run 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from xirang_ds.launch import run_ranks  # noqa: E402


def ds_config(block: dict, micro: int, gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "xirang": block}


def train(rank: int, world: int, args: dict, budget, on_oom: str) -> dict:
    import torch

    import xirang_ds
    from xirang_ds.data import batches, find_default_corpus, load_tokens
    from xirang_ds.models import build_model, parse_model_spec

    spec = parse_model_spec(args["model"])
    tokens = load_tokens(find_default_corpus())  # before initialize: the corpus is not device memory
    short = batches(tokens, args["micro"], args["short"], seed=0, vocab=spec.vocab, rank=rank, world_size=world)
    long = batches(tokens, args["micro"], args["long"], seed=1, vocab=spec.vocab, rank=rank, world_size=world)
    model = build_model(spec, seed=0)
    block = {"memory_budget": budget,
             "monitor": {"enabled": True, "warn_at": 0.97, "act_at": 0.99, "actions": [], "restore_after_steps": 1,
                         "on_oom": on_oom, "enforce_budget": budget != "auto"}}
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(block, args["micro"], args["gas"]))
    monitor = engine.xirang.plugin("monitor")
    losses, stopped = [], None
    for step in range(1, args["steps"] + 1):
        step_losses = []
        for micro in range(args["gas"]):
            skewed = step % args["long_every"] == 0 and micro == 0 and rank == 1
            x, y = next(long if skewed else short)
            try:
                loss = engine(x, y)
                engine.backward(loss)
            except RuntimeError as error:  # out of memory here, or a collective's peer gone (the rank that ran out)
                stopped = {"step": step, "out_of_memory": isinstance(error, torch.OutOfMemoryError),
                           "error": str(error).splitlines()[0][:200]}
                break
            engine.step()
            step_losses.append(loss.item())
        if stopped:
            break
        losses.append(sum(step_losses) / len(step_losses))
    return {"losses": losses, "stopped": stopped, "peaks": [h["peak_bytes"] for h in monitor.history],
            "retries": monitor.guard.retries if monitor.guard else [],
            "restores": sum(a["action"] == "restore_micro_batch" for a in monitor.actions_taken),
            "samples": engine.global_samples, "steps": engine.global_steps}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt:layers=2,hidden=128,heads=4,seq=256,vocab=256")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--short", type=int, default=64)
    p.add_argument("--long", type=int, default=256)
    p.add_argument("--long-every", type=int, default=8)
    p.add_argument("--json", default=None, help="write the figures here")
    args = vars(p.parse_args())

    free = run_ranks(train, 2, args, "auto", "raise")
    peaks = free[1]["peaks"]  # rank 1 carries the long micro-batch
    long_steps = [s - 1 for s in range(1, args["steps"] + 1) if s % args["long_every"] == 0]
    short_peak = max(v for i, v in enumerate(peaks) if i not in long_steps)
    long_peak = max(peaks[i] for i in long_steps)
    budget = (short_peak + long_peak) // 2
    plain = run_ranks(train, 2, args, budget, "raise")
    survived = run_ranks(train, 2, args, budget, "halve_micro_batch")

    final_free, final_survived = free[0]["losses"][-1], survived[0]["losses"][-1]
    out = {"args": args, "short_step_peak_bytes": short_peak, "long_step_peak_bytes": long_peak,
           "budget_bytes": budget, "raise": {"stopped": plain[1]["stopped"], "other_rank": plain[0]["stopped"],
                                             "steps_done": plain[1]["steps"]},
           "halve_micro_batch": {"steps": survived[0]["steps"], "samples": survived[0]["samples"],
                                 "retries": len(survived[1]["retries"]), "restores": survived[1]["restores"],
                                 "max_peak_bytes": max(max(r["peaks"]) for r in survived)},
           "unconstrained": {"steps": free[0]["steps"], "samples": free[0]["samples"]},
           "final_loss": {"unconstrained": final_free, "halve_micro_batch": final_survived,
                          "abs_difference": abs(final_free - final_survived)}}
    print(f"budget {budget:,} bytes: half-way between the short steps' peak {short_peak:,} and the long "
          f"step's {long_peak:,} (unconstrained run)")
    print(f"on_oom raise:             stopped at step {out['raise']['stopped']['step']}: "
          f"{out['raise']['stopped']['error']}")
    s = out["halve_micro_batch"]
    print(f"on_oom halve_micro_batch: {s['steps']} steps, {s['samples']} samples (unconstrained: "
          f"{free[0]['steps']}, {free[0]['samples']}), {s['retries']} retries, {s['restores']} restores, "
          f"worst peak {s['max_peak_bytes']:,} bytes")
    print(f"final loss {final_survived:.6f} vs {final_free:.6f} unconstrained "
          f"(difference {out['final_loss']['abs_difference']:.2e})")
    if args["json"]:
        with open(args["json"], "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
