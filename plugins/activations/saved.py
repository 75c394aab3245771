"""Saved-tensor hooks for one module call: each saved storage is packed once, views rebuilt on unpack.

Backward often saves several views of one storage (attention saves q, k and v, all views of the
qkv projection's output). Packing works on storages, not tensors: the first view of a storage
packs the whole storage through a `Handler` (a codec, the offloader, the profiler); later views of
it only record their size, stride and offset, and unpack rebuilds each view with ``as_strided``
over the one restored storage. The bytes freed are exactly the bytes the saved views kept alive.
A view that ends in the first half of its storage packs only the storage's elements up to its end
(`storage_flat`), which later views inside them share.

Every unpacked tensor has the size, stride and storage offset autograd saved: a compiled backward
asserts sizes and strides (``assert_size_stride``), and an explicit ``as_strided`` in a backward
addresses storage offsets. A backward that keeps its graph (``retain_graph=True``: grad_release's
``two_pass`` norm pass) leaves every handler's copy restorable for the next backward.

Composition (``saved_tensors_hooks`` applies only the innermost pair): at entry `PackContext`
reads the pair active outside it. Inside a ``torch.utils.checkpoint`` region it stays out of the
way (the checkpoint's hooks must see every saved tensor). Inside another `PackContext` (an
enclosing module with its own option) it replaces that one: the innermost module's option wins,
composed with whatever the enclosing one was composed with. Any other outer pair is composed: its
pack runs first and ours packs what it returns when that is a tensor; unpack runs in reverse.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Optional, Protocol

import torch

from xirang_ds.compat.torch import (
    HookPair,
    current_saved_tensors_hooks,
    graph_retained,
    is_checkpoint_hook,
    is_fake,
    outside_dynamo,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    storage_key,
)
from xirang_ds.plugins.activations.codecs import BoundExceeded

_KEEP = object()


class Handler(Protocol):
    """What one option does with a saved storage."""

    def begin_call(self) -> Any:
        """Per-call state (an offload group), handed to `store`."""

    def store(self, flat: torch.Tensor, call: Any) -> Any:
        """Take the storage's bytes (``flat``: 1-D, its dtype); ``None`` keeps the tensor as is."""

    def restore(self, holder: Any, dtype: torch.dtype, numel: int, keep: bool) -> torch.Tensor:
        """The flat tensor back on the device; with ``keep``, ``holder`` stays restorable (a backward
        over a retained graph: the next backward restores it again)."""


class StorageIds:
    """Ids of live storages: a storage keeps its id while it lives; a new storage at a freed one's
    address gets a new id (``_cdata`` alone is reused after a free)."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}
        self._finalizers: dict[int, Any] = {}
        self._next = itertools.count()

    def __call__(self, storage: torch.UntypedStorage) -> int:
        key = storage_key(storage)
        known = self._ids.get(key)
        if known is not None:
            return known
        ident = self._ids[key] = next(self._next)
        self._finalizers[key] = weakref.finalize(storage, StorageIds._forget, weakref.ref(self), key)
        return ident

    @staticmethod
    def _forget(ref: "weakref.ref[StorageIds]", key: int) -> None:
        self = ref()
        if self is not None:
            self._ids.pop(key, None)
            self._finalizers.pop(key, None)

    def clear(self) -> None:
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()
        self._ids.clear()


class PackedStorage:
    """A storage held by a handler (its first ``numel`` elements); restored once per backward and
    shared by all its views."""

    __slots__ = ("holder", "handler", "dtype", "numel", "views", "pending", "_flat", "_weak")

    def __init__(self, holder: Any, handler: Handler, dtype: torch.dtype, numel: int):
        self.holder, self.handler, self.dtype, self.numel = holder, handler, dtype, numel
        self.views = 0
        self.pending = 0
        self._flat: Optional[torch.Tensor] = None
        self._weak: Optional[weakref.ref] = None

    def add_view(self) -> None:
        self.views += 1
        self.pending += 1

    def materialize(self) -> torch.Tensor:
        flat = self._flat
        if flat is None and self._weak is not None:
            flat = self._weak()  # a view unpacked again while the restored storage still lives
        if flat is None:
            flat = self.handler.restore(self.holder, self.dtype, self.numel, graph_retained())
            self._weak = weakref.ref(flat)
        if self.pending <= 0:  # a later backward over a retained graph unpacks every view again
            self.pending = self.views
        self.pending -= 1
        self._flat = flat if self.pending > 0 else None  # hold it only for views still to come
        return flat


class SavedView:
    """What autograd holds instead of a saved tensor."""

    __slots__ = ("packed", "size", "stride", "offset")

    def __init__(self, packed: PackedStorage, size: torch.Size, stride: tuple, offset: int):
        self.packed, self.size, self.stride, self.offset = packed, size, stride, offset


class _Composed:
    __slots__ = ("value", "ours")

    def __init__(self, value: Any, ours: bool):
        self.value, self.ours = value, ours


class Eligibility:
    """Which saved tensors a handler may take: plain strided tensors on the training device that
    are not parameters, buffers or views of a persistent arena, and have at least ``min_bytes`` in
    their storage.

    A persistent arena (Megatron's ``GlobalMemoryBuffer``) hands the same storage to one layer after
    another: packing works per storage (one pack serves every later view of it), so a view of such a
    storage must never be packed, or a later layer's view would be restored with an earlier layer's
    bytes. It stays with autograd, exactly as without the plugin.

    Args:
        device_type: the training device type.
        min_bytes: smaller storages stay as they are.
        arenas: returns the tensors of persistent arenas now (asked at every check, since an arena
            grows during the first forward); ``None``: none.
    """

    def __init__(self, device_type: str, min_bytes: int,
                 arenas: Optional[Callable[[], list[torch.Tensor]]] = None, fake: bool = False):
        self.device_type = device_type
        self.min_bytes = min_bytes
        self.arenas = arenas
        self.fake = fake
        """Tensors of a ``FakeTensorMode`` (the estimator's trace): storages are told apart by identity,
        as they have no addresses."""
        self.model_storages: frozenset[int] = frozenset()

    def storage_id(self, st: torch.UntypedStorage) -> int:
        """What tells storages apart: the address, or the storage's identity under a fake trace."""
        return storage_key(st) if self.fake else st.data_ptr()

    def refresh(self, model: torch.nn.Module) -> None:
        """Remember the storages of parameters and buffers (ZeRO's flat buffers included)."""
        ids = set()
        for t in list(model.parameters()) + list(model.buffers()):
            if t.numel():
                ids.add(self.storage_id(t.untyped_storage()))
        self.model_storages = frozenset(ids)

    def plain(self, t: torch.Tensor) -> bool:
        """A plain strided tensor on the training device (a fake one under a fake trace)."""
        kind = type(t) is torch.Tensor or (self.fake and is_fake(t))
        return kind and t.layout == torch.strided and t.device.type == self.device_type

    def __call__(self, t: torch.Tensor) -> bool:
        if not self.plain(t):
            return False
        st = t.untyped_storage()
        ident = self.storage_id(st)
        if st.nbytes() < self.min_bytes or ident in self.model_storages:
            return False
        return self.arenas is None or all(self.storage_id(a.untyped_storage()) != ident for a in self.arenas())


def span_elements(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last in its storage (0 when empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))


def storage_flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 1-D tensor of ``t``'s dtype over its whole storage, or only over the storage's elements up to
    ``t``'s last when ``t`` ends in the first half of it (the second value says which).

    Either way ``t`` is ``as_strided(flat, t.size(), t.stride(), t.storage_offset())``: its size,
    stride and storage offset hold over what is packed (permuted, sliced, expanded and channels-last
    views alike), and so they do over what is restored."""
    st = t.untyped_storage()
    el = t.element_size()
    end = t.storage_offset() + span_elements(t)
    part = bool(st.nbytes() % el) or 2 * end * el < st.nbytes()
    with torch.no_grad():
        return t.new_empty(0).set_(st, 0, (end if part else st.nbytes() // el,), (1,)), part


class PackContext:
    """The saved-tensor hooks of one module call.

    Args:
        handler: what to do with eligible storages.
        eligible: which tensors the handler may take.
        reserve: where a storage goes that a lossy handler cannot encode within its bound (`reserve.Reserve`:
            ``begin_call()``, ``store(flat, error)`` giving ``(holder, handler)``, ``taken``), or ``None``:
            the storage stays as it is.
    """

    def __init__(self, handler: Handler, eligible: Callable[[torch.Tensor], bool], reserve: Any = None):
        self.handler = handler
        self.eligible = eligible
        self.reserve = reserve
        self.call: Any = None
        self.pushed = False
        self._outer: Optional[HookPair] = None
        self._ids = StorageIds()
        self._seen: dict[tuple[int, torch.dtype], Any] = {}

    def __enter__(self) -> "PackContext":
        outer = current_saved_tensors_hooks()
        if is_checkpoint_hook(outer):
            return self
        owner = getattr(getattr(outer[0], "__wrapped__", outer[0]), "__self__", None) if outer is not None else None
        if isinstance(owner, PackContext):  # an enclosing module of ours: the innermost option wins
            outer = owner._outer
        self._outer = outer
        self.call = self.handler.begin_call()
        if self.reserve is not None:
            self.reserve.begin_call()
        # called from inside compiled code too (a compiled module's saved tensors), where Dynamo must
        # not trace them
        push_saved_tensors_hooks(outside_dynamo(self._pack_hook), outside_dynamo(self._unpack_hook))
        self.pushed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pushed:
            pop_saved_tensors_hooks()
            self.pushed = False
        self._seen = {}
        self._ids.clear()

    # hooks ----------------------------------------------------------------------------------------
    def _pack_hook(self, t: torch.Tensor) -> Any:
        if self._outer is None:
            return self.pack(t)
        packed = self._outer[0](t)
        if isinstance(packed, torch.Tensor):
            return _Composed(self.pack(packed), True)
        return _Composed(packed, False)

    def _unpack_hook(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Composed):
            value = unpack(packed.value) if packed.ours else packed.value
            return self._outer[1](value)
        return unpack(packed)

    def pack(self, t: torch.Tensor) -> Any:
        """Pack one saved tensor (a view of a packed storage, or the tensor itself)."""
        if not self.eligible(t) or not t.numel():
            return t.detach()
        key = (self._ids(t.untyped_storage()), t.dtype)
        packed = self._seen.get(key)
        if packed is _KEEP:
            return t.detach()
        if packed is None or packed.numel < t.storage_offset() + span_elements(t):
            flat, part = storage_flat(t)
            holder, handler = self._store(flat)
            if holder is None:
                if not part:
                    self._seen[key] = _KEEP
                return t.detach()
            packed = self._seen[key] = PackedStorage(holder, handler, flat.dtype, flat.numel())
        packed.add_view()
        return SavedView(packed, t.shape, t.stride(), t.storage_offset())


    def _store(self, flat: torch.Tensor) -> tuple[Any, Handler]:
        """The handler's holder of ``flat``, or the reserve's once a lossy bound broke in this module."""
        if self.reserve is not None and self.reserve.taken:
            return self.reserve.store(flat, None)
        try:
            return self.handler.store(flat, self.call), self.handler
        except BoundExceeded as e:
            error = e.with_traceback(None)  # the encoder's frame (its working copies) goes before the reserve stores
        if self.reserve is None:
            return None, self.handler  # stays as it is, above the plan
        return self.reserve.store(flat, error)


def unpack(packed: Any) -> torch.Tensor:
    """The tensor autograd saved, from what `PackContext.pack` returned."""
    if isinstance(packed, torch.Tensor):
        return packed
    flat = packed.packed.materialize()
    return torch.as_strided(flat, packed.size, packed.stride, packed.offset)

