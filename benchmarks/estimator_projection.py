"""The estimator at scale: per-rank peaks of 1.3B, 7B and 13B GPTs projected without any memory.

    .venv/bin/python benchmarks/estimator_projection.py [--out benchmarks/results/estimator_projection.json]
    .venv/bin/python benchmarks/estimator_projection.py --render benchmarks/results/estimator_projection.json

Each row traces the real model once under ``FakeTensorMode`` (no storage is allocated; a few seconds
per row) and models one rank of 8 data-parallel ranks on an 80 GB device: bf16, micro-batch 1,
DeepSpeed's fused Adam, DeepSpeed's default buckets, plain ZeRO-2 and ZeRO-3, then each preset on the
ZeRO-2 and ZeRO-3 configurations. Beside it, for the parts they share:

* Megatron-LM's ``theoretical_memory_usage.py``: weights and optimizer at 18 bytes per parameter
  (no distributed optimizer) or 6 + 12/DP (``--use-distributed-optimizer``), and activations
  without sequence parallelism: s·b·h·(10 + 24/t) per layer, the embedding's 8·s·b + s·b·h, the
  logits and the final norm's output in 2 bytes, times 1.05.
* Korthikanti et al. (2022), eq. 1: s·b·h·(34 + 5·a·s/h) per layer (attention scores materialised).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from xirang_ds.planning.spec import estimate_spec
from xirang_ds.models import build_model, parse_model_spec

GIB = 2**30
WORLD = 8
DEVICE_BYTES = 80 * 10**9
MODELS = {
    "1.3B": dict(layers=24, hidden=2048, heads=16),
    "7B": dict(layers=32, hidden=4096, heads=32),
    "13B": dict(layers=40, hidden=5120, heads=40),
}
VOCAB = 50304
SEQS = (2048, 4096)
CONFIGS = [("ZeRO-2", 2, None), ("ZeRO-3", 3, None)] + [
    (f"ZeRO-{s} + {p}", s, p) for s in (2, 3) for p in ("conservative", "balanced", "aggressive")]


def ds_config(stage: int, preset: str | None) -> dict:
    c: dict = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
               "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if preset:
        c["xirang"] = {"preset": preset, "memory_budget": DEVICE_BYTES}
    return c


def megatron_states(params: int, distributed: bool) -> float:
    return params * (6 + 12 / WORLD if distributed else 18)


def megatron_activations(layers: int, hidden: int, seq: int, micro: int = 1) -> float:
    sbh = seq * micro * hidden
    act = sbh * (10 + 24) * layers + 8 * seq * micro + sbh
    act += (seq * micro * VOCAB + sbh) * 2
    return act * 1.05


def korthikanti(layers: int, hidden: int, heads: int, seq: int, micro: int = 1) -> float:
    return layers * seq * micro * hidden * (34 + 5 * heads * seq / hidden)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "estimator_projection.json"))
    p.add_argument("--render", metavar="JSON", help="print the Markdown table of a saved run (docs/observability.md)")
    args = p.parse_args()
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            print(render(json.load(f)))
        return
    rows = []
    for name, shape in MODELS.items():
        for seq in SEQS:
            spec = f"gpt:layers={shape['layers']},hidden={shape['hidden']},heads={shape['heads']},seq={seq},vocab={VOCAB}"
            with torch.device("meta"):
                params = sum(p.numel() for p in build_model(parse_model_spec(spec)).parameters())
            for label, stage, preset in CONFIGS:
                est = estimate_spec(spec, ds_config(stage, preset), WORLD, device="cuda")
                cats = est.by_category
                states = cats["parameters"] + cats["gradients"] + cats["optimizer_states"]
                fwd = est.phases["forward"]
                rows.append({
                    "model": name, "seq": seq, "config": label, "parameters": params,
                    "predicted_peak_bytes": est.predicted_peak_bytes, "peak_phase": est.peak_phase,
                    "fits_80GB": est.predicted_peak_bytes <= DEVICE_BYTES,
                    "states_at_peak_bytes": states, "activations_at_forward_end_bytes": fwd["activations"],
                    "by_category": dict(cats),
                    "megatron_states_bytes": megatron_states(params, distributed=stage >= 1),
                    "megatron_activations_bytes": megatron_activations(shape["layers"], shape["hidden"], seq),
                    "korthikanti_activations_bytes": korthikanti(shape["layers"], shape["hidden"], shape["heads"], seq),
                    "not_modelled": [n.split(":")[0] for n in est.notes if "not modelled" in n],
                })
                r = rows[-1]
                print(f"{name:>5} seq {seq} {label:<24} peak {r['predicted_peak_bytes'] / GIB:7.2f} GiB "
                      f"({r['peak_phase']:<14}) states {states / GIB:6.2f}  activations {fwd['activations'] / GIB:6.2f}  "
                      f"| Megatron states {r['megatron_states_bytes'] / GIB:6.2f} activations "
                      f"{r['megatron_activations_bytes'] / GIB:6.2f}  Korthikanti {r['korthikanti_activations_bytes'] / GIB:6.2f}"
                      + (f"  not modelled: {', '.join(r['not_modelled'])}" if r["not_modelled"] else ""), flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": "benchmarks/estimator_projection.py", "world_size": WORLD, "device_bytes": DEVICE_BYTES,
                   "rows": rows}, f, indent=1)


def render(data: dict) -> str:
    lines = ["| model | seq | configuration | predicted peak (GiB) | phase | model states at the peak "
             "| activations (traced) | Megatron states (formula) | Megatron activations (formula) "
             "| Korthikanti activations |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        gib = [r[k] / GIB for k in ("predicted_peak_bytes", "states_at_peak_bytes", "activations_at_forward_end_bytes",
                                    "megatron_states_bytes", "megatron_activations_bytes",
                                    "korthikanti_activations_bytes")]
        lines.append(f"| {r['model']} | {r['seq']} | {r['config']} | {gib[0]:.2f} | {r['peak_phase']} | "
                     + " | ".join(f"{g:.2f}" for g in gib[1:]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
