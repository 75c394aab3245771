"""Recompute through ``torch.utils.checkpoint`` (non-reentrant), full or selective.

Full recompute keeps only the module's inputs and runs its forward again when backward first needs
one of its saved tensors. Selective recompute uses PyTorch's selective checkpoint contexts
(``create_selective_checkpoint_contexts``): the outputs of expensive ops (matmuls, attention) are
cached in forward and everything else (norms, activation functions, copies) is recomputed. With a
profile, only the expensive outputs that backward actually saved are cached, by their index among
the calls of the same op in the module's forward (the index SAC itself uses, so the profile and
the policy agree); without one, every output of an expensive op is cached (torchtitan's rule).

Tensors the recomputation creates are counted as activations (the tracker's activations scope),
and the inputs the checkpoint keeps go through the saved-tensor hooks active around it, so an
offload context around the checkpoint holds them in host memory (DeepSpeed's ``cpu_checkpointing``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import defaultdict
from typing import Any, Callable, ContextManager, Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from xirang_ds.compat.torch import op_schema, uncompiled
from xirang_ds.compat.transformers import is_checkpointing_layer, reads_cache_only

logger = logging.getLogger("xirang_ds")

HEAVY_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution", "aten::_scaled_mm",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable", "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
})
"""Ops whose outputs selective recompute keeps: expensive per byte they produce."""

_OP_KEYS: dict[Any, tuple[str, bool]] = {}


def op_key(func: Any) -> tuple[str, bool]:
    """``(name with overload, is_heavy)`` of an aten op (cached)."""
    known = _OP_KEYS.get(func)
    if known is None:
        schema = op_schema(func)
        base = schema.name if schema is not None else str(func)
        known = (str(func), base in HEAVY_OPS)
        _OP_KEYS[func] = known
    return known


class RecomputeScope:
    """Entered around each recomputation: the tracker's activations scope, plus DeepSpeed's
    ``synchronize_checkpoint_boundary`` (synchronize before and after) and ``profile`` (time it).

    ``scope()`` is the context itself, and it may be entered again after it exits: the checkpoint
    makes its recompute context once per forward and enters it at every recomputation, which is
    once per backward, and twice for a graph that a first backward retained (grad_release's
    ``two_pass``).

    Args:
        scope: factory of the tracker's activations scope.
        synchronize: accelerator synchronize, or ``None``.
        timings: list to append ``(module name, seconds)`` to, or ``None``.
        name: the module's name for ``timings``.
    """

    def __init__(self, scope: Callable[[], ContextManager], synchronize: Optional[Callable[[], None]] = None,
                 timings: Optional[list] = None, name: str = ""):
        self.scope, self.synchronize, self.timings, self.name = scope, synchronize, timings, name
        self._open: list[tuple[ContextManager, float]] = []

    def __call__(self) -> "RecomputeScope":
        return self

    def __enter__(self) -> None:
        if self.synchronize is not None:
            self.synchronize()
        start = time.perf_counter()
        inner = self.scope()
        inner.__enter__()
        self._open.append((inner, start))

    def __exit__(self, *exc: Any) -> None:
        inner, start = self._open.pop()
        try:
            inner.__exit__(*exc)
        finally:
            if self.synchronize is not None:
                self.synchronize()
            if self.timings is not None:
                self.timings.append((self.name, time.perf_counter() - start))


class _Both:
    """Two context managers entered as one (SAC's recompute mode and our scope)."""

    def __init__(self, first: ContextManager, second: ContextManager):
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)


def full_context(recompute_scope: Callable[[], ContextManager]) -> Callable[[], tuple]:
    """``context_fn`` of full recompute."""
    return lambda: (contextlib.nullcontext(), recompute_scope())


def selective_context(recompute_scope: Callable[[], ContextManager],
                      must_save: Optional[frozenset]) -> Callable[[], tuple]:
    """``context_fn`` of selective recompute.

    Args:
        must_save: ``{(op name, index)}`` to cache (from the profile), or ``None`` to cache every
            output of an op in `HEAVY_OPS`.
    """

    def context_fn() -> tuple:
        counter: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            name, heavy = op_key(func)
            if must_save is None:
                keep = heavy
            else:
                idx = counter[name]
                counter[name] = idx + 1
                keep = (name, idx) in must_save
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(policy)
        return forward_ctx, _Both(recompute_ctx, recompute_scope())

    return context_fn


_CACHE_KWARGS = ("cache", "layer_past", "past_key_value", "past_key_values")
"""Keyword arguments by which Hugging Face layers receive the KV cache they write (``cache`` and
``layer_past`` in transformers 5, ``past_key_value(s)`` before)."""

_TOLD: set[type] = set()


def without_cache_writes(module: torch.nn.Module, kwargs: dict) -> dict:
    """``kwargs`` for a recomputed call of ``module``: a Hugging Face decoder layer does not write its
    KV cache, as under HF's own gradient checkpointing.

    A recomputation runs the layer's forward again; a layer called with a cache would append its keys
    and values a second time, so the recomputed attention would see the forward's keys twice (other
    sizes and strides than autograd saved: a compiled layer's backward stops on them). Training never
    reads the cache, and HF drops it for a checkpointed layer (transformers 5.24
    ``modeling_layers.py`` ``GradientCheckpointingLayer.forward_with_checkpointing``): ``use_cache``
    becomes False, and unless the layer only reads its cache (``_can_checkpoint_with_cache``) the cache
    is left out. Other modules' keyword arguments are returned as they are.
    """
    layer = uncompiled(module)
    if not is_checkpointing_layer(layer):
        return kwargs
    dropped = {"use_cache": False} if kwargs.get("use_cache") else {}
    if not reads_cache_only(layer):
        dropped.update((key, None) for key in _CACHE_KWARGS if kwargs.get(key) is not None)
    if not dropped:
        return kwargs
    if type(layer) not in _TOLD:
        _TOLD.add(type(layer))
        logger.info("xirang activations: a recomputed %s writes no KV cache (use_cache=False, cache=None), as under "
                    "Hugging Face's own gradient checkpointing", type(layer).__name__)
    return {**kwargs, **dropped}


RngStates = tuple[Callable[[], Any], Callable[[Any], None]]
"""``(get, set)`` of generator states the framework keeps outside torch's own (Megatron's RNG tracker)."""


def run_checkpointed(original: Callable, args: tuple, kwargs: dict, context_fn: Callable[[], tuple],
                     rng: Optional[RngStates] = None) -> Any:
    """``original(*args, **kwargs)`` under non-reentrant checkpointing with ``context_fn``.

    ``preserve_rng_state`` restores torch's generators for the recomputation. ``rng`` adds the
    framework's own: their states at this forward are put back for the recomputation and the states
    of that moment restored after it, as ``megatron.core.tensor_parallel.checkpoint`` does for its
    RNG tracker (random.py ``CheckpointFunction``), so dropout inside tensor-parallel regions draws
    the same masks and the run's later draws are not shifted.

    Tensor keyword arguments are passed to the checkpoint positionally: it saves positional inputs
    through the saved-tensor hooks active around it (an offload context then holds them in host
    memory) and only closes over keyword ones. Megatron's ``TransformerBlock`` calls each layer with
    keywords only (``hidden_states=``, ``attention_mask=``).
    """
    fn, args = _tensors_positional(original, args, kwargs)
    if rng is not None:
        fn = _with_forward_states(fn, *rng)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, preserve_rng_state=True)


def _tensors_positional(original: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """``(fn, args)`` with ``fn(*args)`` calling ``original(*args, **kwargs)``, where the tensors among
    ``kwargs`` are moved to the end of ``args``."""
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    others = {k: v for k, v in kwargs.items() if k not in keys}
    if not keys:
        return (functools.partial(original, **others) if others else original), args
    count = len(args)

    def fn(*values: Any) -> Any:
        return original(*values[:count], **others, **dict(zip(keys, values[count:])))

    return fn, args + tuple(kwargs[k] for k in keys)


def _with_forward_states(fn: Callable, get: Callable[[], Any], set_: Callable[[Any], None]) -> Callable:
    """``fn`` whose calls after the first (recomputations) run with the states ``get`` returned at the first."""
    forward_states = get()
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args)
        now = get()
        set_(forward_states)
        try:
            return fn(*args)
        finally:
            set_(now)

    return run


def timings_line(timings: list) -> str:
    """One line on a step's recomputations (DeepSpeed's ``activation_checkpointing.profile``); clears them."""
    total = sum(s for _, s in timings)
    line = f"{len(timings)} recomputations took {total * 1e3:.1f} ms"
    timings.clear()
    return line
