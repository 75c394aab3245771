"""One side of the GPU check's bench, in this process, on one device: plain DeepSpeed, or a preset
under a budget that is a fraction of the plain side's peak (read from the same results file).

    python tools/gpu_check/bench_side.py --side plain --model gpt:... --jsonl bench.jsonl
    python tools/gpu_check/bench_side.py --side balanced --model gpt:... --jsonl bench.jsonl

run.sh starts one process per side, each under its own time limit, so a slow or failing side costs
only itself. Records, each appended and synced as it happens (`xirang_ds.bench.append_jsonl`):

* ``{"kind": "step", ...}`` after every optimizer step: its loss and time (a cut side keeps its steps);
* ``{"kind": "side", ...}`` at the end: the allocator's peak over the steps and its reserved peak (on a CPU
  the live-storage tracker's peak instead), the first ``--warmup`` steps' times apart (compilation,
  the planner's passes), the median of the ``--steps`` timed steps after them, and per step the kernels,
  host syncs and host-link bytes (`xirang_ds.step_counts`), or the error that stopped the side.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

from xirang_ds.bench import append_jsonl, read_jsonl

BASE_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1000,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
    # torch_adam: the GPU machine has no DeepSpeed ops built (prepare.sh builds the wheel without them)
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
}
PRESET_BUDGETS = {"conservative": 0.75, "balanced": 0.5, "aggressive": 0.6}
"""Each preset runs under ``memory_budget`` = this fraction of the plain side's peak."""


def plain_peak(path: str, model: str) -> int | None:
    """The peak of the last finished plain side of ``model`` in ``path``."""
    peaks = [r["peak_bytes"] for r in read_jsonl(path)
             if r.get("kind") == "side" and r.get("side") == "plain" and r.get("model") == model
             and r.get("peak_bytes")]
    return peaks[-1] if peaks else None


def config_for(side: str, model: str, path: str, micro_batch: int) -> tuple[dict, int | None, str | None]:
    """The side's ds_config, its budget in bytes, and why it has none where a preset runs without."""
    config = {**BASE_CONFIG, "train_micro_batch_size_per_gpu": micro_batch}
    if side == "plain":
        return config, None, None
    peak = plain_peak(path, model)
    if peak is None:  # still measured: memory and time unbudgeted beat nothing
        return {**config, "xirang": {"preset": side}}, None, "no plain side finished: the preset runs unbudgeted"
    budget = int(peak * PRESET_BUDGETS[side])
    return {**config, "xirang": {"preset": side, "memory_budget": budget}}, budget, None


def run(args: argparse.Namespace) -> dict:
    import deepspeed
    import torch

    import xirang_ds
    from xirang_ds.bench import step_counts, timed_step, track_engine
    from xirang_ds.data import batches, load_tokens
    from xirang_ds.launch import prepare_cpu_process
    from xirang_ds.models import build_model, parse_model_spec

    prepare_cpu_process(0, 1)
    config, budget, note = config_for(args.side, args.model, args.jsonl, args.micro_batch)
    head = {"kind": "side", "side": args.side, "model": args.model, "budget_bytes": budget, "note": note,
            "ds_config": config}
    began = time.perf_counter()
    spec = parse_model_spec(args.model)
    tokens = load_tokens(args.data)  # before any measuring: the corpus is host memory of the harness
    model = build_model(spec, seed=args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    init = xirang_ds.initialize if args.side != "plain" else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    init_s = time.perf_counter() - began
    cuda = engine.device.type == "cuda"
    session = getattr(engine, "xirang", None)
    tracker = watch = None
    if cuda:  # the allocator's peak through its one owner, which the session's readers share
        from xirang_ds.memory.device_peak import device_peak

        torch.cuda.synchronize()
        device_window = device_peak().open()
    else:  # a CPU has no allocator counter: the live-storage tracker, as `xirang-ds bench` does
        tracker, watch = track_engine(engine)
        window = tracker.open_window()
    data = batches(tokens, engine.train_micro_batch_size_per_gpu(), spec.seq, seed=args.seed,
                   vocab=spec.vocab)
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        loss, seconds = timed_step(engine, data)
        times.append(seconds)
        losses.append(loss)
        append_jsonl(args.jsonl, {"kind": "step", "side": args.side, "model": args.model, "step": step + 1,
                                    "loss": loss, "time_s": times[-1]})
    out = {**head, "device": str(engine.device), "parameters": parameters, "init_s": init_s,
           "losses": losses, "final_loss": losses[-1], "warmup_step_times_s": times[:args.warmup],
           "step_times_s": times[args.warmup:],
           "step_time_median_s": statistics.median(times[args.warmup:]) if args.steps else None}
    if cuda:  # reserved: since the process started (resetting it would reset the owner's counter too)
        out.update(peak_bytes=device_window.peak_bytes, allocator_peak_bytes=device_window.peak_bytes,
                   reserved_peak_bytes=torch.cuda.max_memory_reserved())
        device_window.close()
    else:
        report = window.report()
        out.update(peak_bytes=report.peak_bytes, tracker_peak_bytes=report.peak_bytes,
                   peak_by_category=report.by_category, allocator_peak_bytes=None, reserved_peak_bytes=None)
        window.close()
    if args.counts:  # after the figures above: these steps run under a profiler and a dispatch mode
        out["counts"] = step_counts(engine, data, tracker)
    out["summary"] = session.summary() if session is not None else ""
    if watch is not None:
        watch.remove()
        tracker.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", required=True, choices=("plain", *PRESET_BUDGETS))
    p.add_argument("--model", required=True)
    p.add_argument("--jsonl", required=True, help="results file, appended to")
    p.add_argument("--warmup", type=int, default=3, help="steps timed apart (compilation, the planner's passes)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up (the median's)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--data", default=None, help="text file (default: stdlib docstrings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-counts", dest="counts", action="store_false", help="skip the counted steps")
    args = p.parse_args(argv)
    began = time.perf_counter()
    try:
        out = run(args)
    except Exception as e:  # recorded: the summary says which side failed and why
        append_jsonl(args.jsonl, {"kind": "side", "side": args.side, "model": args.model,
                                    "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:],
                                    "wall_s": time.perf_counter() - began})
        traceback.print_exc()
        return 1
    out["wall_s"] = time.perf_counter() - began
    append_jsonl(args.jsonl, out)
    peak = out["peak_bytes"]
    median = out["step_time_median_s"]
    counts = out.get("counts") or {}
    print(f"{args.side}: peak {peak:,} B, reserved {out['reserved_peak_bytes']}, "
          f"step {median * 1000 if median else float('nan'):.1f} ms (warm-up {sum(out['warmup_step_times_s']):.1f} s), "
          f"loss {out['final_loss']:.4f}, per step: {counts}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
