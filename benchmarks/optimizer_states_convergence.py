"""Convergence of a small GPT on tinyshakespeare with each optimizer-state variant, same data order.

    .venv/bin/python benchmarks/optimizer_states_convergence.py --steps 300 \
        --json benchmarks/results/optimizer_states_convergence.json

Every run starts from the same weights and sees the same batches. Reported per variant: the final
training loss (mean of the last 20 steps), the held-out loss after the last step (8 fixed batches
the training never sees), their ratio to fp32 AdamW's, the optimizer-state bytes per parameter at
the end and the wall time. One thread per run; runs are sequential.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from typing import Any, Callable

import torch

from xirang_ds.bench import write_json
from xirang_ds.data import batches, load_tokens
from xirang_ds.models import build_model, parse_model_spec

MODEL = "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=256"
CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "tinyshakespeare.txt")


def variants(lr: float) -> dict[str, Callable[[Any], torch.optim.Optimizer]]:
    from xirang_ds.plugins.optimizer_states import DynamicAdamW

    def ours(schedule: list, **extra: Any) -> Callable[[Any], torch.optim.Optimizer]:
        return lambda ps: DynamicAdamW(ps, lr=lr, states={"schedule": schedule, **extra})

    out: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
        "torch AdamW fp32 (reference)": lambda ps: torch.optim.AdamW(ps, lr=lr),
        "xirang default schedule (fp32 -> int8 at step 100)": ours([{"dtype": "fp32", "until_step": 100},
                                                                    {"dtype": "int8"}]),
        "xirang default schedule with int4 (fp32 -> int4 at step 100)": ours([{"dtype": "fp32", "until_step": 100},
                                                                              {"dtype": "int4"}]),
        "xirang int8 from step 1": ours([{"dtype": "int8"}]),
        "xirang int4 from step 1": ours([{"dtype": "int4"}]),
        "xirang int4 from step 1, stochastic rounding": ours([{"dtype": "int4"}], stochastic_rounding=True),
        "xirang stability policy (defaults)": lambda ps: DynamicAdamW(ps, lr=lr, states={"policy": "stability"}),
        "xirang stability policy (window 25, threshold 0.25, lowest int8)": lambda ps: DynamicAdamW(
            ps, lr=lr, states={"policy": "stability", "stability": {"window_steps": 25, "threshold": 0.25}}),
    }
    try:
        from torchao.optim import AdamW4bit, AdamW8bit

        out["torchao AdamW8bit"] = lambda ps: AdamW8bit(ps, lr=lr)
        out["torchao AdamW4bit"] = lambda ps: AdamW4bit(ps, lr=lr)
    except Exception as e:  # pragma: no cover
        print(f"torchao not available: {e}")
    try:
        import bitsandbytes as bnb

        out["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=lr)
    except Exception as e:  # pragma: no cover
        print(f"bitsandbytes not available: {e}")
    return out


def train(make: Callable[[Any], torch.optim.Optimizer], steps: int, micro: int, tokens: torch.Tensor,
          held_out: list) -> dict:
    from optimizer_states_compare import state_bytes  # this folder is on sys.path when run as a script

    spec = parse_model_spec(MODEL)
    model = build_model(spec, seed=0)
    opt = make(model.parameters())
    data = batches(tokens, micro, spec.seq, seed=0, vocab=spec.vocab)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        x, y = next(data)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    wall = time.perf_counter() - start
    with torch.no_grad():
        held = sum(model(x, y).item() for x, y in held_out) / len(held_out)
    numel = sum(p.numel() for p in model.parameters())
    return {"losses": losses, "final_train_loss": sum(losses[-20:]) / 20, "held_out_loss": held,
            "state_bytes_per_param": state_bytes(opt) / numel, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--only", default=None, help="run the variants whose name contains this; with --json, "
                                                     "add them to the file's earlier results")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    tokens = load_tokens(CORPUS if os.path.isfile(CORPUS) else None)
    spec = parse_model_spec(MODEL)
    held_iter = batches(tokens, 32, spec.seq, seed=12345, vocab=spec.vocab)
    held_out = [next(held_iter) for _ in range(8)]
    result: dict[str, Any] = {"model": MODEL, "steps": args.steps, "micro_batch": args.micro, "lr": args.lr,
                              "data": "tinyshakespeare.txt", "variants": {}}
    if args.only and args.json and os.path.isfile(args.json):  # add to an earlier run's table
        with open(args.json, encoding="utf-8") as f:
            earlier = json.load(f)
        if all(earlier.get(k) == result[k] for k in ("model", "steps", "micro_batch", "lr")):
            result["variants"] = earlier["variants"]
    for name, make in variants(args.lr).items():
        if args.only and args.only not in name:
            continue
        row = train(make, args.steps, args.micro, tokens, held_out)
        result["variants"][name] = row
        print(f"{name:62s} train {row['final_train_loss']:.4f}  held-out {row['held_out_loss']:.4f}  "
              f"{row['state_bytes_per_param']:.3f} B/param  {row['wall_s']:.0f} s", flush=True)
        if args.json:
            write_json(result, args.json)
    ref = result["variants"].get("torch AdamW fp32 (reference)")
    if ref:
        for row in result["variants"].values():
            row["train_ratio_to_fp32"] = row["final_train_loss"] / ref["final_train_loss"]
            row["held_out_ratio_to_fp32"] = row["held_out_loss"] / ref["held_out_loss"]
    if args.json:
        write_json(result, args.json)


if __name__ == "__main__":
    main()
