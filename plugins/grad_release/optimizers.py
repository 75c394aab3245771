"""Which optimizers grad_release can step bucket by bucket, and how it builds one per bucket.

grad_release steps each bucket with its own optimizer, built from the engine's basic optimizer
(the one DeepSpeed would have stepped, possibly a plugin's replacement) as
``type(opt)(param_groups, **defaults)`` over this rank's master slices. Its hyperparameters
(``lr`` moved by a scheduler included) are copied from the basic optimizer's groups before every
step, so schedulers keep driving the basic optimizer as they always did.

Two properties decide whether an optimizer fits:

* It must step without a closure and over any subset of its parameters (LBFGS does not).
* Under ZeRO stage 1/2 each rank steps a 1-D slice of every parameter (`layout.py`), which is
  exact only for element-wise updates (SGD, the Adam family, Adagrad, RMSprop, ...). Optimizers
  that look at a whole tensor (LAMB's trust ratio, Adafactor's factored moments, Muon) are exact
  at stage 0 only. A third-party optimizer declares an element-wise step with the class attribute
  ``xirang_elementwise = True``.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import torch

ELEMENTWISE_TORCH = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta",
                     "Rprop", "ASGD")
"""torch.optim classes whose update of an element depends on that element only."""
ELEMENTWISE_DEEPSPEED = {"FusedAdam": "deepspeed.ops.adam.fused_adam", "FusedLion": "deepspeed.ops.lion.fused_lion"}
"""DeepSpeed's element-wise optimizers, by class name and defining module."""
COMMUNICATING = ("OnebitAdam", "OnebitLamb", "ZeroOneAdam")
"""DeepSpeed optimizers that run collectives inside ``step()``: stepping them per bucket would
issue those collectives once per bucket, out of step with other ranks."""
EXTRA_INIT_ATTRIBUTES = {"FusedAdam": ("adam_w_mode",)}
"""Constructor arguments an optimizer keeps as an attribute rather than in ``defaults``."""


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """True if the optimizer's update of each element depends on that element alone."""
    cls = type(optimizer)
    declared = getattr(cls, "xirang_elementwise", None)
    if declared is not None:
        return bool(declared)
    if cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE_TORCH:
        return True
    return cls.__module__ == ELEMENTWISE_DEEPSPEED.get(cls.__name__)


def optimizer_problems(optimizer: Any, sharded: bool, zero_stage: int) -> list[str]:
    """Why grad_release cannot step this optimizer per bucket (empty if it can).

    Args:
        optimizer: the engine's basic optimizer.
        sharded: True when each rank steps slices of parameters (ZeRO stage 1/2 over > 1 rank).
        zero_stage: the ZeRO stage the user asked for (for the message).
    """
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        return [f"the optimizer {name} is not a torch.optim.Optimizer; grad_release builds one optimizer per "
                "bucket from it. Pass a torch.optim optimizer (or an \"optimizer\" block), or disable "
                "xirang.grad_release"]
    step = inspect.signature(type(optimizer).step).parameters.get("closure")
    if step is not None and step.default is inspect.Parameter.empty:
        return [f"the optimizer {name} needs a closure in step() and steps all parameters at once, so it cannot "
                "step per parameter during backward; use an optimizer without a closure (AdamW, SGD, ...) or "
                "disable xirang.grad_release"]
    if name in COMMUNICATING:
        return [f"the optimizer {name} communicates inside step(), which grad_release calls once per bucket on "
                "each rank; use Adam/AdamW or disable xirang.grad_release"]
    if sharded and not is_elementwise(optimizer):
        return [f"the optimizer {name} is not known to update each element independently, and with "
                f"zero_optimization.stage {zero_stage} grad_release steps 1/world slices of each parameter "
                "(exact only for element-wise updates such as SGD and the Adam family). Use "
                "zero_optimization.stage 0 (whole parameters), an element-wise optimizer, or set "
                f"{name}.xirang_elementwise = True if its step is element-wise"]
    return []


def clone_optimizer(optimizer: torch.optim.Optimizer, param_groups: Sequence[dict],
                    **overrides: Any) -> torch.optim.Optimizer:
    """An optimizer of the same class and settings over other tensors.

    ``type(opt)(param_groups, **opt.defaults)``, restricted to the keyword arguments the class's
    constructor accepts (torch's AdamW keeps ``decoupled_weight_decay`` in ``defaults`` but does
    not take it), plus the arguments some classes keep as attributes (`EXTRA_INIT_ATTRIBUTES`).
    Every group carries all its hyperparameters, so nothing falls back to a default. ``overrides``
    are further constructor arguments (those the class does not take are dropped).

    Raises:
        TypeError: the class cannot be built this way.
    """
    cls = type(optimizer)
    kwargs = {**optimizer.defaults, **overrides}
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    for attribute in EXTRA_INIT_ATTRIBUTES.get(cls.__name__, ()):
        if hasattr(optimizer, attribute) and attribute in params:
            kwargs[attribute] = bool(getattr(optimizer, attribute))
    groups = list(param_groups)
    own: tuple[str, ...] = ()
    if _leaves_foreach_to_torch(optimizer, groups):
        kwargs["foreach"], own = True, ("foreach",)
        groups = [{**g, "foreach": True} for g in groups]
    clone = cls(groups, **kwargs)
    clone.xirang_own_keys = own  # kept by `sync_hyperparameters`
    return clone


def _leaves_foreach_to_torch(optimizer: torch.optim.Optimizer, groups: Sequence[dict]) -> bool:
    """A torch.optim optimizer whose ``foreach`` is unset (None: torch's choice, which is the
    multi-tensor path on CUDA and the per-tensor Python loop elsewhere). A bucket steps one view per
    parameter slice where DeepSpeed steps one flat partition, so on CPU the per-tensor loop would cost
    a dozen Python-dispatched ops per slice; the multi-tensor ops run the same arithmetic per tensor
    in the same order (the same bits), looped in C++. An explicit ``foreach`` (True or False) is kept."""
    if not type(optimizer).__module__.startswith("torch.optim") or "foreach" not in optimizer.defaults:
        return False
    if any(g.get("foreach") is not None for g in groups) or optimizer.defaults["foreach"] is not None:
        return False
    return not any(g.get("differentiable") or g.get("fused") or g.get("capturable") for g in groups)


def leaves_foreach_in_config(ds_config: dict) -> bool:
    """Whether the ds_config's optimizer is one `_leaves_foreach_to_torch` takes (before it is built: the
    estimate): torch's Adam or AdamW (``torch_adam``) with none of ``foreach``, ``fused``, ``capturable``,
    ``differentiable`` set, which each bucket's clone then steps on the multi-tensor path."""
    opt = ds_config.get("optimizer") or {}
    params = opt.get("params") or {}
    return (str(opt.get("type", "")).lower() in ("adam", "adamw") and bool(params.get("torch_adam"))
            and params.get("foreach") is None
            and not any(params.get(k) for k in ("fused", "capturable", "differentiable")))


def hyperparameters(group: dict) -> dict:
    """A param group without its ``params``."""
    return {k: v for k, v in group.items() if k != "params"}


def sync_hyperparameters(source_groups: Sequence[dict], target: torch.optim.Optimizer,
                         sources: Sequence[int]) -> None:
    """Copy each source group's hyperparameters into the target group built from it (not the
    keys `clone_optimizer` chose for the clone itself).

    Args:
        source_groups: the basic optimizer's ``param_groups`` (what schedulers move).
        target: a bucket's optimizer.
        sources: for each of the target's groups, the index of its source group.
    """
    skip = ("params", *getattr(target, "xirang_own_keys", ()))
    for group, index in zip(target.param_groups, sources):
        for key, value in source_groups[index].items():
            if key not in skip:
                group[key] = value


def state_tensors(optimizer: Optional[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every tensor in an optimizer's per-parameter state."""
    if optimizer is None:
        return []
    out = []
    for state in optimizer.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


__all__ = ["clone_optimizer", "hyperparameters", "is_elementwise", "optimizer_problems", "state_tensors",
           "sync_hyperparameters"]
