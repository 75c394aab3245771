"""The DeepSpeed engine behaviour grad_release relies on, in one version-guarded place.

Checked against deepspeed 0.16-0.19 (``runtime/engine.py``; lines of 0.19.8):

* ``_backward_epilogue`` (l. 3153) all-reduces every gradient at stage 0 when
  ``engine.enable_backward_allreduce`` is true, creating zero gradients for parameters whose
  ``grad`` is None (``buffered_allreduce_fallback``, l. 3921). grad_release reduces itself and
  drops gradients, so it clears the flag while attached (the pipeline engine clears it too).
* ``_take_model_step`` (l. 3505) calls ``self.optimizer.step()`` — at stage 0 without a precision
  wrapper ``self.optimizer`` is the basic optimizer — then reads ``self.optimizer.overflow`` to skip
  the LR scheduler and count ``skipped_steps``, and ``self.optimizer._global_grad_norm`` for
  ``get_global_grad_norm()``. `step_protocol` empties the basic optimizer's param groups for that
  call (the update already happened in backward) and sets both attributes, the way DeepSpeed's own
  fp16/ZeRO wrappers expose them.
* ``gradient_clipping()`` (l. 1778) returns ``engine._config.gradient_clipping``; DeepSpeed's copy
  of the ds_config says 0 while grad_release clips, and `restore_gradient_clipping` gives the
  engine the user's value back when grad_release is removed.

``tests/test_grad_release_config.py::test_deepspeed_protocol_still_holds`` fails when a DeepSpeed
release moves these.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Optional

PROTOCOL_ATTRIBUTES = ("overflow", "_global_grad_norm")
"""Attributes ``_take_model_step`` reads from ``engine.optimizer``."""


def protocol_holds() -> list[str]:
    """What of the relied-on engine behaviour is missing in the installed DeepSpeed (empty: all there)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    missing = []
    take = inspect.getsource(DeepSpeedEngine._take_model_step)
    for needle in ("self.optimizer.step()", "self.optimizer.overflow", "_global_grad_norm"):
        if needle not in take:
            missing.append(f"DeepSpeedEngine._take_model_step no longer uses {needle}")
    if "enable_backward_allreduce" not in inspect.getsource(DeepSpeedEngine._backward_epilogue):
        missing.append("DeepSpeedEngine._backward_epilogue no longer checks enable_backward_allreduce")
    if "self._config.gradient_clipping" not in inspect.getsource(DeepSpeedEngine.gradient_clipping):
        missing.append("DeepSpeedEngine.gradient_clipping no longer reads self._config.gradient_clipping")
    return missing


def restore_gradient_clipping(engine: Any, value: float) -> None:
    """Make the engine clip at ``value`` again (its ds_config copy said 0 while grad_release clipped)."""
    engine._config.gradient_clipping = value


@contextlib.contextmanager
def step_protocol(optimizer: Any, skipped: bool, grad_norm: Optional[float]) -> Iterator[None]:
    """Around ``engine.step()`` at a boundary: the basic optimizer steps nothing and reports the outcome.

    Args:
        optimizer: ``engine.optimizer`` (the basic optimizer at stage 0).
        skipped: the step was skipped (DeepSpeed then skips the scheduler and counts it).
        grad_norm: the global gradient norm for ``engine.get_global_grad_norm()`` (None: unknown).
    """
    saved_params = [group["params"] for group in optimizer.param_groups]
    saved_attrs = {name: vars(optimizer)[name] for name in PROTOCOL_ATTRIBUTES if name in vars(optimizer)}
    for group in optimizer.param_groups:
        group["params"] = []
    optimizer.overflow = skipped
    if grad_norm is not None:
        optimizer._global_grad_norm = grad_norm
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved_params):
            group["params"] = params
        for name in PROTOCOL_ATTRIBUTES:
            vars(optimizer).pop(name, None)
        vars(optimizer).update(saved_attrs)


__all__ = ["protocol_holds", "restore_gradient_clipping", "step_protocol"]
