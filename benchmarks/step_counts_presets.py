"""Kernels, host syncs and host-link bytes of one training step, plain DeepSpeed against each preset
(`xirang_ds.step_counts`, as ``xirang-ds bench --json`` gives them per side).

    .venv/bin/python benchmarks/step_counts_presets.py --label after \\
        --out benchmarks/results/step_counts_presets.json

gpt-small, 2 ranks over gloo, ZeRO-2 bf16, micro-batch 8, DeepSpeed's default clipping (1.0): the
ds_config of ``configs/demo.json`` with only ``"preset"`` in the block. Each side trains ``--steps``
steps, then one more step is counted on rank 0. ``--label`` names the run inside the JSON, which keeps
the runs of other labels already there (``before``: the code before issue 58's items 2-4).

``--as-gpu`` counts, on this CPU, the program a GPU runs where the code chooses by device type: optimizer_states'
update compiled (``fused: true``, as ``"auto"`` is off the CPU) one call per tensor (`fused.whole_tensor`), and
torch's optimizers on their multi-tensor ``foreach`` path (torch's default for CUDA tensors). A ``foreach`` op
counts one kernel here; on CUDA it launches one per group of tensors (``multi_tensor_apply``), so a GPU's
profiler may count a few more. Everything else runs as it would on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

from xirang_ds.bench import bench_rank, combine, strip_block, write_json
from xirang_ds.config.presets import expand_preset
from xirang_ds.launch import run_ranks

PRESETS = ("conservative", "balanced", "aggressive")
COUNTS = ("kernels_per_step", "host_syncs_per_step", "host_reads_per_step", "link_bytes_per_step",
          "link_bytes_by_category", "optimizer_kernels_per_step", "kernels_by_source_per_step")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ds_config(preset: str | None, as_gpu: bool = False) -> dict:
    with open(os.path.join(ROOT, "configs", "demo.json")) as f:
        config = json.load(f)
    if preset is None:
        return strip_block(config)
    block: dict = {"preset": preset}
    if as_gpu and "optimizer_states" in expand_preset(preset):
        block["optimizer_states"] = {"fused": True}
    return {**strip_block(config), "xirang": block}


def as_gpu_rank(*args):
    """`bench_rank` with the choices made by device type made as on a GPU (module docstring)."""
    import importlib

    from xirang_ds.plugins.optimizer_states import fused

    fused.whole_tensor = lambda device_type: True
    modules = [importlib.import_module(f"torch.optim.{name}") for name in ("optimizer", "adam", "adamw")]
    choose = modules[0]._default_to_fused_or_foreach

    def as_on_cuda(params, differentiable, use_fused=False):
        chosen_fused, _ = choose(params, differentiable, use_fused)
        return chosen_fused, not (differentiable or chosen_fused)

    for module in modules:
        if hasattr(module, "_default_to_fused_or_foreach"):
            module._default_to_fused_or_foreach = as_on_cuda
    return bench_rank(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--out", default=None)
    parser.add_argument("--as-gpu", action="store_true", help="count the program a GPU runs (module docstring)")
    args = parser.parse_args()
    runs = {}
    for name in ("plain",) + PRESETS:
        config = ds_config(None if name == "plain" else name, args.as_gpu)
        side = combine(run_ranks(as_gpu_rank if args.as_gpu else bench_rank, args.world_size, args.model, config,
                                 args.steps, None, 0, name != "plain", threads=max(1, (os.cpu_count() or 2) // 2)))
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
                   + (f" --model {args.model}" if args.model != "gpt-small" else "")
                   + (" --as-gpu" if args.as_gpu else "") + (f" --out {args.out}" if args.out else ""),
        "program": "as on a GPU (--as-gpu)" if args.as_gpu else "this CPU's",
        "commit": commit.strip(), "counts": runs}
    if args.out:
        write_json(out, args.out)


if __name__ == "__main__":
    main()
