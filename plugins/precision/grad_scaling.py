"""fp16 loss scaling and non-finite gradient checks on the fp32 DeepSpeed engine, ZeRO 0, 1 and 2.

The scaler is DeepSpeed's (``DynamicLossScaler``, or ``LossScaler`` for a static ``loss_scale``),
built from the user's ``fp16`` section as DeepSpeed builds it; so hysteresis, the window and the
minimum scale behave as in DeepSpeed's fp16 mode. Under bf16 the scale is 1 and only the check runs
(``bf16.check_grad_overflow``).

* ZeRO 1/2: DeepSpeed's ZeRO optimizer carries the whole fp16 path (the loss scaled in
  ``engine.backward`` through ``scale_if_loss``; in ``step`` the overflow flag all-reduced over the
  data-parallel group, the step skipped and the scale updated, the unscale folded into clipping;
  the scaler saved in its checkpoint), keyed on ``loss_scaler``, ``dynamic_loss_scale`` and
  ``check_grad_overflow``, which its ``__init__`` derives from the parameter dtype
  (deepspeed 0.19.8 ``runtime/zero/stage_1_and_2.py``: ``__init__`` "self.loss_scaler =
  CreateLossScaler(", ``step`` "if self.check_grad_overflow:", ``unscale_and_clip_grads``).
  Setting those three on the fp32 optimizer turns the path on; `remove` puts them back.
* ZeRO 0: the engine steps the basic optimizer directly. ``engine.backward`` is wrapped to scale the
  gradient arriving at the loss; ``engine.step`` is wrapped to unscale, check (all ranks agree
  through one all-reduce) and, on overflow, zero the gradients, skip the optimizer's step and tell
  the engine through DeepSpeed's own ``optimizer.overflow`` flag (``engine._take_model_step`` then
  counts a skipped step and holds the LR schedule, as in fp16 mode).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from xirang_ds.compat.torch import amp_foreach_non_finite_check_and_unscale_, foreach_zero_
from xirang_ds.hooks import CallbackHandle, wrap_method
from xirang_ds.plugins.precision.ds_config import PrecisionPlan

logger = logging.getLogger("xirang_ds")

_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def make_scaler(plan: PrecisionPlan) -> Any:
    """DeepSpeed's loss scaler for the plan: dynamic, static, or scale 1 (bf16)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    settings = plan.loss_scale
    if settings is None:
        return LossScaler(scale=1.0)
    if settings.static_scale is not None:
        return LossScaler(scale=settings.static_scale)
    return DynamicLossScaler(dtype=torch.float16, **settings.dynamic_args)


def _zero_optimizer_class() -> type:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


class GradScaling:
    """Loss scale and overflow checks for one engine (see the module docstring).

    Args:
        engine: the DeepSpeed engine (fp32, ZeRO stage 0, 1 or 2).
        plan: the precision plan (dtype, loss-scale settings, whether to check).

    Raises:
        RuntimeError: the engine's optimizer is not the one DeepSpeed builds for this stage
            (a DeepSpeed version whose ZeRO optimizer lacks the loss-scale attributes).
    """

    def __init__(self, engine: Any, plan: PrecisionPlan) -> None:
        self.engine = engine
        self.plan = plan
        self.stage = engine.zero_optimization_stage()
        self._scaler = make_scaler(plan)
        self._skip_next = False
        self._backwards = 0
        self.skipped_steps = 0

    @property
    def active(self) -> bool:
        """Whether anything is scaled or checked."""
        return self.plan.loss_scale is not None or self.plan.check_overflow

    @property
    def scaler(self) -> Any:
        """DeepSpeed's scaler object in use (ZeRO 1/2 replace it when a checkpoint is loaded)."""
        return self.engine.optimizer.loss_scaler if self.stage in (1, 2) else self._scaler

    @property
    def loss_scale(self) -> float:
        """The factor gradients are scaled by during backward (1 under bf16)."""
        return float(self.scaler.cur_scale)

    # ----------------------------------------------------------------------------------------
    def attach(self) -> list[Any]:
        """Install into the engine; returns removable handles."""
        if not self.active:
            return []
        if self.stage in (1, 2):
            return [self._attach_zero()]
        opt = self.engine.optimizer
        if isinstance(opt, _zero_optimizer_class()):
            raise RuntimeError("xirang precision: ZeRO stage 0 engine carries a ZeRO optimizer; this DeepSpeed "
                               "version is not supported by the precision plugin's loss scaling")
        handles = [wrap_method(self.engine, "step", self._step), wrap_method(opt, "step", self._optimizer_step),
                   CallbackHandle(lambda: vars(opt).pop("overflow", None))]
        if self.plan.loss_scale is not None:
            handles.append(wrap_method(self.engine, "backward", self._backward))
        return handles

    def _attach_zero(self) -> CallbackHandle:
        opt = self.engine.optimizer
        names = ("loss_scaler", "dynamic_loss_scale", "check_grad_overflow")
        if not isinstance(opt, _zero_optimizer_class()) or not all(hasattr(opt, n) for n in names):
            raise RuntimeError(f"xirang precision: the ZeRO-{self.stage} optimizer ({type(opt).__name__}) lacks "
                               f"{', '.join(names)}; this DeepSpeed version is not supported (built for 0.16-0.19)")
        saved = {n: getattr(opt, n) for n in names}
        opt.loss_scaler = self._scaler
        opt.dynamic_loss_scale = bool(getattr(self._scaler, "dynamic", False))
        opt.check_grad_overflow = self.plan.check_overflow

        def restore() -> None:
            for n, v in saved.items():
                setattr(opt, n, v)

        return CallbackHandle(restore)

    # ZeRO 0 -------------------------------------------------------------------------------------
    def _backward(self, original: Any, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._backwards += 1
        scale = self.loss_scale
        handle = loss.register_hook(lambda g: g * scale) if scale != 1.0 and loss.requires_grad else None
        try:
            return original(loss, *args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()

    def _step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if self.engine.is_gradient_accumulation_boundary():
            self._check_boundary()
        return original(*args, **kwargs)

    def _check_boundary(self) -> None:
        opt = self.engine.optimizer
        params = [p for group in opt.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        if self.plan.loss_scale is not None and grads and self._backwards == 0:
            raise RuntimeError("xirang precision: fp16 gradients reached the step unscaled; call "
                               "engine.backward(loss) (not loss.backward()) so the loss scale is applied")
        self._backwards = 0
        overflow = self.unscale_and_check(grads)
        self.update_scale(overflow)
        opt.overflow = overflow
        if overflow:
            foreach_zero_(grads)  # clipping still runs before the (skipped) step; it must see finite zeros
            self._skip_next = True
            self.skipped_steps += 1

    def _optimizer_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if self._skip_next:
            self._skip_next = False
            return None
        return original(*args, **kwargs)

    # shared with other plugins ---------------------------------------------------------------
    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the loss scale in place; True if any is not finite on any rank.

        For plugins that apply gradients themselves (grad_release): call it on the gradients you
        are about to apply, then `update_scale` once per optimizer step.
        """
        import deepspeed.comm as dist
        from deepspeed.accelerator import get_accelerator

        device = grads[0].device if grads else torch.device(get_accelerator().current_device_name())
        found = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            inv = torch.full((1,), 1.0 / self.loss_scale, dtype=torch.float32, device=device)
            amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item() > 0)

    def update_scale(self, overflow: bool) -> None:
        """Advance DeepSpeed's scaler (halve on overflow within hysteresis, grow after the window)."""
        if getattr(self._scaler, "dynamic", False):
            self._scaler.update_scale(overflow)
        elif overflow:
            logger.warning("xirang precision: non-finite gradients at step %d; step skipped",
                           self.engine.global_steps)

    # checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """ZeRO 0's scaler state (ZeRO 1/2 keep theirs in DeepSpeed's optimizer checkpoint)."""
        if self.stage in (1, 2):
            return {}
        return {k: getattr(self._scaler, k) for k in _SCALER_STATE if hasattr(self._scaler, k)}

    def load_state_dict(self, state: Optional[dict]) -> None:
        for k, v in (state or {}).items():
            if k in _SCALER_STATE and hasattr(self._scaler, k):
                setattr(self._scaler, k, v)


__all__ = ["GradScaling", "make_scaler"]
