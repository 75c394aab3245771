"""Quantization maps compared on real Adam moments: the relative error of the update direction.

    .venv/bin/python benchmarks/optimizer_states_maps.py --steps 200 \
        --json benchmarks/results/optimizer_states_maps.json

A small GPT trains on tinyshakespeare with ``torch.optim.AdamW``; at a few steps the moments of
every tensor with >= 4096 elements are quantized block-wise with each map and decoded again, and
``|| m'/(sqrt(v')+eps) - m/(sqrt(v)+eps) || / || m/(sqrt(v)+eps) ||`` is reported over all those
tensors (the direction Adam moves the weights in; the error that matters for training).

Maps: xirang's analytic maps (this package, through its own encode/decode), the 8-bit dynamic
maps of Dettmers et al. 2022 (bitsandbytes; torchao's ``create_dynamic_map``), and the 4-bit maps
of Li et al. 2023 as torchao ships them (dynamic-exponent map for m, linear map without zero for v).
"""
from __future__ import annotations

import argparse
import math
import os
import warnings

import torch

from xirang_ds.bench import write_json
from xirang_ds.data import batches, load_tokens
from xirang_ds.models import build_model, parse_model_spec

MODEL = "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=256"
CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "tinyshakespeare.txt")
EPS = 1e-8


def lut_round_trip(x: torch.Tensor, qmap: torch.Tensor, block: int, signed: bool) -> torch.Tensor:
    """Block-wise absmax scaling and nearest-value lookup in a table (bitsandbytes/torchao style)."""
    n = x.numel() - x.numel() % block
    xb = x[:n].view(-1, block)
    scale = (xb.abs() if signed else xb).amax(dim=1, keepdim=True).clamp(min=1e-30)
    mid = (qmap[1:] + qmap[:-1]) / 2
    return torch.cat([(qmap[torch.bucketize(xb / scale, mid)] * scale).view(-1), x[n:]])


def ours_round_trip(fmt, moment: str, x: torch.Tensor) -> torch.Tensor:
    buffers = fmt.zeros(moment, x.numel(), x.device)
    fmt.encode(moment, x.clone(), buffers, 0)
    return fmt.decode(moment, buffers, 0, x.numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--at", default="10,50,200")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from xirang_ds.plugins.optimizer_states.formats import make_format

    int8, int4 = make_format("int8"), make_format("int4")
    candidates = {
        "xirang int8 (block 256)": lambda m, v: (ours_round_trip(int8, "exp_avg", m), ours_round_trip(int8, "exp_avg_sq", v)),
        "xirang int4 (block 128)": lambda m, v: (ours_round_trip(int4, "exp_avg", m), ours_round_trip(int4, "exp_avg_sq", v)),
    }
    try:  # the peers' maps come from torchao (the bench extra)
        from torchao.optim.quant_utils import create_dynamic_map
    except ImportError:
        print("torchao is not installed (pip install -e '.[bench]'): only xirang's maps are measured")
    else:
        dyn_signed = torch.tensor(create_dynamic_map(True, 7, 8))
        dyn_unsigned = torch.tensor(create_dynamic_map(False, 7, 8))
        de4_signed = torch.tensor(create_dynamic_map(True, 3, 4))
        linear4_no_zero = torch.linspace(0, 1, 17)[1:]
        candidates["bitsandbytes dynamic 8-bit (block 256)"] = lambda m, v: (
            lut_round_trip(m, dyn_signed, 256, True), lut_round_trip(v, dyn_unsigned, 256, False))
        candidates["Li et al. 4-bit as in torchao (block 128)"] = lambda m, v: (
            lut_round_trip(m, de4_signed, 128, True), lut_round_trip(v, linear4_no_zero, 128, False))
    at = {int(s) for s in args.at.split(",")}
    spec = parse_model_spec(MODEL)
    model = build_model(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    data = batches(load_tokens(CORPUS if os.path.isfile(CORPUS) else None), 16, spec.seq, seed=0, vocab=spec.vocab)
    result = {"model": MODEL, "steps": sorted(at), "update_relative_error": {name: {} for name in candidates}}
    for step in range(1, args.steps + 1):
        x, y = next(data)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        if step not in at:
            continue
        for name, fn in candidates.items():
            err = ref = 0.0
            for p in model.parameters():
                if p.numel() < 4096:
                    continue
                m, v = opt.state[p]["exp_avg"].view(-1), opt.state[p]["exp_avg_sq"].view(-1)
                u = m / (v.sqrt() + EPS)
                mq, vq = fn(m, v)
                err += float(((mq / (vq.sqrt() + EPS)) - u).double().square().sum())
                ref += float(u.double().square().sum())
            result["update_relative_error"][name][str(step)] = math.sqrt(err / ref)
    for name, row in result["update_relative_error"].items():
        print(f"{name:44s} " + "  ".join(f"step {s}: {e:.4f}" for s, e in row.items()))
    if args.json:
        write_json(result, args.json)


if __name__ == "__main__":
    main()
