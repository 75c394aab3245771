"""Subcommands beyond ``validate``: bench, report (and estimate, tune where built).

Each module-level ``_setup_*`` adds arguments; each ``_run_*`` returns the exit status. Heavy
imports (torch, deepspeed) happen inside the run functions.
"""
from __future__ import annotations

import argparse
import os

from xirang_ds.cli import UsageError, register_command


def _setup_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="gpt-small | gpt:layers=4,hidden=256,heads=8,seq=128,vocab=256 | "
                                                   "package.module:factory")
    p.add_argument("--ds-config", required=True, help="ds_config with a \"xirang\" block")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per side (default 20)")
    p.add_argument("--world-size", type=int, default=1, choices=(1, 2), help="ranks (gloo on CPU)")
    p.add_argument("--data", default=None, help="text file (default: the standard library's docstrings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-config", default=None,
                   help="ds_config for the baseline (default: --ds-config without its block)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")


def _run_bench(args: argparse.Namespace) -> int:
    from xirang_ds.bench import format_result, run_bench, write_json
    from xirang_ds.config.loader import BLOCK_KEY, read_ds_config, validate_block
    from xirang_ds.models import parse_model_spec

    parse_model_spec(args.model)  # fail fast on a bad spec
    ds_config = read_ds_config(args.ds_config)
    if BLOCK_KEY not in ds_config:
        raise UsageError(f"{args.ds_config} has no \"xirang\" block: nothing to compare")
    validate_block(ds_config[BLOCK_KEY])
    if args.steps < 2:
        raise UsageError("--steps must be at least 2 (the first step is not timed)")
    if args.data and not os.path.isfile(args.data):
        raise UsageError(f"--data file not found: {args.data!r}")
    baseline = read_ds_config(args.baseline_config) if args.baseline_config else None
    result = run_bench(args.model, ds_config, steps=args.steps, world_size=args.world_size, data_path=args.data,
                       seed=args.seed, baseline_config=baseline)
    print(format_result(result))
    if args.json:
        write_json(result, args.json)
        print(f"\nwrote {args.json}")
    return 0


def _setup_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="timeline_rank<R>.json written by the profiler")
    p.add_argument("--html", default=None, help="write the HTML page here (default: beside the trace)")
    p.add_argument("--png", default=None, help="write the PNG plot here (default: beside the trace)")
    p.add_argument("--pickle", default=None, help="write a PyTorch memory_viz snapshot here")


def _run_report(args: argparse.Namespace) -> int:
    from xirang_ds.memory.report import breakdown_table
    from xirang_ds.memory.timeline import Timeline, TraceError
    from xirang_ds.memory.tracker import PeakReport

    try:
        timeline = Timeline.load(args.trace)
        stem = os.path.splitext(args.trace)[0]
        written = [timeline.save_html(args.html or stem + ".html"), timeline.save_png(args.png or stem + ".png")]
        if args.pickle:
            written.append(timeline.save_memory_viz(args.pickle))
    except TraceError as e:
        raise UsageError(str(e)) from None
    peak = timeline.peak
    print(breakdown_table(PeakReport(peak["peak_bytes"], peak["peak_by_category"], peak["peak_phase"],
                                     peak["phase_peaks"])))
    print("wrote " + ", ".join(written))
    return 0


def _setup_estimate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="gpt-small | gpt:layers=4,hidden=256,heads=8,seq=128,vocab=256 | "
                                                   "package.module:factory")
    p.add_argument("--ds-config", required=True, help="ds_config (JSON/YAML)")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="device the run will use (changes the optimizer's temporaries)")
    p.add_argument("--calibrate", action="store_true",
                   help="then run 3 real steps here, measure, and report the error per category")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")


def _run_estimate(args: argparse.Namespace) -> int:
    import json

    import torch

    from xirang_ds.config.loader import BLOCK_KEY, read_ds_config, validate_block
    from xirang_ds.memory.estimator import estimate_spec, format_estimate, recalibrate
    from xirang_ds.models import parse_model_spec

    parse_model_spec(args.model)
    ds_config = read_ds_config(args.ds_config)
    if BLOCK_KEY in ds_config:
        validate_block(ds_config[BLOCK_KEY])
    if args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1; got {args.world_size}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    est = estimate_spec(args.model, ds_config, args.world_size, device)
    out = est.as_dict()
    print(format_estimate(est))
    if args.calibrate:
        from xirang_ds.bench import run_side

        side = run_side(args.model, ds_config, 3, args.world_size, None, 0, "xirang" in ds_config)
        cal = recalibrate(est, side.peak_by_category, side.peak_bytes)
        out["calibration"] = cal
        print(f"\nmeasured over 3 steps: {side.peak_bytes:,} bytes ({side.peak_phase}); "
              f"estimate error {cal['error']:+.2%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return 0


register_command("estimate", "predict a rank's peak memory and its breakdown before running", _setup_estimate,
                 _run_estimate)
register_command("bench", "train plain DeepSpeed and DeepSpeed with the block side by side", _setup_bench,
                 _run_bench)
register_command("report", "render a recorded memory timeline as HTML and PNG", _setup_report, _run_report)
