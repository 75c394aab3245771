"""Train a small GPT with DeepSpeed and the "xirang" block, on CPU or GPU.

    deepspeed --num_gpus 2 examples/train_gpt.py --ds-config configs/demo.json --steps 40
    torchrun --nproc_per_node 2 examples/train_gpt.py --ds-config configs/demo.json
    python examples/train_gpt.py --ds-config configs/demo.json          # one process

The training loop is an ordinary DeepSpeed loop; the only xirang line is ``xirang_ds.initialize``
in place of ``deepspeed.initialize``. At the end rank 0 prints what xirang did and, when the
session tracked memory, the breakdown of the last step's peak.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import xirang_ds
from xirang_ds.data import batches, find_default_corpus, load_tokens
from xirang_ds.models import build_model, parse_model_spec


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds-config", "--deepspeed_config", dest="ds_config", required=True,
                   help="ds_config JSON/YAML with a \"xirang\" block (--deepspeed_config as DeepSpeed scripts name it)")
    p.add_argument("--model", default="gpt-small", help="built-in name or gpt:layers=..,hidden=..,...")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--data", default=None, help="text file (default: tinyshakespeare if present, "
                                               "else the standard library's docstrings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                         ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, default)  # single process without a launcher
    if not torch.cuda.is_available():
        from xirang_ds.launch import disable_shm_build

        disable_shm_build()
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["WORLD_SIZE"])))

    spec = parse_model_spec(args.model)
    tokens = load_tokens(args.data or find_default_corpus())
    model = build_model(spec, seed=args.seed)
    engine, _, _, _ = xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.ds_config)
    rank, world = engine.global_rank, engine.dp_world_size
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    data = batches(tokens, micro, spec.seq, seed=args.seed, vocab=spec.vocab, rank=rank, world_size=world)
    dtype = next(engine.module.parameters()).dtype
    device = engine.device

    losses, times = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        for _ in range(gas):
            x, y = (t.to(device) for t in next(data))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {times[-1] * 1000:.0f} ms", flush=True)

    if rank == 0:
        session = getattr(engine, "xirang", None)
        print(f"\nmodel {spec.describe() if hasattr(spec, 'describe') else args.model}, {world} rank(s), "
              f"micro-batch {micro}, accumulation {gas}, dtype {str(dtype).replace('torch.', '')}")
        print(f"final loss {losses[-1]:.4f}; median step {sorted(times)[len(times) // 2] * 1000:.0f} ms")
        if session is not None:
            print(session.summary())
            monitor = session.plugin("monitor")
            if monitor is not None and monitor.last_report is not None:
                from xirang_ds.memory.report import breakdown_table

                print("\nmemory at the peak of the last step (rank 0, live-storage tracker):")
                print(breakdown_table(monitor.last_report))
    import deepspeed.comm as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
