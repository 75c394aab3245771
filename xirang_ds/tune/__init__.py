"""``xirang-ds tune``: the fastest block (or the largest micro-batch) that fits a memory budget.

The search space is `xirang_ds.tune.space`, the cost model `xirang_ds.tune.cost`. The search has three
stages, each cheaper in count than the one before:

1. **Predict memory for every candidate** of the joint space (ZeRO stage × optimizer-state format ×
   grad_release × every other built plugin's options × micro-batch) with the estimator: a fake
   trace of the model, no real step, well under a second each. Candidates the plugins reject
   (an invalid combination) are dropped with their reason.
2. **Profile** a few real steps of the base configuration at each ZeRO stage and of each option
   alone on the base. They calibrate the estimate as a session calibrates its own prediction
   (`xirang_ds.memory.calibration`: measured over estimated per phase, per stage),
   price each option's step time as a ratio to the base, and give the memory ratio of an option
   whose plugin does not model itself in the estimator. The cost model of a candidate is then
   ``peak = max over phases of estimate × that phase's factor`` (× those memory ratios) and
   ``time = base time × Π option time ratios``, the base time a line in the micro-batch through two
   profiled points. With
   ``largest_micro_batch`` each combination's micro-batch then doubles while this model fits.
3. **Measure** the ``measure_top`` best predicted candidates that fit for real; the winner is the
   fastest measured one (per sample, for ``largest_micro_batch`` the largest micro-batch first)
   whose measured peak fits. Its block is written into a copy of the user's ds_config.

Every trial runs in fresh processes (`xirang_ds.bench.run_side`), so a trial that fails (out of
memory, a plugin's error) costs that trial only; the report keeps its error. The report also gives
the cost model's error against each measured candidate.
"""
from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from xirang_ds.bench import run_side
from xirang_ds.config.loader import BLOCK_KEY, deep_merge
from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.memory.calibration import calibrated_peak
from xirang_ds.models import describe_model
from xirang_ds.planning.estimator import EstimateError
from xirang_ds.planning.spec import estimate_spec
from xirang_ds.planning.trace_cache import reuse_traces
from xirang_ds.tune.cost import (
    grow_micro_batch,
    micro_batch_of,
    micro_batch_scale,
    planned_peak,
    planner_line,
    rank_key,
    stage_calibration,
)
from xirang_ds.tune.space import SEARCHED, Candidate, Option, base_config, candidates, search_space


class Progress:
    """One console line: ``[#####.....] 12/48 stage: what``; silent when ``stream`` is None."""

    def __init__(self, stream: Any = sys.stderr, width: int = 24) -> None:
        self.stream, self.width = stream, width
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.quiet_stage = "estimate"

    def update(self, done: int, total: int, stage: str, what: str = "") -> None:
        if self.stream is None:
            return
        filled = int(self.width * done / max(total, 1))
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {stage}" + (f": {what}" if what else "")
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if done >= total:
                self.stream.write("\n")
        elif done >= total or self.quiet_stage != stage:
            self.stream.write(line + "\n")  # a log: every slow item, the fast stage once at its end
        self.stream.flush()


# ------------------------------------------------------------------------------------------------
# the search


@dataclass
class TuneResult:
    budget: int
    objective: str
    world_size: int
    model: str
    candidates: list[Candidate]
    profiles: dict[str, dict]
    calibration: dict[str, float]
    winner: Optional[Candidate]
    seconds: dict[str, float]
    notes: list[str]
    device_profile: Optional[str] = None
    """The GPU the search priced for, before launch (`xirang_ds.tune.predicted`); ``None``: measured here."""
    ranked: list[Candidate] = field(default_factory=list)
    """Before launch: the candidates predicted to fit, best first."""

    def as_dict(self) -> dict:
        measured = [c for c in self.candidates if c.measured_peak is not None]
        return {
            "model": describe_model(self.model), "budget_bytes": self.budget, "objective": self.objective,
            "world_size": self.world_size, "device_profile": self.device_profile, "seconds": self.seconds,
            "notes": self.notes,
            "calibration": self.calibration, "profiles": self.profiles,
            "winner": self.winner.as_dict() if self.winner else None,
            "model_error": [{"name": c.name, "micro_batch": c.micro_batch,
                             "peak_error": c.predicted_peak / c.measured_peak - 1,
                             "time_error": (c.predicted_time_s / c.measured_time_s - 1) if c.measured_time_s else None}
                            for c in measured if c.predicted_peak and c.measured_peak],
            "candidates": [c.as_dict() for c in self.candidates],
        }


Runner = Callable[[dict, int], Any]  # (ds_config, steps) -> SideResult


def _default_runner(model: str, world_size: int, data: Optional[str], seed: int) -> Runner:
    def run(cfg: dict, steps: int) -> Any:
        return run_side(model, cfg, steps, world_size, data, seed, True)

    return run


def _estimate(model: str, cfg: dict, world_size: int, device: str) -> tuple[int, list[str], dict[str, int]]:
    """The estimator's peak, the sections it does not model, and each phase's total."""
    est = estimate_spec(model, cfg, world_size, device)
    unmodelled = [n.split(":")[0] for n in est.notes if "not modelled" in n]
    return est.predicted_peak_bytes, unmodelled, {p: v["total"] for p, v in est.phases.items()}


def _stage(c: Candidate) -> int:
    return int((c.ds_config.get("zero_optimization") or {}).get("stage", 0))


@dataclass
class _Search:
    """One `tune` call: its inputs, and what its phases hand each other."""

    model: str
    budget: int
    world_size: int
    objective: str
    device: str
    time_limit_s: float
    runner: Runner
    progress: Progress
    user: dict
    """The user's ds_config with ``memory_budget`` set in its block."""
    user_stage: int
    user_mb: int
    grow: bool
    """``largest_micro_batch`` without fixed micro-batches: each combination's micro-batch doubles while it fits."""
    start: float = field(default_factory=time.perf_counter)
    far_mb: int = 0
    """The base's largest micro-batch (the step-time line's second point; the user's when not growing)."""
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    unmodelled_of: dict[int, list[str]] = field(default_factory=dict)
    """By candidate ``id``: sections the estimator does not model for it."""
    phases_of: dict[int, dict[str, int]] = field(default_factory=dict)
    """By candidate ``id``: the estimator's phases."""

    def estimate(self, cfg: dict) -> tuple[int, list[str], dict[str, int]]:
        return _estimate(self.model, cfg, self.world_size, self.device)

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.start > self.time_limit_s


def tune(model: str, ds_config: dict, budget: int, world_size: int = 1, objective: str = "fastest",
         measure_top: int = 3, profile_steps: int = 4, measure_steps: int = 6, time_limit_s: float = 600.0,
         lossless_only: bool = False, micro_batches: Optional[list[int]] = None, data: Optional[str] = None,
         seed: int = 0, device: str = "cpu", progress: Optional[Progress] = None,
         runner: Optional[Runner] = None) -> TuneResult:
    """Search the joint space under ``budget`` bytes per rank (see the module docstring): predict, profile,
    rank, measure."""
    user = copy.deepcopy(ds_config)
    user.setdefault(BLOCK_KEY, {})
    user[BLOCK_KEY] = dict(user[BLOCK_KEY], memory_budget=int(budget))
    user_mb = int(ds_config.get("train_micro_batch_size_per_gpu", 1) or 1)
    search = _Search(model, budget, world_size, objective, device, time_limit_s,
                     runner or _default_runner(model, world_size, data, seed), progress or Progress(None), user,
                     int((ds_config.get("zero_optimization") or {}).get("stage", 0)), user_mb,
                     grow=objective == "largest_micro_batch" and not micro_batches, far_mb=user_mb)
    pool = candidates(user, search_space(ds_config, world_size, lossless_only, micro_batches))
    with reuse_traces():  # candidates that trace the same thing (another budget, another state dtype) share one
        live = _predict(search, pool)
    profiles = _profile(search, live, profile_steps)
    fitting, calibration = _rank(search, pool, live, profiles)
    winner = _measure(search, fitting, measure_top, measure_steps)
    return TuneResult(budget, objective, world_size, model, pool, profiles, calibration, winner, search.seconds,
                      search.notes)


def _predict(search: _Search, pool: list[Candidate]) -> list[Candidate]:
    """1. The estimate of every candidate (a rejected one keeps its reason); the live candidates. Growing, the
    base's largest micro-batch too.

    Raises:
        ValueError: no candidate is valid.
    """
    progress = search.progress
    for i, c in enumerate(pool):
        progress.update(i, len(pool), "estimate", c.name)
        try:
            c.predicted_peak, search.unmodelled_of[id(c)], search.phases_of[id(c)] = search.estimate(c.ds_config)
        except (XirangConfigError, EstimateError, ValueError) as e:
            c.rejected = " ".join(str(e).split())[:300]
    progress.update(len(pool), len(pool), "estimate")
    live = [c for c in pool if c.rejected is None]
    if search.grow:  # the base's largest micro-batch: the second point of the step-time line
        for c in live:
            if not any(o.block for o in c.options) and _stage(c) == search.user_stage:
                plain = Candidate(c.options, copy.deepcopy(c.ds_config), c.micro_batch, c.predicted_peak)
                grow_micro_batch(plain, lambda cfg: search.estimate(cfg)[0], search.budget)
                search.far_mb = plain.micro_batch
    search.seconds["estimate"] = time.perf_counter() - search.start
    if not live:
        raise ValueError("no candidate is valid for this ds_config: " + pool[0].rejected if pool else "empty space")
    return live


def _profile(search: _Search, live: list[Candidate], profile_steps: int) -> dict[str, dict]:
    """2. A few real steps of the base at each stage and of each option alone (at the user's stage and
    micro-batch); growing, a second point at the base's largest micro-batch. Profiles by label."""
    t0 = time.perf_counter()
    profiles: dict[str, dict] = {}
    jobs: list[tuple[str, dict]] = []
    stages = sorted({_stage(c) for c in live})
    base = base_config(search.user, search.budget)
    user_stage, user_mb, far_mb, grow = search.user_stage, search.user_mb, search.far_mb, search.grow
    for s in stages:
        jobs.append((f"zero{s}", deep_merge(base, {"zero_optimization": {"stage": s}})))
    # step time is a + b * micro-batch: a second point at the largest micro-batch the base fits
    if grow and far_mb != user_mb:
        jobs.append((f"zero{user_stage}@mb{far_mb}", deep_merge(base, {"zero_optimization": {"stage": user_stage},
                                                                   "train_micro_batch_size_per_gpu": far_mb})))
    singles = sorted({o.label: o for c in live for o in c.options if o.block}.values(), key=lambda o: o.label)
    for o in singles:
        cfg = deep_merge(base, {"zero_optimization": {"stage": user_stage}})
        cfg[BLOCK_KEY] = deep_merge(cfg[BLOCK_KEY], o.block)
        jobs.append((o.label, cfg))
        if grow and far_mb != user_mb and "activations" in o.block:
            # the planner's needs besides activations grow with the micro-batch: a second point
            jobs.append((f"{o.label}@mb{far_mb}", deep_merge(cfg, {"train_micro_batch_size_per_gpu": far_mb})))
    for i, (label, cfg) in enumerate(jobs):
        search.progress.update(i, len(jobs), "profile", label)
        if search.out_of_time():
            search.notes.append(f"time limit reached while profiling; {label} and later not profiled")
            break
        try:
            side = search.runner(cfg, profile_steps)
            est, _, phases = search.estimate(cfg)
            profiles[label] = {"peak_bytes": side.peak_bytes, "step_time_s": side.step_time_median_s,
                               "final_loss": side.final_loss, "predicted_peak_bytes": est,
                               "predicted_phases": phases, "phase_peaks": dict(getattr(side, "phase_peaks", {}) or {})}
            reach = (getattr(side, "plugin_figures", None) or {}).get("activations")
            if reach:
                profiles[label]["activation_figures"] = reach
        except Exception as e:  # a failing option costs only itself
            profiles[label] = {"error": " ".join(str(e).split())[-300:]}
    search.progress.update(len(jobs), len(jobs), "profile")
    search.seconds["profile"] = time.perf_counter() - t0
    return profiles


def _rank(search: _Search, pool: list[Candidate], live: list[Candidate], profiles: dict[str, dict]
          ) -> tuple[list[Candidate], dict[str, float]]:
    """The cost model of every live candidate (calibrated peak, step time; growing, its largest micro-batch)
    and those predicted to fit, best first; with the calibration each stage's factors make of its base."""
    model, world_size, device, budget = search.model, search.world_size, search.device, search.budget
    user_stage, user_mb, far_mb, grow = search.user_stage, search.user_mb, search.far_mb, search.grow
    stages = sorted({_stage(c) for c in live})
    factors = {f"zero{s}": stage_calibration(profiles[f"zero{s}"])
               for s in stages if "peak_bytes" in profiles.get(f"zero{s}", {})}
    calibration = {k: calibrated_peak(profiles[k]["predicted_phases"], f) / profiles[k]["predicted_peak_bytes"]
                   for k, f in factors.items()}  # what the factors make of the base's own estimate
    ref = profiles.get(f"zero{user_stage}", {})
    for c in live:
        stage_key = f"zero{_stage(c)}"
        if "step_time_s" not in profiles.get(stage_key, {}) or "step_time_s" not in ref:
            c.rejected = f"the base at {stage_key} failed to run: {profiles.get(stage_key, {}).get('error', '')}"
            continue
        time_ratio, peak_ratio = 1.0, 1.0
        calibrated = calibrated_peak(search.phases_of[id(c)], factors[stage_key])
        planner = None
        for o in c.options:
            if not o.block:
                continue
            prof = profiles.get(o.label, {})
            if "step_time_s" not in prof:
                c.rejected = f"{o.label} failed alone: {prof.get('error', 'not profiled')}"
                break
            time_ratio *= prof["step_time_s"] / ref["step_time_s"]
            if "activation_figures" in prof and grow:
                planner = o.label  # the planner is modelled below from its figures, not by a ratio
            elif next(iter(o.block)) in search.unmodelled_of.get(id(c), []):
                peak_ratio *= prof["peak_bytes"] / ref["peak_bytes"]
        if c.rejected is not None:
            continue
        raw_peak, c.predicted_peak = c.predicted_peak, int(calibrated * peak_ratio)
        added_s = 0.0
        if grow:  # each combination at the largest power-of-two multiple of the micro-batch predicted to fit
            line = planner_line(profiles, planner, user_mb, far_mb) if planner is not None else None
            if line is not None:
                # the other options' effect on what the rank needs besides activations: the estimate of
                # this combination over the planner's own run, times the profiled ratios of options
                # the estimator does not model, applied to the planner's measured figure
                rest = raw_peak * peak_ratio / profiles[planner]["predicted_peak_bytes"]

                def planned(cfg, line=line, rest=rest):
                    other, keep, least = line(micro_batch_of(cfg))
                    return planned_peak(other * rest, keep, least, budget)

                c.predicted_peak = planned(c.ds_config)[0]
                grow_micro_batch(c, lambda cfg: planned(cfg)[0], budget)
                passes = int(c.ds_config.get("gradient_accumulation_steps", 1) or 1)
                least_s = profiles[planner]["activation_figures"]["least_added_s"] or 0.0
                added_s = planned(c.ds_config)[1] * least_s * (c.micro_batch / user_mb) * passes
            else:
                def at(cfg, r=peak_ratio, f=factors[stage_key]):
                    return int(calibrated_peak(_estimate(model, cfg, world_size, device)[2], f) * r)

                grow_micro_batch(c, at, budget)
        c.predicted_time_s = (profiles[stage_key]["step_time_s"] * time_ratio
                              * micro_batch_scale(profiles, user_stage, user_mb, far_mb, c.micro_batch)) + added_s
    fitting = [c for c in live if c.rejected is None and c.predicted_peak <= budget]

    fitting.sort(key=lambda c: rank_key(search.objective, c.predicted_time_s, c.micro_batch))
    search.notes.append(f"{len(pool)} candidates, {len(pool) - len(live)} rejected by the plugins, "
                        f"{len(fitting)} predicted to fit {format_bytes(budget)}")
    return fitting, calibration


def _measure(search: _Search, fitting: list[Candidate], measure_top: int, measure_steps: int
             ) -> Optional[Candidate]:
    """3. The ``measure_top`` best predicted candidates run for real (the next few once when none of them fits);
    the winner: the fastest measured one that fits, or ``None``."""
    t0 = time.perf_counter()
    chosen = fitting[:measure_top]
    i = 0
    while i < len(chosen):
        c = chosen[i]
        search.progress.update(i, len(chosen), "measure", c.name)
        if search.out_of_time():
            search.notes.append(f"time limit reached; {c.name} and later not measured")
            break
        try:
            side = search.runner(c.ds_config, measure_steps)
            c.measured_peak, c.measured_time_s, c.measured_loss = (side.peak_bytes, side.step_time_median_s,
                                                                   side.final_loss)
        except Exception as e:
            c.error = " ".join(str(e).split())[-300:]
        i += 1
        if i == len(chosen) == measure_top and not any(
                m.measured_peak is not None and m.measured_peak <= search.budget for m in chosen):
            chosen = fitting[:2 * measure_top]  # none of the best fits for real: measure the next few once
            if len(chosen) > i:
                search.notes.append(f"none of the {measure_top} best predicted candidates fit when measured; "
                                    f"measured the next {len(chosen) - i}")
    search.progress.update(len(chosen), len(chosen), "measure")
    search.seconds["measure"] = time.perf_counter() - t0
    search.seconds["total"] = time.perf_counter() - search.start
    ok = [c for c in chosen if c.measured_peak is not None and c.measured_peak <= search.budget]

    return min(ok, key=lambda c: rank_key(search.objective, c.measured_time_s, c.micro_batch)) if ok else None


def winning_ds_config(user_ds_config: dict, result: TuneResult) -> dict:
    """The user's ds_config with the winner's ZeRO stage, micro-batch and block."""
    out = copy.deepcopy(result.winner.ds_config)
    out.pop("train_batch_size", None)  # the micro-batch may have changed; DeepSpeed derives the total
    user_block = user_ds_config.get(BLOCK_KEY, {}) or {}
    for name in ("monitor", "profiler"):
        if name in user_block:
            out[BLOCK_KEY][name] = copy.deepcopy(user_block[name])
    return out


def format_result(result: TuneResult) -> str:
    """The console table: measured candidates with the model's predictions, then the winner (before launch,
    `format_predicted`)."""
    if result.device_profile is not None:
        return format_predicted(result)
    lines = [f"tune: {result.model}, {result.world_size} rank(s), budget {format_bytes(result.budget)}, "
             f"objective {result.objective}; {result.seconds.get('total', 0):.0f} s "
             f"(estimate {result.seconds.get('estimate', 0):.0f} s, profile {result.seconds.get('profile', 0):.0f} s, "
             f"measure {result.seconds.get('measure', 0):.0f} s)"]
    lines += ["  " + n for n in result.notes]
    header = f"{'candidate':<44}{'mb':>4}{'pred. peak':>13}{'peak':>13}{'err':>7}{'pred. ms':>10}{'ms':>8}{'err':>7}"
    lines += [header, "-" * len(header)]
    for c in result.candidates:
        if c.measured_peak is None and c.error is None:
            continue
        if c.error:
            lines.append(f"{c.name:<44}{c.micro_batch:>4}  failed: {c.error[:80]}")
            continue
        lines.append(f"{c.name:<44}{c.micro_batch:>4}{format_bytes(c.predicted_peak):>13}"
                     f"{format_bytes(c.measured_peak):>13}{c.predicted_peak / c.measured_peak - 1:>+7.1%}"
                     f"{c.predicted_time_s * 1000:>10.0f}{c.measured_time_s * 1000:>8.0f}"
                     f"{c.predicted_time_s / c.measured_time_s - 1:>+7.1%}")
    if result.winner:
        w = result.winner
        lines.append(f"winner: {w.name}, micro-batch {w.micro_batch}: {format_bytes(w.measured_peak)} "
                     f"({w.measured_peak / result.budget:.0%} of the budget), {w.measured_time_s * 1000:.0f} ms/step")
    else:
        lines.append("no measured candidate fits the budget; raise it, or allow lossy options")
    return "\n".join(lines)


def format_predicted(result: TuneResult, shown: int = 10) -> str:
    """The ``shown`` best candidates predicted to fit on the GPU, best first, then the winner."""
    lines = [f"tune (predicted for {result.device_profile}, nothing run): {describe_model(result.model)}, {result.world_size} rank(s), "
             f"budget {format_bytes(result.budget)}, objective {result.objective}; "
             f"{result.seconds.get('total', 0):.0f} s"]
    lines += ["  " + n for n in result.notes]
    header = f"{'candidate':<44}{'mb':>4}{'pred. peak':>13}{'pred. ms':>10}"
    lines += [header, "-" * len(header)]
    for c in result.ranked[:shown]:
        lines.append(f"{c.name:<44}{c.micro_batch:>4}{format_bytes(c.predicted_peak):>13}"
                     f"{c.predicted_time_s * 1000:>10.1f}")
    if result.winner:
        w = result.winner
        lines.append(f"winner (predicted): {w.name}, micro-batch {w.micro_batch}: {format_bytes(w.predicted_peak)} "
                     f"({w.predicted_peak / result.budget:.0%} of the budget), {w.predicted_time_s * 1000:.1f} ms/step "
                     f"on {result.device_profile}")
    else:
        lines.append("no candidate is predicted to fit the budget; raise it, or allow lossy options")
    return "\n".join(lines)


def write_json(result: TuneResult, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.as_dict(), f, indent=2)


# `micro_batch_scale`, `planned_peak`, `planner_line` and `SEARCHED` stay importable from here (the tests read them)
__all__ = ["SEARCHED", "Candidate", "Option", "Progress", "TuneResult", "micro_batch_scale", "format_predicted",
           "format_result", "planned_peak",
           "planner_line", "search_space", "tune", "winning_ds_config", "write_json"]
