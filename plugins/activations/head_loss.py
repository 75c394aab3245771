"""The output head and its loss, chunked: the logits made and consumed a slice of tokens at a time,
in forward and again in backward, never held whole (the ``chunk`` option).

Found by structure, without model code changes: a head is an ``nn.Linear`` among the candidates
(``auto``: every one outside the model's blocks whose output is at least as wide as its input, the
LM head). Its wrapper returns `DeferredLogits`: a tensor of the logits' shape, dtype and device that
holds no data, only the head's input and weight. What a loss does to logits before the loss is
recorded on it (casts such as ``.float()``, reshapes that keep the vocabulary last, indexing of the
token dims, ``contiguous``), and ``F.cross_entropy`` on it runs `chunked_cross_entropy`. Anything
else (``argmax``, an arbitrary loss, printing) computes the logits whole with the recorded ops
replayed in order, the result the model would have had without the plugin. This covers a decoder's
``F.cross_entropy(logits.float().view(-1, V), labels)``, HF models' ``loss_function``
(``ForCausalLMLoss``: ``logits.float()``, ``view(-1, V)``, ``ignore_index``, ``reduction="sum"``
over ``num_items_in_batch``) and tied embeddings (the weight is the embedding's; its gradient adds up).

Exactness. Each row's log-softmax and picked log-probability are torch's own kernels on the same
row, and the mean or sum runs through ``nll_loss`` over the same values in the same order, so the
loss is bit-identical to ``F.cross_entropy`` on the whole logits. In backward the logits' gradient
is torch's own ``nll_loss_backward`` and ``_log_softmax_backward_data`` per slice (identical per
row); the head's weight and bias gradients add the slices' products (one rounding per slice in the
weight's dtype: exact to bf16 rounding, bit-identical with one slice).

At ZeRO-3 the chunked loss gathers the head's weight itself (`head_zero3`). Where grad_release
takes the weight's gradient by rows, the backward makes it a round of vocabulary rows at a time
(`head_rows`): the whole weight gradient never exists.

Not applied (the logits are computed whole, as without the plugin): under autocast, with a
``weight`` or ``label_smoothing`` in ``cross_entropy``, with class-probability targets, and inside a
region torch.compile traces (the head runs its plain forward, so profiling finds no chunkable call and
the planner keeps it).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from xirang_ds.compat.torch import (
    DisableTorchFunctionSubclass,
    log_softmax_backward_data,
    make_wrapper_subclass,
    parse_to,
    pytree,
)
from xirang_ds.plugins.activations import head_rows
from xirang_ds.plugins.activations.head_zero3 import gathered, gathered_backward, is_zero3

CHUNK = "chunk"
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
_CE_SIGNATURE = inspect.signature(F.cross_entropy)

_METADATA = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.requires_grad.__get__, torch.Tensor.ndim.__get__, torch.Tensor.is_cuda.__get__,
             torch.Tensor.layout.__get__, torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__,
             torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
             torch.Tensor.ndimension, torch.Tensor.element_size, torch.Tensor.is_floating_point,
             torch.Tensor.__len__, torch.Tensor.get_device}
"""Functions answered from the deferred logits' own shape, dtype and device (no logits needed)."""
_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64, torch.Tensor.half: torch.float16,
          torch.Tensor.bfloat16: torch.bfloat16}
_RESHAPES = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten}


def is_head(module: nn.Module) -> bool:
    """A module whose calls can be deferred: a plain linear layer at least as wide out as in."""
    return isinstance(module, nn.Linear) and module.out_features >= module.in_features


def head_modules(model: nn.Module, blocks: list[str]) -> list[str]:
    """The heads `auto` candidates add: `is_head` modules outside every block."""
    out = []
    for name, module in model.named_modules():
        if name and is_head(module) and not any(name == b or name.startswith(b + ".") for b in blocks):
            out.append(name)
    return out


class HeadCall:
    """One call of a head: its input, weight and bias, and what decides the loss.

    Attributes:
        consumer: ``consumer(logits, target, whole, chunked) -> Tensor | None`` runs the loss on the
            2-D `DeferredLogits` ``logits``: ``whole(logits)`` on the whole logits (while profiling),
            ``chunked(hidden, weight, bias, casts, rows, scope, param_scope)`` a slice of ``rows`` at
            a time (`chunked_cross_entropy` with the call's target and settings); ``None``: computed
            whole as any other op.
        materialize: ``materialize(call) -> Tensor`` the logits whole (the head's own forward).
        rest: the head's other positional and keyword arguments (Megatron's output layer takes its
            weight and ``runtime_gather_output``), passed again when the logits are made whole.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 consumer: Callable[..., Optional[torch.Tensor]], materialize: Callable[["HeadCall"], torch.Tensor],
                 rest: tuple = ((), {})):
        self.hidden, self.weight, self.bias, self.rest = hidden, weight, bias, rest
        self.consumer = consumer
        self._materialize = materialize
        self.logits: Optional[torch.Tensor] = None
        """The whole logits once something needed them (computed once per call)."""
        self.materialized_by: Optional[str] = None

    def whole(self, why: str) -> torch.Tensor:
        if self.logits is None:
            self.materialized_by = why
            self.logits = self._materialize(self)
        return self.logits


class DeferredLogits(torch.Tensor):
    """The logits of one head call, not computed: shape, dtype and device only (module docstring).

    Attributes:
        call: the `HeadCall`.
        parent, op: the deferred logits these came from and ``(func, args, kwargs)`` that made it
            (replayed when the logits are needed whole); ``None`` for the head's own output.
        tokens: the head's input laid out like these logits' token dims (``[*tokens, hidden]``),
            or ``None`` when an op made it no longer token-wise (only materializing is left).
        casts: dtypes the logits were cast through after the head, in order.
    """

    @staticmethod
    def __new__(cls, call: HeadCall, shape: torch.Size, dtype: torch.dtype, parent: Optional["DeferredLogits"] = None,
                op: Optional[tuple] = None, tokens: Optional[torch.Tensor] = None, casts: tuple = ()):
        requires_grad = call.hidden.requires_grad or call.weight.requires_grad
        self = make_wrapper_subclass(cls, shape, dtype=dtype, device=call.hidden.device,
                                                   requires_grad=requires_grad)
        self.call, self.parent, self.op, self.tokens, self.casts = call, parent, op, tokens, casts
        return self

    def __repr__(self) -> str:  # no data to print without computing it
        return f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype})"

    # ------------------------------------------------------------------------------------------
    def whole(self, why: str) -> torch.Tensor:
        """The logits as the model would have computed them: the head, then the recorded ops."""
        if self.parent is None:
            return self.call.whole(why)
        func, args, kwargs = self.op
        base = self.parent.whole(why)
        with DisableTorchFunctionSubclass():
            return func(base, *args, **kwargs)

    def _derive(self, func: Any, args: tuple, kwargs: dict) -> Optional["DeferredLogits"]:
        """Deferred logits for ``func(self, *args, **kwargs)`` if it keeps the logits token-wise."""
        if self.tokens is None or self.call.logits is not None:
            return None
        vocab = self.shape[-1]
        dtype, tokens = self.dtype, self.tokens
        if func in _CASTS:
            if args or kwargs:
                return None
            dtype = _CASTS[func]
        elif func is torch.Tensor.to:
            try:
                device, dtype_to, _, memory_format = parse_to(*args, **kwargs)
            except TypeError:
                return None
            if kwargs.get("copy") or memory_format not in (None, torch.preserve_format):
                return None
            if device is not None and torch.device(device) != self.device:
                return None
            dtype = dtype_to or dtype
        elif func is torch.Tensor.type_as:
            if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].device != self.device:
                return None
            dtype = args[0].dtype
        elif func is torch.Tensor.contiguous:
            if args or kwargs:
                return None
        elif func in _RESHAPES:
            try:
                with DisableTorchFunctionSubclass():
                    shape = func(torch.empty(self.shape, device="meta"), *args, **kwargs).shape
            except (TypeError, RuntimeError):
                return None
            if not shape or shape[-1] != vocab:
                return None
            tokens = tokens.reshape(*shape[:-1], tokens.shape[-1])
            return DeferredLogits(self.call, shape, dtype, self, (func, args, kwargs), tokens, self.casts)
        elif func is torch.Tensor.__getitem__:
            if len(args) != 1 or kwargs or not _keeps_last_dim(args[0], self.ndim):
                return None
            with DisableTorchFunctionSubclass():
                tokens = tokens[args[0]]
            shape = torch.Size((*tokens.shape[:-1], vocab))
            return DeferredLogits(self.call, shape, dtype, self, (func, args, kwargs), tokens, self.casts)
        else:
            return None
        casts = self.casts + ((dtype,) if dtype != self.dtype else ())
        return DeferredLogits(self.call, self.shape, dtype, self, (func, args, kwargs), tokens, casts)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if args and isinstance(args[0], DeferredLogits):
            derived = args[0]._derive(func, tuple(args[1:]), kwargs)
            if derived is not None:
                return derived
            if func is F.cross_entropy:
                out = args[0]._cross_entropy(args, kwargs)
                if out is not None:
                    return out
        name = getattr(func, "__name__", str(func))

        def real(value: Any) -> Any:
            return value.whole(name) if isinstance(value, DeferredLogits) else value

        args = pytree.tree_map(real, args)
        kwargs = pytree.tree_map(real, kwargs)
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"xirang activations: {func} reached deferred logits below autograd, where they cannot be "
                           "computed; this call site is not supported by the chunked head. Fix: remove the head "
                           "from xirang.activations.chunk, or drop \"chunk\" from xirang.activations.options")

    def _cross_entropy(self, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        try:
            bound = _CE_SIGNATURE.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        a = bound.arguments
        target = a["target"]
        if (self.tokens is None or self.call.logits is not None or self.ndim != 2 or a["weight"] is not None
                or a["size_average"] is not None or a["reduce"] is not None or a["label_smoothing"] != 0.0
                or a["reduction"] not in _REDUCTIONS or not isinstance(target, torch.Tensor)
                or isinstance(target, DeferredLogits) or target.dtype != torch.long
                or tuple(target.shape) != (self.shape[0],)):
            return None
        ignore_index, reduction = int(a["ignore_index"]), a["reduction"]

        def whole(logits: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

        def chunked(hidden, weight, bias, casts, rows, scope, param_scope) -> torch.Tensor:
            return chunked_cross_entropy(hidden, weight, bias, target, casts, ignore_index, reduction, rows, scope,
                                         param_scope)

        return self.call.consumer(self, target, whole, chunked)


def _keeps_last_dim(index: Any, ndim: int) -> bool:
    """Indexing with ``index`` leaves the last (vocabulary) dim whole and in order."""
    items = index if isinstance(index, tuple) else (index,)
    used = 0
    for i, item in enumerate(items):
        if item is None:
            return False
        if item is Ellipsis:
            rest = items[i + 1:]
            return not rest or rest[-1] == slice(None)
        if isinstance(item, torch.Tensor):
            used += item.ndim if item.dtype == torch.bool else 1
        elif isinstance(item, (int, slice)):
            used += 1
        else:
            return False
    return used < ndim or (used == ndim and items[-1] == slice(None))


# ------------------------------------------------------------------------------------------------
# the chunked loss


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], casts: tuple) -> torch.Tensor:
    z = F.linear(hidden, weight, bias)
    for dtype in casts:
        z = z.to(dtype)
    return z


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(cast(linear(hidden, weight, bias)), target)`` a slice of ``tokens`` rows at a
    time (module docstring); saves only ``hidden`` and ``target`` (and the head's weight and bias, or
    at ZeRO-3 a reference to them, gathered again in backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, casts, ignore_index, reduction, tokens, scope, param_scope):
        n = hidden.shape[0]
        picked, lse = [], []
        ctx.rows = head_rows.hand_over(weight, ctx.needs_input_grad[1])  # the weight's gradient by rows
        with torch.no_grad():
            for start in range(0, n, tokens):
                z = _logits(hidden[start:start + tokens], weight, bias, casts)
                logp = torch.log_softmax(z, 1)
                picked.append(F.nll_loss(logp, target[start:start + tokens], ignore_index=ignore_index,
                                         reduction="none"))
                lse += [head_rows.lse_of(z)] if ctx.rows is not None else []
                del z, logp
            per_token = torch.cat(picked) if len(picked) > 1 else picked[0]
            valid = target != ignore_index
            if reduction == "none":
                out = per_token
            else:  # the same values through nll_loss: the reduction torch's cross_entropy does, in its order
                out = F.nll_loss((-per_token).unsqueeze(1), torch.where(valid, 0, -1), ignore_index=-1,
                                 reduction=reduction)
            total = valid.sum().to(per_token.dtype)
        if is_zero3(weight):  # a reference: saving the gathered data would hold it until backward
            ctx.save_for_backward(hidden, None, None, target, total)
            ctx.params = (weight, bias)
        else:
            ctx.save_for_backward(hidden, weight, bias, target, total)
            ctx.params = None
        ctx.param_scope, ctx.lse = param_scope, torch.cat(lse) if lse else None
        ctx.settings = (casts, ignore_index, reduction, tokens, scope)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, target, total = ctx.saved_tensors
        if ctx.params is None:
            return ChunkedLinearCrossEntropy._backward(ctx, grad_out, hidden, weight, bias, target, total)
        weight, bias = ctx.params
        return gathered_backward(ctx, lambda: ChunkedLinearCrossEntropy._backward(ctx, grad_out, hidden, weight, bias,
                                                                                   target, total))

    @staticmethod
    def _backward(ctx, grad_out, hidden, weight, bias, target, total):
        casts, ignore_index, reduction, tokens, scope = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        sink = ctx.rows.take() if need_w and ctx.rows is not None else None
        if sink is not None:
            dh, db = head_rows.backward(sink, grad_out, hidden, weight, bias, target, total, ctx.lse, *ctx.settings,
                                        need_h, need_b)
            return (dh, None, db) + (None,) * 7
        enum = _REDUCTIONS[reduction]

        def logits_grad(start: int, h: torch.Tensor) -> torch.Tensor:
            # the slice's logits again, their gradient by torch's own kernels; the most held at once
            # is three slices of the loss's dtype (log-probabilities, their gradient, the logits')
            with scope() if scope is not None else contextlib.nullcontext():
                z = _logits(h, weight, bias, casts)
                logp = torch.log_softmax(z, 1)
                del z
                g = grad_out[start:start + tokens] if reduction == "none" else grad_out
                grad_logp = torch.ops.aten.nll_loss_backward(g, logp, target[start:start + tokens], None, enum,
                                                             ignore_index, total)
                gz = log_softmax_backward_data(grad_logp, logp, 1, logp.dtype)
                del logp, grad_logp
                for dtype in reversed((hidden.dtype,) + casts[:-1]):
                    gz = gz.to(dtype)
            return gz

        dh, dw, db = linear_backward_by_slices(hidden, weight, tokens, (need_h, need_w, need_b), logits_grad)
        return dh, dw, db, None, None, None, None, None, None, None


def linear_backward_by_slices(hidden: torch.Tensor, weight: torch.Tensor, rows: int, needs: tuple[bool, bool, bool],
                              logits_grad: Callable[[int, torch.Tensor], torch.Tensor]
                              ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The input, weight and bias gradients of a linear head, ``rows`` tokens at a time: the chunked
    backward of `ChunkedLinearCrossEntropy` and of Megatron's `head_megatron.ChunkedModelLoss`.

    Args:
        hidden: the head's input ``[tokens, hidden]``.
        weight: its weight ``[vocab, hidden]``.
        rows: tokens per slice.
        needs: which of the input, weight and bias gradients to make.
        logits_grad: ``logits_grad(start, h)`` the loss's gradient with respect to the logits of the slice
            ``h = hidden[start:start + rows]``, in the head's dtype (the loss decides how).

    Returns:
        ``(dh, dw, db)``, ``None`` where not needed: the input's gradient slice by slice, the weight's and
        the bias's as sums of the slices' products (one rounding per slice; bit-identical with one slice).
    """
    need_h, need_w, need_b = needs
    dh = torch.empty_like(hidden) if need_h else None
    dw = db = None
    for start in range(0, hidden.shape[0], rows):
        h = hidden[start:start + rows]
        gz = logits_grad(start, h)
        if need_h:
            torch.mm(gz, weight, out=dh[start:start + rows])
        if need_w:
            dw = gz.t().mm(h) if dw is None else dw.addmm_(gz.t(), h)
        if need_b:
            db = gz.sum(0) if db is None else db.add_(gz.sum(0))
        del gz
    return dh, dw, db


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          target: torch.Tensor, casts: tuple = (), ignore_index: int = -100, reduction: str = "mean",
                          tokens: Optional[int] = None, scope: Optional[Callable[[], ContextManager]] = None,
                          param_scope: Optional[Callable[[], ContextManager]] = None) -> torch.Tensor:
    """``F.cross_entropy(linear(hidden, weight, bias) cast through casts, target)`` without the whole
    logits: ``tokens`` rows at a time (default `auto_tokens`); backward's slices are made inside
    ``scope()`` (the tracker's activations scope, as a recomputation's are), a ZeRO-3 weight gathered
    inside ``param_scope()`` (its parameters scope)."""
    with gathered(weight, bias, scope=param_scope):  # autograd records the weight's whole shape (ZeRO-3)
        tokens = tokens or auto_tokens(weight)
        return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, target, tuple(casts), ignore_index, reduction,
                                               max(1, int(tokens)), scope, param_scope)


def auto_tokens(weight: torch.Tensor) -> int:
    """Rows per slice when ``chunk_tokens`` is auto: a slice's fp32 logits as large as the head's
    weight (hidden / 2 rows for a bf16 head), so each slice's matmuls reuse the weight over as many
    rows as it has columns per element byte, and the slices together stay within about twice the
    weight's bytes."""
    shape = getattr(weight, "ds_shape", None) or weight.shape  # a released ZeRO-3 weight holds no data
    return max(1, shape[-1] * weight.element_size() // 4)


def defer(module: nn.Module, args: tuple, kwargs: dict, consumer: Callable[..., Optional[torch.Tensor]],
          materialize: Callable[[HeadCall], torch.Tensor]) -> Optional[DeferredLogits]:
    """The head's output as `DeferredLogits`, or ``None`` where the call cannot be deferred (not one
    tensor input, autocast, an input that is itself deferred)."""
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or isinstance(args[0], DeferredLogits):
        return None
    hidden = args[0]
    if torch.is_autocast_enabled(hidden.device.type) or hidden.ndim < 1:
        return None
    weight, bias = module.weight, module.bias
    if weight.ndim != 2 or weight.device != hidden.device or weight.dtype != hidden.dtype:
        return None
    call = HeadCall(hidden, weight, bias, consumer, materialize)
    return DeferredLogits(call, torch.Size((*hidden.shape[:-1], weight.shape[0])), hidden.dtype, tokens=hidden)


__all__ = ["CHUNK", "ChunkedLinearCrossEntropy", "DeferredLogits", "HeadCall", "auto_tokens", "chunked_cross_entropy",
           "defer", "head_modules", "is_head", "linear_backward_by_slices"]
