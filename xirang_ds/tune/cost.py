"""The tuner's cost model (`xirang_ds.tune`): a profiled base's calibration of the estimate, step time as a
line in the micro-batch, the activation planner's peak as a line through its profiled figures, and a
candidate's micro-batch grown while the model fits."""
from __future__ import annotations

import math
from typing import Callable, Optional

from xirang_ds.config.loader import deep_merge
from xirang_ds.memory.calibration import PHASES, phase_factors
from xirang_ds.tune.space import Candidate


def stage_calibration(profile: dict) -> dict[str, float]:
    """A profiled base's calibration, as a session calibrates its own prediction
    (`xirang_ds.memory.calibration.phase_factors`): per phase, measured over estimated, where the
    run measured its phases; else one factor for the total."""
    measured = {p: b for p, b in (profile.get("phase_peaks") or {}).items() if p in PHASES}
    if not measured:
        measured = {"peak": profile["peak_bytes"]}
    return phase_factors(measured, profile["predicted_phases"])


def grow_micro_batch(c: Candidate, peak_at: Callable[[dict], int], budget: int, max_doublings: int = 12) -> None:
    """Double the candidate's micro-batch while ``peak_at(ds_config)`` fits (halve it while it does not)."""
    def at(mb: int) -> tuple[dict, int]:
        cfg = deep_merge(c.ds_config, {"train_micro_batch_size_per_gpu": mb})
        return cfg, peak_at(cfg)

    mb, peak = c.micro_batch, c.predicted_peak
    while peak > budget and mb > 1:
        mb = mb // 2
        c.ds_config, peak = at(mb)
    for _ in range(max_doublings):
        if peak > budget:
            break
        cfg, bigger = at(mb * 2)
        if bigger > budget:
            break
        mb, peak, c.ds_config = mb * 2, bigger, cfg
    c.micro_batch, c.predicted_peak = mb, peak


def micro_batch_scale(profiles: dict, stage: int, mb0: int, mb1: int, mb: int) -> float:
    """Step time at ``mb`` over step time at ``mb0``: the line through the two profiled points when
    there are two, else proportional to the micro-batch."""
    t0 = profiles.get(f"zero{stage}", {}).get("step_time_s")
    t1 = profiles.get(f"zero{stage}@mb{mb1}", {}).get("step_time_s")
    if mb == mb0:
        return 1.0
    if t0 and t1 and mb1 != mb0:
        slope = (t1 - t0) / (mb1 - mb0)
        return max(t0 + slope * (mb - mb0), 1e-9) / t0
    return mb / mb0


def micro_batch_of(cfg: dict) -> int:
    return int(cfg.get("train_micro_batch_size_per_gpu", 1) or 1)


def planned_peak(other: float, keep: float, least: float, budget: int) -> tuple[int, float]:
    """The step peak with the activation planner under ``budget``, and how far its plan goes.

    The planner (``budget: auto``) keeps saved activations under ``budget`` minus what the rank
    needs besides them (``other``), down to the least any plan needs; ``keep``: saved bytes with
    every module kept. Returns ``(peak, fraction)``: ``fraction`` 0 keeps everything, 1 is the
    least plan; a budget the least plan does not fit shows as a peak above it.
    """
    activations = max(least, min(keep, budget - other))
    fraction = 0.0 if keep <= least else (keep - activations) / (keep - least)
    return int(other + activations), fraction


def planner_line(profiles: dict, label: str, mb0: int, mb1: int
                 ) -> Optional[Callable[[int], tuple[float, float, float]]]:
    """``mb -> (other, keep, least)`` from the planner's figures at one or two profiled micro-batches:
    the line through both points, or proportional to the micro-batch from one (``other`` then
    stays as measured: it is mostly model states)."""
    f0 = profiles.get(label, {}).get("activation_figures")
    if not f0 or f0.get("other_peak_bytes") is None:
        return None
    f1 = profiles.get(f"{label}@mb{mb1}", {}).get("activation_figures")
    keys = ("other_peak_bytes", "keep_bytes", "least_bytes")
    if f1 and f1.get("other_peak_bytes") is not None and mb1 != mb0:
        def at(mb: int) -> tuple[float, float, float]:
            return tuple(f0[k] + (f1[k] - f0[k]) * (mb - mb0) / (mb1 - mb0) for k in keys)  # type: ignore
    else:
        def at(mb: int) -> tuple[float, float, float]:
            return f0["other_peak_bytes"], f0["keep_bytes"] * mb / mb0, f0["least_bytes"] * mb / mb0
    return at


def rank_key(objective: str, seconds: Optional[float], micro_batch: int) -> tuple:
    """How candidates sort, best first, by a step time (predicted or measured): the fastest, or with
    ``largest_micro_batch`` the largest micro-batch, then the fastest per sample."""
    per_sample = (seconds or math.inf) / micro_batch
    return (-micro_batch, per_sample) if objective == "largest_micro_batch" else (seconds, 0)
