"""One removable forward wrapper per module the plugin acts on, and what the wrappers share.

The wrapper replaces ``module.forward`` on the instance (`xirang_ds.hooks.wrap_method`), so module
names, ``state_dict`` keys and the module's own hooks stay as they are, and removing the handle
restores the original forward. Each call runs the module's current option:

* ``keep``: the plain forward (inside a module whose tensors are packed, a pass-through pack
  context so this module's tensors stay as they are);
* ``recompute`` / ``selective_recompute``: the forward under non-reentrant checkpointing;
* ``compress`` / ``quantize`` / ``sparsify`` / ``offload``: the forward inside a `PackContext` with
  that option's handler; offload also hooks the outputs' gradients to prefetch in backward;
* ``recompute_offload``: the checkpointed forward inside the offload pack context, which then
  holds the checkpoint's inputs in host memory;
* ``recompute_tiled`` / ``recompute_tiled_offload``: `tiled.run_tiled` (slices of tokens), the latter
  inside the offload pack context; a call it cannot slice recomputes whole;
* ``chunk`` (output heads, and every head while profiling): the head returns `DeferredLogits` and
  ``cross_entropy`` on them (Megatron: the model's ``compute_language_model_loss``) runs chunked
  (`head_loss`, `head_megatron`); while profiling it runs whole inside the head's frame, so the
  head's profile holds its loss;
* ``recompute`` on a module whose inputs are identical on every tensor-parallel rank, with
  ``distribute_saved_inputs``: the checkpointed forward inside a `ShardHandler` pack context, which
  holds 1/tp of the checkpoint's inputs per rank and all-gathers them when backward recomputes.

Options change at run time (after profiling, from the monitor) by setting `ModuleWrapper.option`.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional

import torch

from xirang_ds.hooks import wrap_method
from xirang_ds.plugins.activations import head_loss, head_zero3
from xirang_ds.plugins.activations.handlers import CodecHandler, OffloadHandler
from xirang_ds.plugins.activations.offload import Offloader
from xirang_ds.plugins.activations.planner import chunk_rows
from xirang_ds.plugins.activations.profile import Profiler
from xirang_ds.plugins.activations.recompute import (
    RecomputeScope,
    RngStates,
    full_context,
    run_checkpointed,
    selective_context,
    without_cache_writes,
)
from xirang_ds.plugins.activations.selection import RECOMPUTE_OPTIONS
from xirang_ds.plugins.activations.saved import Eligibility, PackContext
from xirang_ds.plugins.activations.storage import PayloadStorage
from xirang_ds.plugins.activations.tiled import DEFAULT_TILES, run_tiled, tileable

OFFLOADED_INPUTS = ("recompute_offload", "recompute_tiled_offload")
"""Options that recompute with the inputs they keep held in host memory."""


class _KeepHandler:
    """Packs nothing: the pass-through context of a kept module inside a packing one, and the profiler's
    handler on a fake trace (`trace_plan`), where every saved tensor stays for the trace to measure."""

    def begin_call(self) -> None:
        return None

    def store(self, flat: torch.Tensor, call: None) -> None:
        return None  # the tensor stays as it is


def never(t: torch.Tensor) -> bool:
    """Eligible for nothing: a pack context that keeps every saved tensor as it is."""
    return False


class Runtime:
    """Handlers, offloader, scopes and (while profiling) the profiler, shared by all wrappers.

    Args:
        device: the training device.
        min_tensor_bytes, prefetch, block_size, threshold: from the section.
        host_tier: the tracker's host-tier context factory.
        scope: the tracker's activations-scope factory (recomputation, fetched bytes).
        mark: gives a tensor the activations role (decoded tensors).
        synchronize: accelerator synchronize around recomputations (DeepSpeed's
            ``synchronize_checkpoint_boundary``), or ``None``.
        timings: list collecting ``(module, seconds)`` per recomputation (DeepSpeed's ``profile``).
        rng: the framework's own generator states a recomputation restores (Megatron's RNG tracker),
            or ``None``.
        distribute: the handler that shards recomputed modules' inputs over the tensor-parallel group
            (`ShardHandler`), or ``None``.
        arenas: tensors of persistent arenas whose views are never packed (`Eligibility`), or ``None``.
        host_ledger: the `xirang_ds.memory.host_ledger.HostLedger` offload's host buffers are made in, whose
            budget (``xirang.host_memory_budget``, over every host tier) caps them; ``None``: uncapped.
    """

    def __init__(self, device: torch.device, min_tensor_bytes: int, prefetch: int, block_size: int,
                 threshold: float, host_tier: Callable[[], ContextManager], scope: Callable[[], ContextManager],
                 mark: Optional[Callable[[torch.Tensor], None]] = None,
                 param_scope: Optional[Callable[[], ContextManager]] = None,
                 synchronize: Optional[Callable[[], None]] = None, timings: Optional[list] = None,
                 rng: Optional[RngStates] = None, arenas: Optional[Callable[[], list[torch.Tensor]]] = None,
                 distribute: Optional[Any] = None, host_ledger: Optional[Any] = None):
        self.device = device
        self.distribute = distribute
        self.rng = rng
        self.scope = scope
        self.param_scope = param_scope
        """Where a ZeRO-3 head's weight is gathered outside its module's hooks (the tracker's parameters)."""
        self.synchronize = synchronize
        self.timings = timings
        self.eligible = Eligibility(device.type, min_tensor_bytes, arenas)
        self.storage = PayloadStorage(host_tier)
        self.offloader = Offloader(device, prefetch, host_tier, scope, ledger=host_ledger)
        offload = OffloadHandler(self.offloader)
        self.handlers: dict[str, Any] = {
            "compress": CodecHandler("compress", self.storage, mark=mark),
            "quantize": CodecHandler("quantize", self.storage, block_size=block_size, mark=mark),
            "sparsify": CodecHandler("sparsify", self.storage, threshold=threshold, mark=mark),
            "offload": offload,
            "recompute_offload": offload,
            "recompute_tiled_offload": offload,
        }
        self.keep_handler = _KeepHandler()
        self.profiler: Optional[Profiler] = None
        self.head_stretch: Optional[Callable[[bool], None]] = None
        """While profiling with an ``auto`` budget: told when an output head's whole loss begins
        (``True``) and ends (``False``), in forward and in backward (`pricing.OtherPeak.exclude`)."""
        self.head_room: Optional[Callable[[], int]] = None
        """While profiling with an ``auto`` budget: device bytes the memory budget leaves now; a head
        whose whole logits would not fit there is profiled chunked (`ModuleWrapper._cross_entropy`)."""

    def recompute_scope(self, name: str) -> RecomputeScope:
        """The context entered around each recomputation of module ``name``."""
        return RecomputeScope(self.scope, self.synchronize, self.timings, name)


class ModuleWrapper:
    """The forward of one module under its current option.

    Attributes:
        name: full module name.
        option: the option applied (``None``: plain forward).
        passthrough: an ancestor packs its tensors, so ``keep`` must shield this module.
        must_save: profile-selected ``(op, index)`` for selective recompute (``None``: all
            expensive ops).
        distributable: the module's inputs are identical on every tensor-parallel rank, so under
            ``recompute`` they may be held as shards (when the runtime has a ``distribute`` handler).
        head: for an output head, how its calls are deferred while profiling and under ``chunk``
            (`head_loss.defer`, or `head_megatron.defer` for Megatron's output layer); ``None`` otherwise.
        fixed_chunk: a head the block fixes to ``chunk``: profiling passes run it chunked too.
        chunk_tokens: rows per slice under ``chunk``: the section's ``chunk_tokens``, or the slice the
            planner chose (``None``: `head_loss.auto_tokens`).
    """

    def __init__(self, name: str, module: torch.nn.Module, runtime: Runtime):
        self.name = name
        self.module = module
        self.runtime = runtime
        self.passthrough = False
        self.distributable = False
        self.head: Optional[Callable] = None
        self.fixed_chunk = False
        self.chunk_tokens: Optional[int] = None
        self.must_save: Optional[frozenset] = None
        self.reserve: Optional[Any] = None
        """Under a lossy option with a reserve: where storages go that break its bound (`reserve.Reserve`)."""
        self._option: Optional[str] = None
        self._context_fn: Optional[Callable[[], tuple]] = None
        self.tiles = DEFAULT_TILES
        self.handle = self._wrap()

    def _wrap(self) -> Any:
        return wrap_method(self.module, "forward", self.forward)

    def _pack(self, handler: Any, eligible: Callable[[torch.Tensor], bool], reserve: Any = None) -> PackContext:
        return PackContext(handler, eligible, reserve)

    @property
    def option(self) -> Optional[str]:
        return self._option

    def apply(self, option: Optional[str], must_save: Optional[frozenset] = None, passthrough: bool = False,
              tiles: int = 0) -> None:
        """Run the next calls under ``option`` (``None``: the plain forward); ``tiles``: the slices of
        ``recompute_tiled`` (0: `tiled.DEFAULT_TILES`)."""
        self.must_save = must_save
        self.passthrough = passthrough
        self._option = option
        self.tiles = tiles or DEFAULT_TILES
        scope = self.runtime.recompute_scope(self.name)
        if option == "selective_recompute":
            self._context_fn = selective_context(scope, must_save)
        elif option in ("recompute", "recompute_offload", "recompute_tiled", "recompute_tiled_offload"):
            self._context_fn = full_context(scope)
        else:
            self._context_fn = None

    def remove(self) -> None:
        """Restore the module's own forward."""
        self.handle.remove()

    # --------------------------------------------------------------------------------------------
    def forward(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """The module's forward under its option (plain without grad, framed while profiling)."""
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        rt = self.runtime
        profiling = rt.profiler is not None and bool(rt.profiler.stack)
        defer = self.head
        if defer is not None and (profiling or self._option == head_loss.CHUNK) and not torch.compiler.is_compiling():
            deferred = defer(self.module, args, kwargs, self._cross_entropy, lambda call: self._whole(original, call))
            if deferred is not None:
                return deferred
        if profiling:
            with rt.profiler.frame(self.name, args, kwargs):
                return original(*args, **kwargs)
        option = self._option
        if option is None or option == "keep":
            if not self.passthrough:
                return original(*args, **kwargs)
            with self._pack(rt.keep_handler, never):
                return original(*args, **kwargs)
        if option in RECOMPUTE_OPTIONS:
            kwargs = without_cache_writes(self.module, kwargs)
        if option == "recompute" and self.distributable and rt.distribute is not None:
            with self._pack(rt.distribute, rt.eligible):
                return run_checkpointed(original, args, kwargs, self._context_fn, rt.rng)
        tiled = (option in ("recompute_tiled", "recompute_tiled_offload") and tileable(args, kwargs)
                 and rt.rng is None and not any(map(head_zero3.is_zero3, self.module.parameters())))
        if option == "recompute_tiled" and tiled:
            return run_tiled(original, args[0], kwargs, self.tiles, self.module, rt.recompute_scope(self.name))
        if option in ("recompute", "selective_recompute", "recompute_tiled"):  # a call it cannot slice: whole
            return run_checkpointed(original, args, kwargs, self._context_fn, rt.rng)
        with self._pack(rt.handlers[option], rt.eligible, self.reserve) as ctx:
            if tiled:
                out = run_tiled(original, args[0], kwargs, self.tiles, self.module, rt.recompute_scope(self.name))
            elif option in OFFLOADED_INPUTS:
                out = run_checkpointed(original, args, kwargs, self._context_fn, rt.rng)
            else:
                out = original(*args, **kwargs)
        if ctx.pushed and option in ("offload", *OFFLOADED_INPUTS) and rt.offloader.stream is not None:
            hook_outputs(out, ctx.call, rt.offloader)
        return out

    # output heads ------------------------------------------------------------------------------
    def _whole(self, original: Callable, call: "head_loss.HeadCall") -> torch.Tensor:
        """The head's own forward on its input, when its logits are needed whole (while profiling, in
        the head's frame unless the loss's frame is already open)."""
        profiler = self.runtime.profiler
        if head_zero3.is_zero3(call.weight) and type(self.module).forward is torch.nn.Linear.forward:
            # DeepSpeed released the weight when the head's forward returned
            original = lambda hidden: head_zero3.gathered_linear(  # noqa: E731
                hidden, call.weight, call.bias, self.runtime.param_scope)
        args, kwargs = call.rest
        if profiler is None or not profiler.stack or profiler.stack[-1].profile.name == self.name:
            out = original(call.hidden, *args, **kwargs)
        else:
            with profiler.frame(self.name, (call.hidden,), {}):
                out = original(call.hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # Megatron's layers return (output, bias)

    def _cross_entropy(self, logits: "head_loss.DeferredLogits", target: torch.Tensor, whole: Callable,
                       chunked: Callable) -> Optional[torch.Tensor]:
        """The loss on this head's deferred logits (`head_loss.HeadCall`): chunked under ``chunk``; while
        profiling as `_profile_cross_entropy` runs it; otherwise ``None`` (computed whole)."""
        call = logits.call
        profiler = self.runtime.profiler
        if profiler is not None and profiler.stack:
            return self._profile_cross_entropy(profiler, logits, target, whole, chunked)
        if self._option != head_loss.CHUNK:
            return None
        return chunked(logits.tokens, call.weight, call.bias, logits.casts, self.chunk_tokens, self.runtime.scope,
                       self.runtime.param_scope)

    def _profile_cross_entropy(self, profiler: Profiler, logits: "head_loss.DeferredLogits", target: torch.Tensor,
                               whole: Callable, chunked: Callable) -> torch.Tensor:
        """The head and its loss inside the head's frame, whole (or chunked where the whole logits
        would not fit what the budget leaves), with what the chunk would keep and hold recorded, and
        the stretch told to the budget's peak (`Runtime.head_stretch`) in forward and in backward."""
        call = logits.call
        told, room = self.runtime.head_stretch, self.runtime.head_room
        p = profiler.profile(self.name)
        z, y = logits.element_size(), call.weight.element_size()
        p.chunk_calls += 1
        p.chunk_bytes += logits.tokens.untyped_storage().nbytes() + target.untyped_storage().nbytes()
        p.chunk_tokens = max(p.chunk_tokens, logits.shape[0])
        p.chunk_rows = self.chunk_tokens or head_loss.auto_tokens(call.weight)
        p.chunk_fixed = int(self.chunk_tokens is not None)
        # a slice's backward holds three rows of the loss's dtype (log-probabilities, their
        # gradient, the logits'), or one and the gradient in the head's dtype twice
        p.chunk_row_bytes = max(p.chunk_row_bytes, logits.shape[1] * max(3 * z, z + 2 * y))
        # and in forward the logits in the head's dtype and the loss's, then those and the log-probabilities
        p.chunk_forward_row_bytes = max(p.chunk_forward_row_bytes, logits.shape[1] * max(y + z, 2 * z))
        p.chunk_vocab, p.chunk_hidden = logits.shape[1], logits.tokens.shape[-1]
        p.chunk_head_bytes, p.chunk_loss_bytes = y, z
        # beyond what it saves, the whole head and loss hold the logits in the head's dtype and the
        # loss's in forward, and two of the loss's dtype in backward (the logits' gradient)
        p.keep_transient_bytes = max(p.keep_transient_bytes, logits.numel() * max(2 * z, z + y))
        whole_bytes = logits.numel() * z + p.keep_transient_bytes
        if told is not None:
            told(True)
        with profiler.frame(self.name, (call.hidden,), {}):
            if self.fixed_chunk or (room is not None and whole_bytes > room()):
                # a head fixed to chunk runs as it will after profiling; one whose whole logits would
                # not fit what the budget leaves is profiled chunked (the smallest slice); both count
                # what the whole loss would save, its log-probabilities
                rows = self.chunk_tokens if self.fixed_chunk else chunk_rows(p)[-1]
                loss = chunked(logits.tokens, call.weight, call.bias, logits.casts, rows, self.runtime.scope,
                               self.runtime.param_scope)
                for frame in profiler.stack:  # the head's frame and every one around it (the model's)
                    frame.profile.saved_bytes += logits.numel() * z
                    frame.profile.largest_bytes = max(frame.profile.largest_bytes, logits.numel() * z)
                    frame.profile.compress_bytes += logits.numel() * z
            else:
                loss = whole(logits.whole("cross_entropy"))
        if told is not None:
            told(False)
            if loss.requires_grad and call.hidden.requires_grad:
                loss.register_hook(lambda grad: told(True))
                call.hidden.register_hook(lambda grad: told(False))
        return loss


def hook_outputs(out: Any, group: Any, offloader: Offloader) -> None:
    """Prefetch when backward reaches this call: a hook on each output that requires grad."""
    def reached(grad: torch.Tensor) -> None:
        offloader.backward_reached(group)

    stack = [out]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                value.register_hook(reached)
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
