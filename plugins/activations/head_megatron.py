"""The chunked output head under Megatron-core: a language model's ``output_layer`` (a
``ColumnParallelLinear`` whose logits are split over the tensor-parallel group) and the model's own
``compute_language_model_loss``, a slice of tokens at a time.

Found by structure: a module with an ``output_layer`` and a ``compute_language_model_loss`` method
(Megatron-core's ``LanguageModule``: GPTModel, its multi-token-prediction heads and the models built
on it). Under ``chunk`` (and while profiling) the output layer returns ``(DeferredLogits, bias)``
(`head_loss.DeferredLogits`, with the layer's other arguments kept for a whole computation), and
the owner's ``compute_language_model_loss`` (wrapped on the instance) sees them: it runs
`ChunkedModelLoss`, which calls the model's *own* loss (vocab-parallel cross-entropy, fused or not,
or an override) on each slice of tokens, so each token's loss is the one the model computes.
Anything else done with the logits (``labels=None``: ``logits.transpose(0, 1)``) computes them whole
with the layer's own forward, as without the plugin.

Exactness. A slice's logits are the layer's ``matmul(input, weight.t())`` on the slice's rows, and its
loss and the loss's gradient are the model's loss function and autograd on those rows (the all-reduces
over the tensor-parallel group are per token): the loss is bit-identical to the whole run's. The
input's gradient is ``grad.matmul(weight)`` per slice, all-reduced over the tensor-parallel group once
as the layer's backward does; the weight's gradient adds one product per slice (bit-identical with one
slice, exact to rounding with several).

Not applied (the logits are computed whole; `why_not` says which): sequence parallelism (the layer's
input is split over the sequence and gathered inside its linear), ``gradient_accumulation_fusion``
(the weight gradient goes into ``main_grad`` through a CUDA kernel), deferred embedding weight
gradients, ``gather_output``, expert layers and layers without gradient reduction.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn as nn

from xirang_ds.plugins.activations.head_loss import DeferredLogits, HeadCall, auto_tokens, linear_backward_by_slices

LOSS = "compute_language_model_loss"


def output_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: output layer}`` of every module in ``model`` with an ``output_layer`` and a
    ``compute_language_model_loss`` (names local to ``model``)."""
    out = {}
    for name, owner in model.named_modules():
        layer = getattr(owner, "output_layer", None)
        if isinstance(layer, nn.Module) and callable(getattr(owner, LOSS, None)):
            out[f"{name}.output_layer" if name else "output_layer"] = layer
    return out


def why_not(layer: nn.Module) -> Optional[str]:
    """Why ``layer``'s calls cannot be chunked (``None``: they can)."""
    if not all(hasattr(layer, a) for a in ("allreduce_dgrad", "sequence_parallel", "gather_output", "skip_bias_add")):
        return f"on a {type(layer).__name__} (the chunked head takes Megatron-core's ColumnParallelLinear)"
    config = getattr(layer, "config", None)
    reasons = [(layer.sequence_parallel, "with sequence parallelism (its input is split over the sequence)"),
               (getattr(layer, "gradient_accumulation_fusion", False),
                "with gradient_accumulation_fusion (its weight gradient goes into main_grad through a CUDA kernel)"),
               (getattr(config, "defer_embedding_wgrad_compute", False), "with defer_embedding_wgrad_compute"),
               (layer.gather_output, "with gather_output (its logits are gathered over the tensor-parallel group)"),
               (getattr(layer, "explicit_expert_comm", False) or getattr(layer, "disable_grad_reduce", False),
                "on an expert layer or one without gradient reduction")]
    return next((why for bad, why in reasons if bad), None)


def defer(module: nn.Module, args: tuple, kwargs: dict, consumer: Callable[..., Optional[torch.Tensor]],
          materialize: Callable[[HeadCall], torch.Tensor]) -> Optional[tuple]:
    """The output layer's ``(logits, bias)`` with deferred logits, or ``None`` where the call cannot
    be deferred (see `why_not`; autocast; an input that is not ``[sequence, batch, hidden]``)."""
    names = ("input_", "weight", "runtime_gather_output")
    if len(args) > len(names) or any(k not in names[1:] for k in kwargs) or not args:
        return None
    given = dict(zip(names, args), **kwargs)
    hidden, weight, gather = given["input_"], given.get("weight"), given.get("runtime_gather_output")
    if weight is None:
        weight = module.weight
    if (not isinstance(hidden, torch.Tensor) or isinstance(hidden, DeferredLogits) or hidden.ndim != 3
            or not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.dtype != hidden.dtype
            or weight.device != hidden.device or torch.is_autocast_enabled(hidden.device.type) or gather
            or why_not(module) is not None):
        return None
    bias = None if module.skip_bias_add else module.bias
    call = HeadCall(hidden, weight, bias, consumer, materialize, rest=(args[1:], kwargs))
    logits = DeferredLogits(call, torch.Size((*hidden.shape[:-1], weight.shape[0])), hidden.dtype, tokens=hidden)
    return logits, (module.bias if module.skip_bias_add else None)


class LanguageModelLoss:
    """``owner.compute_language_model_loss`` for an owner whose output layer may return deferred
    logits: chunked through the head's wrapper (`ModuleWrapper._cross_entropy`) or, for anything
    else, the owner's own loss on the whole logits."""

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def __call__(self, original: Callable, labels: Any, logits: Any) -> torch.Tensor:
        if not isinstance(logits, DeferredLogits):
            return original(labels, logits)
        if (logits.parent is None and logits.call.logits is None and logits.ndim == 3
                and isinstance(labels, torch.Tensor) and not isinstance(labels, DeferredLogits)
                and labels.dtype == torch.long and tuple(labels.shape) == (logits.shape[1], logits.shape[0])):
            s, b, v = logits.shape
            target = labels.t().reshape(-1)  # the rows of the flattened [s, b] tokens
            group = tp_group(self.layer) if self.layer.allreduce_dgrad else None

            def whole(z: torch.Tensor) -> torch.Tensor:
                return original(labels, z.view(s, b, v))

            def chunked(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], casts: tuple,
                        rows: Optional[int], scope: Optional[Callable[[], ContextManager]], param_scope: Any
                        ) -> torch.Tensor:
                per_token = ChunkedModelLoss.apply(hidden, weight, bias, target, _per_slice(original),
                                                   max(1, int(rows or auto_tokens(weight))), scope, group)
                return per_token.view(s, b).t().contiguous()  # the loss's [b, s], as the model returns it

            out = logits.call.consumer(logits.reshape(s * b, v), target, whole, chunked)
            if out is not None:
                return out
        return original(labels, logits.whole(LOSS))


def _per_slice(original: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's loss on one slice of tokens: logits ``[n, V]`` as ``[n, 1, V]`` (sequence, batch),
    labels as ``[1, n]``; the per-token loss ``[n]``."""
    return lambda target, z: original(target.view(1, -1), z.unsqueeze(1)).reshape(-1)


def tp_group(layer: nn.Module) -> Any:
    group = getattr(layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group


def _linear(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The output layer's own arithmetic (``LinearWithGradAccumulationAndAsyncCommunication``)."""
    out = torch.matmul(hidden, weight.t())
    return out + bias if bias is not None else out


class ChunkedModelLoss(torch.autograd.Function):
    """The per-token loss of ``loss_fn(target, linear(hidden, weight, bias))`` a slice of ``rows``
    tokens at a time, in forward and again in backward (module docstring); saves ``hidden``, the
    weight, the bias and ``target``. The input's gradient is all-reduced over ``group`` when given."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, loss_fn, rows, scope, group):
        with torch.no_grad():
            parts = [loss_fn(target[i:i + rows], _linear(hidden[i:i + rows], weight, bias))
                     for i in range(0, hidden.shape[0], rows)]
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.settings = (loss_fn, rows, scope, group)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, target = ctx.saved_tensors
        loss_fn, rows, scope, group = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]

        def logits_grad(start: int, h: torch.Tensor) -> torch.Tensor:
            with scope() if scope is not None else contextlib.nullcontext():
                with torch.no_grad():
                    z = _linear(h, weight, bias)
                z.requires_grad_(True)
                with torch.enable_grad():
                    loss = loss_fn(target[start:start + rows], z)
                (gz,) = torch.autograd.grad(loss, z, grad_out[start:start + rows])
                del z, loss
            return gz

        dh, dw, db = linear_backward_by_slices(hidden, weight, rows, (need_h, need_w, need_b), logits_grad)
        if need_h and group is not None:
            torch.distributed.all_reduce(dh, group=group)
        return dh, dw, db, None, None, None, None, None


__all__ = ["ChunkedModelLoss", "LOSS", "LanguageModelLoss", "defer", "output_layers", "tp_group", "why_not"]
