"""The chunked head at ZeRO-3: the head's weight gathered by the chunked loss itself.

At ZeRO-3 DeepSpeed releases the head's weight when the head's forward returns: the chunked loss
(`head_loss.ChunkedLinearCrossEntropy`) gathers it itself for its forward and its backward
(`gathered`, `gathered_backward`), and logits needed whole are computed by `GatheredLinear`, the
arithmetic of DeepSpeed's ZeRO-3 linear.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch


def is_zero3(param: Optional[torch.Tensor]) -> bool:
    """A parameter DeepSpeed's ZeRO-3 partitions (it carries DeepSpeed's ``ds_id``)."""
    return param is not None and hasattr(param, "ds_id")


def _released(param: Optional[torch.Tensor]) -> bool:
    """A ZeRO-3 parameter whose data DeepSpeed has released (only its shard is held)."""
    return is_zero3(param) and not param.data.numel()


def _gather(params: Any, scope: Optional[Callable[[], ContextManager]]) -> list:
    """Gather the released ZeRO-3 parameters among ``params`` (inside ``scope()``); returns them."""
    mine = [p for p in params if _released(p)]
    with scope() if scope is not None and mine else contextlib.nullcontext():
        for p in mine:
            p.all_gather()
    return mine


@contextlib.contextmanager
def gathered(*params: Optional[torch.Tensor], scope: Optional[Callable[[], ContextManager]] = None):
    """ZeRO-3: the released parameters among ``params`` gathered for the block and released after it
    (DeepSpeed's own ``all_gather``/``partition``, the gather inside ``scope()``: the tracker's
    parameters scope; a gathered or ordinary tensor is left as it is).
    The chunked loss runs after DeepSpeed released the head's weight at the end of the head's forward,
    and its backward outside the head's backward hooks, so it gathers the weight itself, each time only
    while it computes."""
    mine = _gather(params, scope)
    try:
        yield
    finally:
        for p in mine:
            _release(p)


def gathered_backward(ctx: Any, backward: Callable[[], tuple]) -> tuple:
    """``backward()`` with ``ctx.params`` (the head's weight and bias, ZeRO-3) gathered where released.
    Autograd accumulates each gradient into its parameter after the backward returns, in the
    parameter's current shape, so a parameter that gets one is released only once that (and
    DeepSpeed's reduction hook) ran."""
    mine = _gather(ctx.params, ctx.param_scope)
    try:
        out = backward()
    except BaseException:
        for p in mine:
            _release(p)
        raise
    needs = {id(p): need for p, need in zip(ctx.params, ctx.needs_input_grad[1:3])}
    for p in mine:
        (_release_after_accumulation if needs[id(p)] else _release)(p)
    return out


class GatheredLinear(torch.autograd.Function):
    """A ZeRO-3 head's linear computed whole outside its module's hooks (the deferred logits needed
    whole after DeepSpeed released the weight): the weight gathered for forward and again for
    backward, the arithmetic of DeepSpeed's own ZeRO-3 linear (``LinearFunctionForZeroStage3``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, param_scope):
        ctx.save_for_backward(hidden)
        ctx.params, ctx.param_scope = (weight, bias), param_scope
        out = hidden.matmul(weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        (hidden,) = ctx.saved_tensors
        weight, bias = ctx.params

        def grads() -> tuple:
            dh = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            dw = g2.t().matmul(hidden.reshape(-1, hidden.shape[-1])) if ctx.needs_input_grad[1] else None
            db = g2.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
            return dh, dw, db

        return gathered_backward(ctx, grads) + (None,)


def gathered_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    param_scope: Optional[Callable[[], ContextManager]] = None) -> torch.Tensor:
    """`GatheredLinear`: ``linear(hidden, weight, bias)`` with a ZeRO-3 weight gathered where released
    (inside ``param_scope()``, the tracker's parameters scope)."""
    with gathered(weight, bias, scope=param_scope):  # autograd records the weight's whole shape
        return GatheredLinear.apply(hidden, weight, bias, param_scope)


def _release(param: torch.nn.Parameter) -> None:
    """Release a parameter the chunked loss gathered, unless a module's own hooks gathered it meanwhile
    (a tied weight whose other module runs): DeepSpeed releases it then, as its own."""
    if not getattr(param, "ds_active_sub_modules", None):
        param.partition()


def _release_after_accumulation(param: torch.nn.Parameter) -> None:
    """Release a ZeRO-3 parameter gathered for a backward once its gradient was accumulated."""
    def release(p: torch.nn.Parameter) -> None:
        handle.remove()
        _release(p)

    handle = param.register_post_accumulate_grad_hook(release)


__all__ = ["GatheredLinear", "gathered", "gathered_linear", "gathered_backward", "is_zero3"]
