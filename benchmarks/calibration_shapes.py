"""The session's calibrated prediction against what each later step measures, with batch shapes that change.

    .venv/bin/python benchmarks/calibration_shapes.py [--only SUBSTRING] [--out benchmarks/results/calibration_shapes.json]

Each configuration trains one optimizer step per sequence length of `FRACTIONS` (of the model's
``seq``: three steps at half length, then lengths not seen yet, then seen again) with the monitor on
(every preset has it), on real DeepSpeed engines on CPU. The session calibrates at its first steady
window (`xirang_ds.memory.calibration`); every later check records the prediction beside the peak it
measured. Reported per configuration: the step it calibrated at, the estimator's own error at that
window (before calibration), and the worst error of the prediction over the checks at lengths seen
before and at lengths not seen before (the estimator on the session's model copy, mapped through the
measured lengths). Memory on CPU is exact, so the table is reproducible to the byte.
"""
from __future__ import annotations

import argparse
import json
import os

from xirang_ds.launch import run_ranks

MODELS = ("gpt:layers=2,hidden=64,heads=4,seq=128,vocab=256", "llama:layers=3,hidden=256,heads=4,seq=160,vocab=768")
FRACTIONS = (0.5, 0.5, 0.5, 1.0, 1.0, 0.75, 0.25, 1.0)
CONFIGS = [  # label, stage, dtype, world, gas, block
    ("ZeRO-0 fp32", 0, "fp32", 1, 1, None),
    ("ZeRO-0 bf16", 0, "bf16", 2, 1, None),
    ("ZeRO-1 bf16", 1, "bf16", 2, 1, None),
    ("ZeRO-2 bf16", 2, "bf16", 2, 1, None),
    ("ZeRO-2 bf16 gas2", 2, "bf16", 2, 2, None),
    ("ZeRO-3 bf16", 3, "bf16", 2, 1, None),
    ("ZeRO-3 bf16 gas2", 3, "bf16", 2, 2, None),
    ("conservative ZeRO-2", 2, "bf16", 2, 1, {"preset": "conservative"}),
    ("balanced ZeRO-2", 2, "bf16", 2, 1, {"preset": "balanced"}),
    ("balanced ZeRO-2 gas2", 2, "bf16", 2, 2, {"preset": "balanced"}),
    ("balanced ZeRO-3", 3, "bf16", 2, 1, {"preset": "balanced"}),
    ("aggressive ZeRO-2", 2, "bf16", 2, 1, {"preset": "aggressive"}),
]


def ds(stage: int, dtype: str, gas: int, block) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
           "xirang": block or {"monitor": {"enabled": True}}}
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=1e6)
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def rank(rank: int, world: int, model_text: str, config: dict, lengths: list[int]) -> dict:
    import torch

    import xirang_ds
    from xirang_ds.models import build_model, parse_model_spec

    spec = parse_model_spec(model_text)
    model = build_model(spec, seed=0)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(rank)
    for length in lengths:
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randint(0, spec.vocab, (engine.train_micro_batch_size_per_gpu(), length), generator=g)
            engine.backward(engine(x, x))
            engine.step()
    cal = engine.xirang.calibration
    out = cal.as_dict()
    out["estimator_error"] = cal.estimator_error()
    engine.xirang.remove()
    return out


def summarise(per_rank: list[dict], lengths: list[int]) -> dict:
    worst = {"seen": 0.0, "new": 0.0}
    for cal in per_rank:
        seen_before: set[int] = set(lengths[:cal["calibrated_at"]])
        for c in cal["checks"]:
            length = lengths[c["step"] - 1]
            kind = "seen" if length in seen_before else "new"
            worst[kind] = max(worst[kind], abs(c["error"]))
            seen_before.add(length)
    first = per_rank[0]
    return {"calibrated_at": first["calibrated_at"], "estimator_error": first["estimator_error"],
            "worst_error_seen": worst["seen"], "worst_error_new": worst["new"],
            "checks": sum(len(c["checks"]) for c in per_rank), "notes": first["notes"], "per_rank": per_rank}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="run the configurations whose label contains this")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "calibration_shapes.json"))
    args = p.parse_args()
    rows = []
    for model in MODELS:
        seq = int(model.split("seq=")[1].split(",")[0])
        lengths = [max(8, int(seq * f)) for f in FRACTIONS]
        for label, stage, dtype, world, gas, block in CONFIGS:
            name = f"{model.split(':')[0]} {label}"
            if args.only not in name:
                continue
            row = summarise(run_ranks(rank, world, model, ds(stage, dtype, gas, block), lengths), lengths)
            row.update(model=model, config=label, lengths=lengths, world_size=world)
            rows.append(row)
            est = "n/a" if row["estimator_error"] is None else f"{row['estimator_error']:+.2%}"
            print(f"{name:<28} calibrated at step {row['calibrated_at']}  estimator alone {est:>7}  "
                  f"worst error: lengths seen {row['worst_error_seen']:.3%}, new {row['worst_error_new']:.3%}",
                  flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"lengths_fractions": FRACTIONS, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}; worst over all: seen {max(r['worst_error_seen'] for r in rows):.3%}, "
          f"new {max(r['worst_error_new'] for r in rows):.3%}")


if __name__ == "__main__":
    main()
