"""The ``xirang-ds`` command line: validate, estimate, report, bench, tune.

Bad input (an invalid config, a missing file, a bad model spec, a trace that is not one) prints one
clear message and exits with status 2; nothing from deep inside DeepSpeed reaches the user.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Callable, Optional

from xirang_ds.config.loader import read_ds_config
from xirang_ds.config.placeholders import fill_placeholders, parse_settings
from xirang_ds.config import BLOCK_KEY, to_dict
from xirang_ds.bench import format_result, run_bench, write_json
from xirang_ds.bench import run_side
from xirang_ds.config.types import format_bytes, parse_byte_size
from xirang_ds import __version__
from xirang_ds.config.validate import XirangConfigError

USAGE_ERROR = 2


class UsageError(Exception):
    """A user error the CLI reports in one message with exit status 2."""


def _read_config(path: str, args: argparse.Namespace) -> tuple[dict, list[str]]:
    """The ds_config at ``path`` with ``--set`` applied and HF's ``"auto"`` fields filled, and a note per
    field filled without a ``--set`` (`xirang_ds.config.placeholders`)."""
    return fill_placeholders(read_ds_config(path), parse_settings(args.set or []))


def _model(args: argparse.Namespace) -> Any:
    """``--model`` parsed, with ``--seq`` and ``--vocab`` (a factory needs both)."""
    from xirang_ds.models import parse_model_spec

    return parse_model_spec(args.model, seq=args.seq, vocab=args.vocab)


def _add_config_flags(p: argparse.ArgumentParser, model: bool = True) -> None:
    """``--set`` for HF-style ds_configs, and ``--seq``/``--vocab`` for ``--model``."""
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="set a ds_config field before reading it, e.g. --set train_micro_batch_size_per_gpu=8 "
                        "(the value as JSON); how a field HF Trainer/Accelerate would fill (\"auto\") gets its value")
    if model:
        p.add_argument("--seq", type=int, default=None,
                       help="sequence length of the run's inputs (required for module:factory; replaces a spec's)")
        p.add_argument("--vocab", type=int, default=None,
                       help="vocabulary of the run's token ids (required for module:factory; replaces a spec's)")


def _cmd_validate(args: argparse.Namespace) -> int:
    from xirang_ds.planning.preset import resolve

    ds_config, notes = _read_config(args.config, args)
    if BLOCK_KEY not in ds_config:
        print(f"{args.config}: no \"xirang\" block; the run is plain DeepSpeed")
        return 0
    spec = None
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time log lines stay off stdout (JSON)
        if args.model is not None:
            if args.world_size < 1:
                raise UsageError(f"--world-size must be >= 1; got {args.world_size}")
            spec = _model(args)
        resolved = resolve(ds_config, spec=spec, world_size=args.world_size)
        config = resolved.config
        verdict = _fit_verdict(spec, ds_config, args.world_size, config) if spec is not None else None
    enabled = ", ".join(config.enabled_sections()) or "none"
    print(f"{args.config}: valid; preset {config.preset or 'none'}; enabled sections: {enabled}")
    for line in ([resolved.choice] if resolved.choice else []) + notes + resolved.lines() + ([verdict] if verdict else []):
        print(f"  {line}")
    if args.show_resolved:
        print(json.dumps({"xirang": to_dict(config)}, indent=2))
    return 0


def _fit_verdict(spec: Any, ds_config: dict, world_size: int, config: Any) -> Optional[str]:
    """Whether the block fits its budget on ``spec``, by the estimate the run plans with (the same plan, least budget
    and fixes as ``initialize``'s refusal at the first forward: a planner's plan says it, ``refusal``); ``config``: the
    resolved block.

    Raises:
        XirangConfigError: it does not fit.
    """
    from xirang_ds.config.types import format_bytes
    from xirang_ds.memory.run_shape import RunShape
    from xirang_ds.models import describe_model
    from xirang_ds.planning.spec import estimate_spec
    from xirang_ds.planning.suggest import least_fitting_budget
    from xirang_ds.registry import plugin_classes
    from xirang_ds.roles import LowersBesidesActivations

    est = estimate_spec(spec, ds_config, world_size, timed=False)
    if est.fits is None:
        return None
    budget = ds_config[BLOCK_KEY].get("memory_budget", "auto")
    micro = RunShape.from_ds_config(ds_config, world_size).micro_batch
    where = f"estimated for {describe_model(spec)} on {world_size} rank(s), micro-batch {micro}"
    refusing = [plan for plan in est.plans.values() if getattr(plan, "problems", None)]  # a planner's refusal
    if not est.fits and refusing:
        least = None
        if budget != "auto":
            least = least_fitting_budget(ds_config, lambda c: estimate_spec(spec, c, world_size, timed=False),
                                         est.least_budget_bytes)[0]
        sections = config.sections()
        fixes = "; or ".join(fix for fix in (cls.budget_fix(sections[cls.section]) for cls in plugin_classes()
                                             if issubclass(cls, LowersBesidesActivations) and cls.section in sections)
                             if fix)
        raise XirangConfigError([p for plan in refusing for p in plan.refusal(budget, where, fixes=fixes, least=least)])
    if est.host_refusal and est.device_fits is not False:  # the host tiers alone, as the run refuses them
        raise XirangConfigError([("xirang.host_memory_budget", f"{est.host_refusal} ({where})")])
    if not est.fits:
        raise XirangConfigError([("xirang.memory_budget", f"the estimate's peak {format_bytes(est.bound_bytes)} "
                                                          f"is above it ({where}); xirang-ds estimate names a change "
                                                          "that fits")])
    return (f"fits memory_budget ({where}): peak {format_bytes(est.predicted_peak_bytes)} (at most "
            f"{format_bytes(est.bound_bytes)}), least budget {format_bytes(est.least_budget_bytes)}")


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}
"""Subcommand name → (help, add_arguments(parser), run(args) -> exit status)."""


def register_command(name: str, help_text: str, setup: Callable[[argparse.ArgumentParser], None],
                     run: Callable[[argparse.Namespace], int]) -> None:
    """Add a subcommand (a third-party module may add its own at import, before `build_parser`)."""
    COMMANDS[name] = (help_text, setup, run)


def _setup_validate(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="ds_config file (JSON or YAML) with a \"xirang\" block")
    p.add_argument("--show-resolved", action="store_true",
                   help="print the block with its preset expanded and every default filled in")
    p.add_argument("--model", default=None,
                   help="resolve \"preset\": \"auto\" for this model (gpt-small | gpt:layers=..,hidden=.. | "
                        "module:factory; built on the meta device)")
    p.add_argument("--world-size", type=int, default=1, help="ranks, for --model (default 1)")
    _add_config_flags(p)


register_command("validate", "check a ds_config's \"xirang\" block", _setup_validate, _cmd_validate)


# the other subcommands: each _setup_* adds arguments, each _run_* returns the exit status; heavy imports
# (torch, deepspeed) happen inside the run functions
def _setup_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="gpt-small | gpt:layers=4,hidden=256,heads=8,seq=128,vocab=256 | "
                                                   "module:factory (with --seq and --vocab)")
    p.add_argument("--ds-config", required=True, help="ds_config with a \"xirang\" block")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per side (default 20)")
    p.add_argument("--world-size", type=int, default=1, choices=(1, 2), help="ranks (gloo on CPU)")
    p.add_argument("--data", default=None, help="text file (default: the standard library's docstrings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-config", default=None,
                   help="ds_config for the baseline (default: --ds-config without its block)")
    p.add_argument("--compile", default=None, choices=("blocks", "model"),
                   help="both sides torch.compile the model's blocks (each child of an nn.ModuleList, in place) or "
                        "the whole model before initialize")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")
    _add_config_flags(p)


def _run_bench(args: argparse.Namespace) -> int:
    from xirang_ds.config.loader import BLOCK_KEY
    from xirang_ds.planning.preset import resolve

    model = _model(args)  # fail fast on a bad spec
    ds_config, notes = _read_config(args.ds_config, args)
    if BLOCK_KEY not in ds_config:
        raise UsageError(f"{args.ds_config} has no \"xirang\" block: nothing to compare")
    # every clash with the ds_config before any rank starts ("preset": "auto" resolved for the model, as the
    # run's initialize will)
    resolve(ds_config, spec=model, world_size=args.world_size)
    if args.steps < 2:
        raise UsageError("--steps must be at least 2 (the first step is not timed)")
    if args.data and not os.path.isfile(args.data):
        raise UsageError(f"--data file not found: {args.data!r}")
    baseline = _read_config(args.baseline_config, args)[0] if args.baseline_config else None
    for note in notes:
        print(note)
    result = run_bench(model, ds_config, steps=args.steps, world_size=args.world_size, data_path=args.data,
                       seed=args.seed, baseline_config=baseline, compile_as=args.compile)
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
                                                   "module:factory (with --seq and --vocab)")
    p.add_argument("--ds-config", required=True, help="ds_config (JSON/YAML)")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="device the run will use (changes the optimizer's temporaries)")
    p.add_argument("--gpu", default=None, choices=("h100", "h200", "a100"),
                   help="the GPU the run will use: its device profile prices the activation plan and its memory "
                        "stands for memory_budget \"auto\" (implies --device cuda)")
    p.add_argument("--measure-cpu", action="store_true",
                   help="price the plan and the step time by this machine's CPU, measured by a one-second micro-benchmark "
                        "(its figures go into the JSON), instead of the CPU profile's stated constants")
    p.add_argument("--calibrate", action="store_true",
                   help="then run 3 real steps here, measure, and report the error per category")
    p.add_argument("--no-suggest", action="store_true",
                   help="where the block does not fit, skip confirming the least budget by estimating at it and the "
                        "search for a change that fits (preset, ZeRO stage, micro-batch, optimizer offload): one "
                        "estimate instead of up to seventeen")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")
    _add_config_flags(p)


def _run_estimate(args: argparse.Namespace) -> int:
    import torch

    from xirang_ds.memory.device_profile import measure_cpu_profile, profile_named
    from xirang_ds.planning.trace_cache import reuse_traces

    model = _model(args)
    ds_config, notes = _read_config(args.ds_config, args)
    if args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1; got {args.world_size}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    profile = profile_named(args.gpu) if args.gpu else None
    if profile is not None:
        if args.device == "cpu":
            raise UsageError(f"--gpu {args.gpu} is a CUDA device; drop --device cpu")
        device = "cuda"
    if args.measure_cpu:
        if device == "cuda":
            raise UsageError("--measure-cpu prices a CPU run; drop --gpu / --device cuda")
        profile = measure_cpu_profile()
    with reuse_traces() as reuse:  # the search's estimates that change only the budget trace once
        return _estimate_and_search(args, model, ds_config, notes, device, profile, reuse)


def _estimate_and_search(args: argparse.Namespace, model: Any, ds_config: dict, notes: list, device: str,
                         profile: Any, reuse: Any) -> int:
    import json

    from xirang_ds.planning.estimate_text import format_estimate, recalibrate
    from xirang_ds.planning.spec import estimate_spec

    # resolves "preset": "auto", checks the block
    est = estimate_spec(model, ds_config, args.world_size, device, device_profile=profile, plain=True)
    est.notes.extend(notes)
    host_only = bool(est.host_refusal) and est.device_fits is not False  # the host tiers alone: its note names the fix
    if est.fits is False and not args.no_suggest:
        from xirang_ds.planning.suggest import format_suggestion, least_fitting_budget, suggest_fit

        def again(c: dict) -> Any:
            return estimate_spec(model, c, args.world_size, device, device_profile=profile, timed=False)

        least, ran = (None, 0) if host_only else least_fitting_budget(ds_config, again, est.least_budget_bytes)
        if host_only:
            est.notes.append("least memory_budget: the device fits at this one; the host tiers do not (above)")
        elif least is None:
            est.notes.append(f"least memory_budget: not confirmed, no estimate at it or above fitted in {ran} tries "
                             "(bucket sizes and grad_release's tiers follow the budget)")
        elif least != est.least_budget_bytes:
            est.notes.append(f"least memory_budget: an estimate at {least:,} bytes fits ({ran} more estimates); the "
                             f"first figure, {est.least_budget_bytes:,}, was taken at the settings of the budget as "
                             "written (bucket sizes and grad_release's tiers follow the budget)")
            est.least_budget_bytes = least
    elif est.fits is False:
        est.notes.append("least memory_budget: the figure taken at the settings of the budget as written, not confirmed "
                         "(--no-suggest); bucket sizes and grad_release's tiers follow the budget")
    out = {**est.as_dict(), **({"device_profile": profile.as_dict()} if args.measure_cpu else {})}
    print(format_estimate(est))
    if est.fits is False and not args.no_suggest and not host_only:
        found = suggest_fit(ds_config, again)
        out["suggestion"] = found.as_dict()
        print(format_suggestion(found))
    if args.calibrate:
        side = run_side(model, ds_config, 3, args.world_size, None, 0, "xirang" in ds_config)
        cal = recalibrate(est, side.peak_by_category, side.peak_bytes)
        out["calibration"] = cal
        print(f"\nmeasured over 3 steps: {side.peak_bytes:,} bytes ({side.peak_phase}); "
              f"estimate error {cal['error']:+.2%}")
    out["fake_traces"] = {"traced": reuse.traces, "reused": reuse.reused}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _setup_tune(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="gpt-small | gpt:layers=4,hidden=256,heads=8,seq=128,vocab=256 | "
                                                   "module:factory (with --seq and --vocab)")
    p.add_argument("--ds-config", required=True, help="the ds_config to start from (its \"xirang\" block's autotune "
                                                      "section gives the defaults below)")
    p.add_argument("--budget", default=None, help="per-rank memory budget: 40GB, 512MiB, 5e8 "
                                                  "(default: xirang.memory_budget)")
    p.add_argument("--world-size", type=int, default=1, help="ranks: 1 or 2 measured here (gloo on CPU); any with --gpu")
    p.add_argument("--gpu", default=None, choices=("h100", "h200", "a100"),
                   help="search for a run on this GPU before launch: every candidate priced by the estimate with the "
                        "GPU's profile (peak with its activation plan, step time from counted kernels); nothing runs")
    p.add_argument("--objective", default=None, choices=("fastest", "largest_micro_batch"))
    p.add_argument("--measure-top", type=int, default=None, help="candidates measured for real")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole search")
    p.add_argument("--lossless", action="store_true", help="only options that leave the numbers unchanged")
    p.add_argument("--profile-steps", type=int, default=None, help="steps per profiling run (default 4)")
    p.add_argument("--measure-steps", type=int, default=None, help="steps per measured candidate (default 6)")
    p.add_argument("--data", default=None, help="text file (default: the standard library's docstrings)")
    p.add_argument("--out", default=None, help="where the winning ds_config goes (default: xirang.autotune.output)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the search report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_config_flags(p)


def _run_tune(args: argparse.Namespace) -> int:
    import json

    from xirang_ds.config.loader import BLOCK_KEY, validate_block
    from xirang_ds.tune import format_result, winning_ds_config, write_json

    model = _model(args)
    ds_config, notes = _read_config(args.ds_config, args)
    for note in notes:
        print(note)
    block = dict(ds_config.get(BLOCK_KEY, {}) or {})
    section = dict(block.pop("autotune", {}) or {})
    section.pop("enabled", None)
    settings = validate_block({"autotune": section}).autotune
    config = validate_block(block)
    if args.budget is not None:
        budget = parse_byte_size(str(args.budget))
        if budget is None or budget <= 0:
            raise UsageError(f"--budget: {args.budget!r} is not a size; write it like 40GB, 512MiB or 5e8")
    elif isinstance(config.memory_budget, int):
        budget = int(config.memory_budget)
    else:
        raise UsageError("no budget: pass --budget (for example --budget 40GB) or set xirang.memory_budget in "
                         f"{args.ds_config}")
    _check_tune_flags(args)
    try:
        result = _tune(args, model, ds_config, budget, settings)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(format_result(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if result.winner is None:
        return 1
    out = args.out or settings.output
    with open(out, "w", encoding="utf-8") as f:
        json.dump(winning_ds_config(ds_config, result), f, indent=2)
    w = result.winner
    peak = (f"predicted peak {format_bytes(w.predicted_peak)} on {result.device_profile}" if result.device_profile
            else f"measured peak {format_bytes(w.measured_peak)}")
    print(f"wrote {out} (winner {w.name}, {peak})")
    return 0


def _check_tune_flags(args: argparse.Namespace) -> None:
    """Every flag problem at once: flags of the measured search given with ``--gpu``, a world size this
    machine cannot run, a missing data file."""
    problems = []
    if args.gpu:
        given = [f for f, v in (("--measure-top", args.measure_top), ("--time-limit", args.time_limit),
                                ("--profile-steps", args.profile_steps), ("--measure-steps", args.measure_steps),
                                ("--data", args.data)) if v is not None]
        if given:
            problems.append(f"{', '.join(given)}: only the measured search runs steps; with --gpu {args.gpu} nothing "
                            "runs (drop them, or drop --gpu to measure here)")
        if args.world_size < 1:
            problems.append(f"--world-size must be >= 1; got {args.world_size}")
    elif args.world_size not in (1, 2):
        problems.append(f"--world-size {args.world_size}: the measured search runs 1 or 2 ranks here (gloo on CPU); "
                        "use --gpu NAME to search for more ranks before launch")
    if args.data and not os.path.isfile(args.data):
        problems.append(f"--data file not found: {args.data!r}")
    if problems:
        raise UsageError("; ".join(problems))


def _tune(args: argparse.Namespace, model: Any, ds_config: dict, budget: int, settings: Any) -> Any:
    import sys

    from xirang_ds.tune import Progress, tune

    progress = Progress(None if args.quiet else sys.stderr)
    objective = args.objective or settings.objective
    if args.gpu:
        from xirang_ds.memory.device_profile import profile_named
        from xirang_ds.tune.predicted import tune_predicted

        return tune_predicted(model, ds_config, budget, profile_named(args.gpu), args.world_size, objective,
                              args.lossless, progress=progress)
    return tune(model, ds_config, budget, world_size=args.world_size,
                objective=objective, measure_top=args.measure_top or settings.measure_top,
                time_limit_s=args.time_limit or settings.time_limit_s, lossless_only=args.lossless,
                profile_steps=args.profile_steps or 4, measure_steps=args.measure_steps or 6, data=args.data,
                progress=progress)


def _setup_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("show", "export"),
                   help="show: what wrote a checkpoint and what can load it; export: write plain DeepSpeed's ZeRO "
                        "files (and zero_to_fp32.py) beside xirang's, in place")
    p.add_argument("save_dir", help="the folder engine.save_checkpoint wrote (it holds 'latest')")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    p.add_argument("--stage", type=int, default=None, help="export: ZeRO stage to write for (default: the run's)")
    p.add_argument("--world-size", type=int, default=None,
                   help="export: data-parallel ranks to write for (default: the run's)")
    p.add_argument("--fused-adam", action="store_true", default=None,
                   help="export: the loading run steps DeepSpeed's FusedAdam (an Adam block without torch_adam on a "
                        "GPU): its steps are ints, and at stage 0 in bf16/fp16 DeepSpeed wraps it in FP16_Optimizer "
                        "(default: as recorded at save)")


def _run_checkpoint(args: argparse.Namespace) -> int:
    from xirang_ds.checkpoints.tags import describe, export_deepspeed_files, resolve_tag

    tag_dir = resolve_tag(args.save_dir, args.tag)
    if tag_dir is None:
        raise UsageError(f"{args.save_dir}: no checkpoint{f' tag {args.tag!r}' if args.tag else ''} (no 'latest' "
                         "file or no such folder)")
    if args.action == "export":
        written = export_deepspeed_files(args.save_dir, os.path.basename(tag_dir), stage=args.stage,
                                         world=args.world_size, fused=args.fused_adam)
        print(f"{tag_dir}: wrote {len(written)} file(s)" if written else
              f"{tag_dir}: its optimizer state is already in DeepSpeed's own files; nothing to write")
    for line in describe(tag_dir):
        print(line)
    return 0


register_command("checkpoint", "show what wrote a checkpoint and what can load it, or export DeepSpeed's own "
                 "files for it", _setup_checkpoint, _run_checkpoint)
register_command("estimate", "predict a rank's peak memory and its breakdown before running", _setup_estimate,
                 _run_estimate)
register_command("bench", "train plain DeepSpeed and DeepSpeed with the block side by side", _setup_bench,
                 _run_bench)
register_command("tune", "search the block's options for the fastest configuration under a memory budget",
                 _setup_tune, _run_tune)
register_command("report", "render a recorded memory timeline as HTML and PNG", _setup_report, _run_report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xirang-ds", description="xirang_ds: less device memory for "
                                     "DeepSpeed and Megatron-core training.")

    parser.add_argument("--version", action="version", version=f"xirang_ds {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, setup, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        setup(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (XirangConfigError, UsageError) as e:
        print(f"xirang-ds {args.command}: {e}", file=sys.stderr)
        return USAGE_ERROR
    except (FileNotFoundError, ValueError) as e:  # ModelSpecError, TraceError, a bad data file
        print(f"xirang-ds {args.command}: {e}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
