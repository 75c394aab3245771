"""The predicted step time of plain DeepSpeed against its measured step on this CPU (issue 57, item 4): the
count model of `xirang_ds.planning.step_time` priced by this machine's CPU profile, measured by the micro-benchmark
`xirang_ds.memory.device_profile.measure_cpu_profile` in the rank's own thread setting.

    .venv/bin/python benchmarks/step_time_cpu.py [--models M ...] [--steps 8] \\
        [--out benchmarks/results/step_time_cpu.json]

Each model trains on 2 gloo ranks (ZeRO-2 bf16, micro-batch 4, clipping 1.0, torch's AdamW, no xirang block,
no tracker) for 2 warm-up steps and ``--steps`` timed ones; the figure is the median of the slower rank's
step times. Before training every rank measures the CPU profile at once (so the cores are shared as in
training); the estimate runs afterwards on rank 0 with rank 0's. Wall times on a shared 2-core machine are
noisy: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from xirang_ds.launch import run_ranks

MODELS = ("gpt-small", "gpt:layers=4,hidden=512,heads=8,seq=128,vocab=16000")


def ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}}


def _rank(rank: int, world: int, model: str, steps: int) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist

    from xirang_ds.bench import timed_step
    from xirang_ds.data import batches, load_tokens
    from xirang_ds.memory.device_profile import measure_cpu_profile
    from xirang_ds.models import build_model, parse_model_spec
    from xirang_ds.planning.spec import estimate_spec

    spec = parse_model_spec(model)
    model = build_model(spec)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    dist.barrier()
    profile = measure_cpu_profile()  # every rank at once: the cores shared as in training; rank 0's is used
    dist.barrier()
    data = batches(load_tokens(), 4, spec.seq, seed=0, vocab=spec.vocab, rank=rank, world_size=world)
    times = []
    for i in range(2 + steps):
        _, seconds = timed_step(engine, data)
        if i >= 2:
            times.append(seconds)
    out = {"step_times_s": times}
    if rank == 0:
        est = estimate_spec(spec, ds_config(), world, "cpu", device_profile=profile)
        out.update(profile=profile.as_dict(), step_time=est.step_time.as_dict(), threads=torch.get_num_threads())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for model in args.models:
        ranks = run_ranks(_rank, 2, model, args.steps)
        slower = [max(r["step_times_s"][i] for r in ranks) for i in range(args.steps)]
        measured = statistics.median(slower)
        predicted = ranks[0]["step_time"]["seconds"]
        rows.append({"model": model, "measured_step_s": measured, "predicted_step_s": predicted,
                     "error": predicted / measured - 1, "step_times_s": slower, "threads": ranks[0]["threads"],
                     "step_time": ranks[0]["step_time"], "profile": ranks[0]["profile"]})
        print(f"{model}: predicted {predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms "
              f"({predicted / measured - 1:+.1%}); parts " +
              ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ranks[0]["step_time"]["parts"].items()))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"command": "python benchmarks/step_time_cpu.py " + " ".join(
                f"--models {' '.join(args.models)}".split()) + f" --steps {args.steps}", "config": ds_config(),
                "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
