"""A configuration that fits, where the block as written does not: ``xirang-ds estimate`` says what to change.

Three kinds of change, each estimated by the same estimator as the block itself (so a suggestion fits by
the same figures that refused the block), in the order a user gives up least:

* ``preset``: the next preset of `PRESET_ORDER` (where the block names one; ``aggressive`` stores some
  activations lossily and keeps int4 optimizer states, and the change says so);
* ``zero_stage``: the next ZeRO stage (more of the model states partitioned over the ranks, more
  communication);
* ``micro_batch``: the micro-batch halved and ``gradient_accumulation_steps`` doubled, so the global batch
  and the update stay the same (an even micro-batch only);
* ``offload_optimizer``: at ZeRO 1-3, DeepSpeed's optimizer in host memory (``{"device": "cpu"}``: the fp32
  weights, their gradients and the states there, the update on the CPU), the costliest in time (the step
  prices it: `xirang_ds.planning.step_time`); grad_release and optimizer_states cannot run beside it, so a
  preset leaves them out;
* ``offload_param``: at ZeRO 3, the 16-bit partitions in host memory (``{"device": "cpu"}``), each copied to the
  device as its weights are gathered (the predicted step prices those copies over the host link; on one rank the
  estimate does not model it and keeps the partitions on the device, so there it saves nothing and never fits).

The search is greedy and bounded: each round estimates every single change on top of the changes taken so
far; the first that fits (in the order above) is the suggestion, otherwise the change that lowered the least
budget most is kept and the next round starts, for at most `MAX_ROUNDS` rounds. NVMe is not suggested: the
estimate does not model it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from xirang_ds.config.loader import BLOCK_KEY
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.memory.run_shape import EstimateError

PRESET_ORDER = ("conservative", "balanced", "aggressive")
"""Presets from the one that changes least to the one that saves most."""
MAX_ROUNDS = 3
"""Rounds of the greedy search: at most three changes, at most fifteen estimates."""
BUDGET_ROUNDS = 4
"""Estimates `least_fitting_budget` runs at most."""


@dataclass
class Suggestion:
    """What to change so that the block fits.

    Attributes:
        changes: each change in words, in the order taken.
        ds_config: the ds_config with them.
        predicted_peak_bytes: its estimate's peak.
        least_budget_bytes: its estimate's least budget.
        estimates: how many estimates the search ran.
        found: whether some configuration fits (else ``changes`` is what came closest).
    """

    changes: list[str] = field(default_factory=list)
    ds_config: dict = field(default_factory=dict)
    predicted_peak_bytes: int = 0
    least_budget_bytes: int = 0
    estimates: int = 0
    found: bool = False

    def as_dict(self) -> dict:
        return {"found": self.found, "changes": list(self.changes), "predicted_peak_bytes": self.predicted_peak_bytes,
                "least_budget_bytes": self.least_budget_bytes, "estimates": self.estimates,
                "ds_config": self.ds_config}


def _next_preset(ds_config: dict) -> Optional[tuple[dict, str]]:
    block = ds_config.get(BLOCK_KEY) or {}
    preset = block.get("preset")
    if preset not in PRESET_ORDER or preset == PRESET_ORDER[-1]:
        return None
    after = PRESET_ORDER[PRESET_ORDER.index(preset) + 1]
    lossy = " (lossy: 8-bit and sparse storage of tolerant activations, int4 states)" if after == "aggressive" else ""
    return {**ds_config, BLOCK_KEY: {**block, "preset": after}}, f'xirang.preset "{preset}" -> "{after}"{lossy}'


def _next_stage(ds_config: dict) -> Optional[tuple[dict, str]]:
    zero = dict(ds_config.get("zero_optimization") or {})
    stage = int(zero.get("stage", 0))
    if stage >= 3:
        return None
    zero["stage"] = stage + 1
    return {**ds_config, "zero_optimization": zero}, f"zero_optimization.stage {stage} -> {stage + 1}"


def _half_micro_batch(ds_config: dict) -> Optional[tuple[dict, str]]:
    micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    accum = int(ds_config.get("gradient_accumulation_steps", 1))
    if micro < 2 or micro % 2:
        return None
    out = {**ds_config, "train_micro_batch_size_per_gpu": micro // 2, "gradient_accumulation_steps": accum * 2}
    return out, (f"train_micro_batch_size_per_gpu {micro} -> {micro // 2} with gradient_accumulation_steps "
                 f"{accum} -> {accum * 2} (the same global batch)")


def _offload_optimizer(ds_config: dict) -> Optional[tuple[dict, str]]:
    zero = dict(ds_config.get("zero_optimization") or {})
    stage = int(zero.get("stage", 0))
    device = str((zero.get("offload_optimizer") or {}).get("device", "none"))
    if stage == 0 or device != "none":
        return None
    zero["offload_optimizer"] = {**(zero.get("offload_optimizer") or {}), "device": "cpu"}
    return {**ds_config, "zero_optimization": zero}, ('zero_optimization.offload_optimizer {"device": "cpu"} (the fp32 '
                                                      "weights, gradients and optimizer states in host memory, the "
                                                      "update on the CPU: slower steps)")


def _offload_param(ds_config: dict) -> Optional[tuple[dict, str]]:
    zero = dict(ds_config.get("zero_optimization") or {})
    device = str((zero.get("offload_param") or {}).get("device", "none"))
    if int(zero.get("stage", 0)) != 3 or device != "none":
        return None
    zero["offload_param"] = {**(zero.get("offload_param") or {}), "device": "cpu"}
    return {**ds_config, "zero_optimization": zero}, ('zero_optimization.offload_param {"device": "cpu"} (the 16-bit '
                                                      "weights' partitions in host memory, each copied to the device "
                                                      "as it is gathered: slower steps)")


CHANGES: tuple[Callable[[dict], Optional[tuple[dict, str]]], ...] = (_next_preset, _next_stage, _half_micro_batch,
                                                                     _offload_optimizer, _offload_param)
"""The changes, in the order a user gives up least (module docstring)."""


def suggest_fit(ds_config: dict, estimate: Callable[[dict], Any], max_rounds: int = MAX_ROUNDS) -> Suggestion:
    """The least change to ``ds_config`` whose ``estimate(ds_config)`` fits (module docstring).

    Args:
        estimate: the estimator for one ds_config (returns an `Estimate` with ``fits`` and
            ``least_budget_bytes``); a candidate it rejects (a plugin's error for that combination) is skipped.
    """
    current, taken, ran = copy.deepcopy(ds_config), [], 0
    best: Optional[tuple[Any, dict, str]] = None
    for _ in range(max_rounds):
        best = None
        for change in CHANGES:
            step = change(current)
            if step is None:
                continue
            candidate, words = step
            try:
                est = estimate(candidate)
            except (XirangConfigError, EstimateError):
                continue
            finally:
                ran += 1
            if est.fits:
                return Suggestion(taken + [words], candidate, est.predicted_peak_bytes, est.least_budget_bytes,
                                  ran, True)
            if best is None or est.least_budget_bytes < best[0].least_budget_bytes:
                best = (est, candidate, words)
        if best is None:
            break
        current, taken = best[1], taken + [best[2]]
    if best is None:
        return Suggestion(taken, current, 0, 0, ran, False)
    return Suggestion(taken, current, best[0].predicted_peak_bytes, best[0].least_budget_bytes, ran, False)


def with_budget(ds_config: dict, budget: int) -> dict:
    return {**ds_config, BLOCK_KEY: {**ds_config[BLOCK_KEY], "memory_budget": int(budget)}}


def least_fitting_budget(ds_config: dict, estimate: Callable[[dict], Any], least: int,
                         rounds: int = BUDGET_ROUNDS) -> tuple[Optional[int], int]:
    """The least ``memory_budget`` an estimate says fits, from an estimate's ``least`` (``(None, estimates)``
    where none of the rounds fit).

    An estimate's least budget is taken at the settings its own budget gives (comm_buffers' buckets, grad_release's
    exact method and states tier follow ``memory_budget``), so below the budget as written it can name more
    or less than a run at that figure needs. Each round estimates at the last figure: one that fits names its own
    least next (searching down, until it fits at its own); one that does not names a higher least, and the next
    figure is that plus the rise (the settings grow with the budget), so a fit is reached in few estimates, at
    most one rise above the least."""
    best, ran, seen = None, 0, set()
    for _ in range(rounds):
        if least in seen or best is not None and least >= best:
            break
        seen.add(least)
        est = estimate(with_budget(ds_config, least))
        ran += 1
        if est.fits:
            best = least if best is None else min(best, least)
            if est.least_budget_bytes >= least:
                break
            least = est.least_budget_bytes
        elif est.least_budget_bytes <= least:
            break  # no progress: the estimate refuses its own least budget
        else:  # what the budget's settings add grows with it: step past the creep once more
            least = 2 * est.least_budget_bytes - least
    return best, ran


def format_suggestion(s: Suggestion) -> str:
    from xirang_ds.config.types import format_bytes

    if not s.changes:
        return ("no change the estimate can price makes it fit (preset, ZeRO stage, micro-batch, optimizer and "
                "parameter offload)")
    if s.found:
        head = f"fits with these changes (predicted peak {format_bytes(s.predicted_peak_bytes)}; {s.estimates} estimate(s)):"
    else:
        head = (f"no change found that fits ({s.estimates} estimate(s)); the closest, whose least memory_budget is "
                f"{format_bytes(s.least_budget_bytes)} ({s.least_budget_bytes:,} bytes):")
    return "\n".join([head] + [f"  {c}" for c in s.changes])


__all__ = ["BUDGET_ROUNDS", "CHANGES", "MAX_ROUNDS", "PRESET_ORDER", "Suggestion", "format_suggestion", "least_fitting_budget", "suggest_fit",
           "with_budget"]
