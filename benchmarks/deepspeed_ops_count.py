"""DeepSpeed's own kernels per step, counted in the real engine and as the estimate counts them
(`xirang_ds.planning.deepspeed_ops`), grad_release's in its place under each preset (`grad_release.step_ops`), and
the predicted steps with them.

    .venv/bin/python benchmarks/deepspeed_ops_count.py --out benchmarks/results/deepspeed_ops_count.json

gpt-small, 2 ranks over gloo, the ds_config of ``configs/demo.json`` without the block (ZeRO-2 bf16, micro-batch 8,
DeepSpeed's default clipping 1.0) and variants of it. Each side trains one step, then rank 0's next step is counted
(`xirang_ds.step_counts`): the kernels DeepSpeed launched (``kernels_by_source_per_step["deepspeed"]``: its gradient
handling, checks, norm, clipping, torch's AdamW under it, the cast back) against `engine_ops` for rank 0, in this
CPU's program (torch's single-tensor AdamW) and as a GPU runs it (``--as-gpu`` of
``benchmarks/step_counts_presets.py``: torch's ``foreach`` AdamW). Then the estimate's predicted step of plain
DeepSpeed on the GPU profiles, at gpt-small and at the 0.91B GPT of ``benchmarks/configs/plain_0.91b.json``.
Under each preset (as a GPU runs it) grad_release reduces and steps the gradients: the kernels grad_release,
optimizer_states and DeepSpeed launched against the estimate's count of grad_release's step (its update included)
and its predicted step on the H100 profile.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

from step_counts_presets import PRESETS, as_gpu_rank, ds_config

from xirang_ds.bench import bench_rank, combine, write_json
from xirang_ds.launch import run_ranks
from xirang_ds.memory.device_profile import PROFILES
from xirang_ds.memory.run_shape import RunShape
from xirang_ds.models import build_model, parse_model_spec
from xirang_ds.planning.deepspeed_ops import engine_ops
from xirang_ds.planning.spec import estimate_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"zero2_bf16": {}, "zero2_bf16_accumulation_2": {"gradient_accumulation_steps": 2},
            "zero1_bf16": {"zero_optimization": {"stage": 1}}, "zero2_fp32": {"bf16": {"enabled": False}},
            "zero2_bf16_no_clipping": {"gradient_clipping": 0.0}, "zero0_bf16": {"zero_optimization": {"stage": 0}},
            "zero0_fp32": {"zero_optimization": {"stage": 0}, "bf16": {"enabled": False}}}
BIG = "gpt:layers=16,hidden=2048,heads=16,seq=1024,vocab=50304"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    numels = [p.numel() for p in build_model(parse_model_spec(args.model)).parameters()]
    rows = {}
    for name, extra in VARIANTS.items():
        config = {**ds_config(None), **extra}
        row = {}
        for program, rank_fn, device in (("cpu", bench_rank, "cpu"), ("as_gpu", as_gpu_rank, "cuda")):
            counts = combine(run_ranks(rank_fn, 2, args.model, config, 1, None, 0, False, threads=1)).counts
            backward, step = engine_ops(RunShape.from_ds_config(config, 2, device), numels, rank=0)
            row[program] = {"counted": counts["kernels_by_source_per_step"].get("deepspeed", 0),
                            "predicted": backward.launches + step.launches,
                            "kernels_per_step": counts["kernels_per_step"]}
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    presets = {}
    for preset in PRESETS:
        config = ds_config(preset, True)
        counts = combine(run_ranks(as_gpu_rank, 2, args.model, config, 1, None, 0, True, threads=1)).counts
        by_source = counts["kernels_by_source_per_step"]
        st = estimate_spec(args.model, config, 2, "cuda", device_profile=PROFILES["h100"]).step_time
        sources = ("grad_release", "optimizer_states", "deepspeed")
        presets[preset] = {"counted": {k: by_source.get(k, 0) for k in sources},
                           "predicted": st.counts["engine_backward"]["launches"] + st.counts["optimizer"]["launches"],
                           "kernels_per_step": counts["kernels_per_step"], "predicted_kernels": st.counts["kernels"],
                           "predicted_step_s_h100": st.seconds, "notes": st.notes}
        print(preset, json.dumps(presets[preset]), flush=True)
    with open(os.path.join(ROOT, "benchmarks", "configs", "plain_0.91b.json")) as f:
        big = json.load(f)
    predicted = {}
    for model, config, world, gpu in ((args.model, ds_config(None), 2, "h100"), (BIG, big, 1, "h200")):
        st = estimate_spec(model, config, world, "cuda", device_profile=PROFILES[gpu]).step_time
        predicted[f"{model} {world} rank(s) {gpu}"] = {"seconds": st.seconds, "parts": st.parts,
                                                        "kernels": st.counts["kernels"],
                                                        "host_syncs": st.counts["host_syncs"]}
    plain_big = predicted[f"{BIG} 1 rank(s) h200"]["seconds"]
    for preset in PRESETS:  # the presets at 0.91B on one H200, memory_budget auto (the device's memory)
        st = estimate_spec(BIG, {**big, "xirang": {"preset": preset}}, 1, "cuda",
                           device_profile=PROFILES["h200"]).step_time
        predicted[f"{BIG} 1 rank(s) h200 {preset}"] = {"seconds": st.seconds, "parts": st.parts,
                                                         "kernels": st.counts["kernels"],
                                                         "host_syncs": st.counts["host_syncs"], "notes": st.notes,
                                                         "to_plain": st.seconds / plain_big}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    out = {"command": "python benchmarks/deepspeed_ops_count.py" + (f" --out {args.out}" if args.out else ""),
           "commit": commit.strip(), "model": args.model,
           "setup": "2 ranks over gloo, configs/demo.json without the block and the variants named; rank 0's step "
                    "after one, DeepSpeed's kernels (counted) against deepspeed_ops.engine_ops for rank 0 (predicted)",
           "deepspeed_kernels_per_step": rows, "presets_as_gpu": presets, "plain_predicted_step": predicted}
    print(json.dumps(predicted, indent=1))
    if args.out:
        write_json(out, args.out)


if __name__ == "__main__":
    main()
