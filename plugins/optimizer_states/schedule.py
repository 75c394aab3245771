"""Precision policies: which format each state tensor is stored in after each update.

* `StepPolicy`: the ``schedule`` stages by the tensor's own step count (a tensor stepped less
  often, as under per-layer gradient release, follows its own count).
* `StabilityPolicy`: every ``window_steps`` steps the tensor's moment norms are compared with the
  previous window's; a relative change under ``threshold`` moves it one format down (not below
  ``lowest``). At the same points a quantized tensor's update error is measured (the relative
  L2 error of ``m / (sqrt(v) + eps)`` computed from decoded states against the fp32 values);
  above ``max_quantization_error`` it moves one format back up and stays at or above it.

A policy keeps its per-tensor position in the tensor's state (``state["policy"]``, plain
numbers and strings), so it travels in checkpoints with the states.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Optional

from xirang_ds.plugins.optimizer_states.config import STATE_DTYPE_ORDER, OptimizerStatesConfig


@dataclass
class Measurement:
    """What the update measured on a tensor at a policy's measuring step.

    Attributes:
        exp_avg_norm, exp_avg_sq_norm: L2 norms of the bias-corrected fp32 moments after the update
            (``m / (1 - beta1 ** t)``, ``v / (1 - beta2 ** t)``).
        update_error: relative error of the Adam direction from the stored (quantized) states,
            or ``None`` when the states are stored unquantized.
    """

    exp_avg_norm: float
    exp_avg_sq_norm: float
    update_error: Optional[float] = None


class Policy(abc.ABC):
    """Chooses a tensor's storage format: subclasses implement `initial` and `target`, and may
    measure through `wants_measurement` / `observe`."""

    @abc.abstractmethod
    def initial(self) -> str:
        """Format of a tensor's states before its first update."""

    @abc.abstractmethod
    def target(self, state: dict, step: int) -> str:
        """Format to store the states in after update number ``step`` (1-based)."""

    def wants_measurement(self, state: dict, step: int) -> bool:
        """Whether update ``step`` should measure norms and error for `observe`."""
        return False

    def observe(self, state: dict, step: int, measurement: Measurement) -> Optional[str]:
        """Take a measurement; return a new format for the following steps, or ``None``."""
        return None


class StepPolicy(Policy):
    """The by-step ``schedule``: stage ``i`` holds while the step count is below its
    ``until_step``; the last stage holds forever."""

    def __init__(self, config: OptimizerStatesConfig):
        self.stages = [(e.until_step, e.dtype) for e in config.schedule]

    def initial(self) -> str:
        return self.stages[0][1]

    def target(self, state: dict, step: int) -> str:
        for until, dtype in self.stages:
            if until is None or step < until:
                return dtype
        return self.stages[-1][1]


class StabilityPolicy(Policy):
    """Moves a tensor down when its moments settle and up when quantization hurts its update."""

    def __init__(self, config: OptimizerStatesConfig):
        s = config.stability
        self.window = s.window_steps
        self.threshold = s.threshold
        self.start = STATE_DTYPE_ORDER.index(s.start)
        self.lowest = STATE_DTYPE_ORDER.index(s.lowest)
        self.max_error = s.max_quantization_error

    def initial(self) -> str:
        return STATE_DTYPE_ORDER[self.start]

    def _position(self, state: dict) -> dict:
        # levels in STATE_DTYPE_ORDER (ints: torch's load_state_dict mangles strings)
        return state.setdefault("policy", {"level": self.start, "lowest": self.lowest, "update_error": None,
                                           "exp_avg_norm": None, "exp_avg_sq_norm": None})

    def target(self, state: dict, step: int) -> str:
        return STATE_DTYPE_ORDER[self._position(state)["level"]]

    def wants_measurement(self, state: dict, step: int) -> bool:
        return step % self.window == 0

    def observe(self, state: dict, step: int, measurement: Measurement) -> Optional[str]:
        pos = self._position(state)
        pos["update_error"] = measurement.update_error
        before = (pos["exp_avg_norm"], pos["exp_avg_sq_norm"])
        pos["exp_avg_norm"], pos["exp_avg_sq_norm"] = measurement.exp_avg_norm, measurement.exp_avg_sq_norm
        level = pos["level"]
        if measurement.update_error is not None and measurement.update_error > self.max_error and level > 0:
            pos["level"] = pos["lowest"] = level - 1  # never below this again: quantization hurt it
            return STATE_DTYPE_ORDER[level - 1]
        if before[0] is None:
            return None
        change = max(relative_change(before[0], measurement.exp_avg_norm),
                     relative_change(before[1], measurement.exp_avg_sq_norm))
        if change < self.threshold and level < pos["lowest"]:
            pos["level"] = level + 1
            return STATE_DTYPE_ORDER[level + 1]
        return None


def relative_change(old: float, new: float) -> float:
    """``|new - old| / old``; infinite when ``old`` is zero and ``new`` is not."""
    if old == 0.0:
        return 0.0 if new == 0.0 else math.inf
    return abs(new - old) / old


def make_policy(config: OptimizerStatesConfig) -> Policy:
    """The policy the config names."""
    return StabilityPolicy(config) if config.policy == "stability" else StepPolicy(config)
