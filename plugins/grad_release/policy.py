"""What each backward does and with which multiplier: clipping, fp16 loss scaling, non-finite
gradients, and what ``engine.step()`` reports afterwards.

The multiplier of a bucket's averaged gradient follows DeepSpeed's ZeRO rule
(``stage_1_and_2.py`` ``unscale_and_clip_grads``): divide by ``loss_scale * max(1, (norm + 1e-6) /
gradient_clipping)``, with ``norm`` the global L2 norm of the unscaled gradient. What differs is
where ``norm`` comes from:

* ``exact``: this step's norm, known before any update. Needs a global pass (`needs_global_pass`):
  ``hold`` (shards kept until backward ends) or ``two_pass`` (a norm-only backward first).
* ``previous_step``: the previous step's norm; the first step (no previous norm) is exact.
* ``per_layer``: each parameter tensor against its share ``gradient_clipping * sqrt(numel /
  total)`` of the limit, from its own norm (no global pass).

fp16 (dynamic loss scaling) always takes a global pass: an overflow found in the last bucket must
skip the whole step, so no bucket may be applied before every gradient is known finite.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from xirang_ds.plugins.grad_release.bucket import Bucket, Coefficient
from xirang_ds.plugins.grad_release.comm import DataParallelComm
from xirang_ds.plugins.grad_release.pipeline import Pass, Rule

CLIP_EPS = 1e-6
"""Added to the norm before dividing, as DeepSpeed does."""


def clip_divisor(norm: float, max_norm: float) -> float:
    """DeepSpeed's clip factor: ``max(1, (norm + 1e-6) / max_norm)`` (1 when clipping is off)."""
    if max_norm <= 0:
        return 1.0
    return max(1.0, (norm + CLIP_EPS) / max_norm)


@dataclass
class StepOutcome:
    """What the last micro-step's backward did, for ``engine.step()``.

    Attributes:
        skipped: the step was skipped (non-finite gradients, fp16 overflow); no parameter changed.
        grad_norm: the global norm of the unscaled, unclipped gradient (nan/inf when non-finite).
    """

    skipped: bool
    grad_norm: float


class ReleasePolicy:
    """Decides the passes of each backward and the multipliers, and keeps the state between steps.

    Args:
        comm: the data-parallel collectives (the global norm is summed over ranks when sharded).
        sharded: True if gradient shards differ between ranks (ZeRO 1/2 over > 1 rank).
        max_norm: ds_config's ``gradient_clipping`` (0: off).
        clipping: ``exact``, ``previous_step`` or ``per_layer``.
        exact_method: ``hold`` or ``two_pass``.
        skip_nonfinite: skip steps with non-finite gradients (else raise).
        loss_scaler: DeepSpeed's loss scaler for fp16, else None.
        total_numel: trainable elements (per-layer shares).
        norm_comms: further groups the global norm's sum of squares is summed over (Megatron's
            tensor-parallel group, whose ranks hold different shards of each split weight).

    Attributes:
        previous_norm: the last step's global gradient norm (``previous_step`` clipping).
        outcome: what the last boundary backward did (consumed by ``engine.step()``).
    """

    def __init__(self, comm: DataParallelComm, sharded: bool, max_norm: float, clipping: str, exact_method: str,
                 skip_nonfinite: bool, loss_scaler: Any = None, total_numel: int = 1,
                 norm_comms: Sequence[DataParallelComm] = ()):
        self.comm = comm
        self.sharded = sharded
        self.max_norm = float(max_norm)
        self.clipping = clipping
        self.exact_method = exact_method
        self.skip_nonfinite = skip_nonfinite
        self.loss_scaler = loss_scaler
        self.hold_updates = False
        """Every update waits for the end of backward (a HOLD pass), so an out-of-memory error inside
        backward leaves nothing applied (``monitor.on_oom``)."""
        self.total_numel = max(1, total_numel)
        self.norm_comms = [c for c in norm_comms if c.world > 1]
        self.previous_norm: Optional[float] = None
        self.known_norm: Optional[float] = None
        self.outcome: Optional[StepOutcome] = None

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    # passes -------------------------------------------------------------------------------------
    def needs_global_pass(self) -> bool:
        """True if this step's norm or finiteness must be known before the first update."""
        if self.skip_nonfinite or self.hold_updates:
            return True
        if self.max_norm <= 0:
            return False
        return self.clipping == "exact" or (self.clipping == "previous_step" and self.previous_norm is None)

    def passes(self, boundary: bool) -> list[Pass]:
        """The passes of a backward: one, or two for ``two_pass``."""
        if not boundary:
            return [Pass.ACCUMULATE]
        self.known_norm = None
        if not self.needs_global_pass():
            return [Pass.FUSED]
        return [Pass.NORM, Pass.UPDATE] if self.exact_method == "two_pass" else [Pass.HOLD]

    # multipliers --------------------------------------------------------------------------------
    def rule(self) -> Rule:
        """The multiplier of each bucket for the update about to happen."""
        scale = self.loss_scale
        if self.max_norm > 0 and self.clipping == "per_layer":
            return lambda bucket: self._per_layer(bucket, scale)
        norm = self.known_norm
        if norm is None and self.max_norm > 0 and self.clipping == "previous_step":
            norm = self.previous_norm
        divisor = clip_divisor(norm, self.max_norm) if norm is not None and math.isfinite(norm) else 1.0
        multiplier = 1.0 / (scale * divisor)
        return lambda bucket: multiplier

    def _per_layer(self, bucket: Bucket, scale: float) -> Coefficient:
        sums = bucket.param_sumsq()
        if self.sharded:
            self.comm.all_reduce(sums, async_op=False)
        norms = sums.sqrt() / scale
        numels = torch.tensor(bucket.layout.numels, dtype=torch.float64, device=norms.device)
        budgets = self.max_norm * (numels / self.total_numel).sqrt()
        divisors = torch.clamp((norms + CLIP_EPS) / budgets, min=1.0)
        return 1.0 / (scale * divisors)

    # results ------------------------------------------------------------------------------------
    def global_norm(self, local_sumsq: Optional[torch.Tensor]) -> float:
        """The unscaled global gradient norm from this rank's sum of squares (one collective per group
        whose ranks hold different gradients: data parallel when sharded, then `norm_comms`)."""
        if local_sumsq is None:
            return 0.0
        total = local_sumsq.detach().clone()
        if self.sharded:
            self.comm.all_reduce(total, async_op=False)
        for comm in self.norm_comms:
            comm.all_reduce(total, async_op=False)
        value = float(total)  # the one host read of this step's norm
        return math.sqrt(value) / self.loss_scale if math.isfinite(value) else value

    def finish_step(self, norm: float, applied: bool) -> StepOutcome:
        """Record a boundary backward's result; update the loss scale like DeepSpeed does each step."""
        skipped = not applied
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(skipped)
        if applied and math.isfinite(norm):
            self.previous_norm = norm
        self.known_norm = None
        self.outcome = StepOutcome(skipped=skipped, grad_norm=norm)
        return self.outcome

    # checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        scaler = self.loss_scaler
        scaler_state = None
        if scaler is not None:
            scaler_state = {k: getattr(scaler, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter",
                                                             "cur_hysteresis") if hasattr(scaler, k)}
        return {"previous_norm": self.previous_norm, "loss_scaler": scaler_state}

    def load_state_dict(self, state: dict) -> None:
        self.previous_norm = state.get("previous_norm")
        if self.loss_scaler is not None and state.get("loss_scaler"):
            for key, value in state["loss_scaler"].items():
                setattr(self.loss_scaler, key, value)


__all__ = ["ReleasePolicy", "StepOutcome", "clip_divisor"]
