"""Kernels, host syncs and host-link bytes of one training step, plain DeepSpeed against each preset
(`xirang_ds.step_counts`, as ``xirang-ds bench --json`` gives them per side).

    .venv/bin/python benchmarks/step_counts_presets.py --label after \\
        --out benchmarks/results/step_counts_presets.json

gpt-small, 2 ranks over gloo, ZeRO-2 bf16, micro-batch 8, DeepSpeed's default clipping (1.0): the
ds_config of ``configs/demo.json`` with only ``"preset"`` in the block. Each side trains ``--steps``
steps, then one more step is counted on rank 0. ``--label`` names the run inside the JSON, which keeps
the runs of other labels already there (``before``: the code before issue 58's items 2-4).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

from xirang_ds.bench import run_side, strip_block, write_json

PRESETS = ("conservative", "balanced", "aggressive")
COUNTS = ("kernels_per_step", "host_syncs_per_step", "host_reads_per_step", "link_bytes_per_step",
          "link_bytes_by_category", "optimizer_kernels_per_step")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ds_config(preset: str | None) -> dict:
    with open(os.path.join(ROOT, "configs", "demo.json")) as f:
        config = json.load(f)
    return strip_block(config) if preset is None else {**strip_block(config), "xirang": {"preset": preset}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs = {}
    for name in ("plain",) + PRESETS:
        side = run_side(args.model, ds_config(None if name == "plain" else name), args.steps, args.world_size,
                        None, 0, name != "plain")
        runs[name] = {k: side.counts.get(k) for k in COUNTS}
        print(name, json.dumps(runs[name]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    out = {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)
    out.setdefault("model", args.model)
    out.setdefault("setup", f"{args.world_size} ranks over gloo, ZeRO-2 bf16, micro-batch 8, clipping 1.0 "
                            f"(configs/demo.json, block: preset only); counts of rank 0's step after {args.steps}")
    out.setdefault("runs", {})[args.label] = {
        "command": f"python benchmarks/step_counts_presets.py --label {args.label} --steps {args.steps}"
                   + (f" --out {args.out}" if args.out else ""),
        "commit": commit.strip(), "counts": runs}
    if args.out:
        write_json(out, args.out)


if __name__ == "__main__":
    main()
