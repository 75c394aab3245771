"""Casting arguments, and saving a cast's source instead of the cast for backward.

An op that runs on a 16-bit copy of a weight would make autograd save that copy until backward:
2 bytes per parameter alive from forward to backward, next to the fp32 master. `CastSet` remembers
each copy it made and of what; `CastSet.saving()` is a ``saved_tensors_hooks`` context in which
autograd stores, for a tensor on one of those copies, only a `Recast` (the source and the view
geometry), and `Recast.unpack` makes the copy again when backward needs it. The same holds for
widening casts (a 16-bit activation widened for an fp32-listed op): saving the 16-bit source and
widening it again in backward is exact and halves the saved bytes.

Hooks that were active outside (activation offload, compression, checkpointing) keep working:
every tensor that is not one of our copies is passed to them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from xirang_ds.compat.torch import saved_tensors_hooks_enabled, storage_key, top_saved_tensors_hooks, version, view_base

WEIGHT = "weight"
UPCAST = "upcast"
_PARAMETER = torch.nn.Parameter



FAKE_PARAMETERS: set[int] = set()
"""``id`` of the parameters of a model traced under ``FakeTensorMode`` (`fake_parameters`), where a
parameter is a plain ``FakeTensor``: the estimator's trace of this policy."""


def is_parameter(t: torch.Tensor) -> bool:
    """A ``nn.Parameter`` or a view of one (``weight.t()``): alive anyway, so a copy can be remade.

    Tested on the type (``issubclass``): ``isinstance`` goes through ``Parameter``'s metaclass,
    which costs more than the rest of a kernel's bookkeeping. Under the estimator's trace the
    parameters are named in `FAKE_PARAMETERS`.
    """
    base = view_base(t)
    if issubclass(type(t), _PARAMETER) or (base is not None and issubclass(type(base), _PARAMETER)):
        return True
    return bool(FAKE_PARAMETERS) and (id(t) in FAKE_PARAMETERS or (base is not None and id(base) in FAKE_PARAMETERS))


@contextlib.contextmanager
def fake_parameters(params: Iterator[torch.Tensor]) -> Iterator[None]:
    """Count ``params`` (a fake model's) as parameters while the block runs."""
    ids = {id(p) for p in params}
    FAKE_PARAMETERS.update(ids)
    try:
        yield
    finally:
        FAKE_PARAMETERS.difference_update(ids)


def widest(dtypes: Iterator[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype floating inputs are promoted to: fp32 over 16-bit; bf16 with fp16 gives fp32."""
    found: Optional[torch.dtype] = None
    for d in dtypes:
        if found is None or d == found:
            found = d
        else:
            return torch.float32
    return found


class Recast:
    """What autograd keeps for a tensor on one of our copies: the source and how to remake the view.

    Attributes:
        source: the tensor that was cast (a parameter, or the narrower activation).
        dtype: the dtype it was cast to.
        kind: ``"weight"`` or ``"upcast"`` (for the message when the source changed).
        version: ``source._version`` when saved; a different version in backward is an error.
    """

    __slots__ = ("source", "dtype", "size", "stride", "offset", "version", "kind", "scope")

    def __init__(self, source: torch.Tensor, saved: torch.Tensor, kind: str, scope: Callable[[], Any]) -> None:
        self.source, self.dtype, self.kind, self.scope = source, saved.dtype, kind, scope
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()
        self.version = version(source)

    def unpack(self) -> torch.Tensor:
        """Make the copy again (inside the tracker scope of its kind) and return the saved view.

        Raises:
            RuntimeError: the source was modified in place after the forward that saved it.
        """
        if version(self.source) != self.version:
            what = ("a parameter was modified in place between forward and backward" if self.kind == WEIGHT else
                    "a 16-bit tensor that an fp32-listed op widened was modified in place before backward; "
                    "avoid the in-place op or set xirang.precision.narrow_saved_upcasts to false")
            raise RuntimeError(f"xirang precision: {what} (version {self.version} at forward, "
                               f"{version(self.source)} now), so its cast cannot be remade exactly")
        with self.scope(), torch.no_grad():
            copy = self.source.detach().to(self.dtype)
        return copy.as_strided(self.size, self.stride, self.offset)


class _Outer:
    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]) -> None:
        self.packed, self.unpack = packed, unpack


def _storage_key(t: torch.Tensor) -> Optional[int]:
    try:
        return storage_key(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class CastSet:
    """The casts made for one op call and the sources they can be remade from.

    Args:
        weight_scope: context factory entered while weight copies are made (a tracker scope that
            counts them as parameters), in forward and again in backward.
        narrow_upcasts: remember widening casts too, so their narrow source is saved instead.
    """

    __slots__ = ("weight_scope", "narrow_upcasts", "copies")

    def __init__(self, weight_scope: Callable[[], Any], narrow_upcasts: bool) -> None:
        self.weight_scope = weight_scope
        self.narrow_upcasts = narrow_upcasts
        self.copies: dict[int, tuple[torch.Tensor, str]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t.to(dtype)``, remembering the copy when backward could remake it from ``t``."""
        if is_parameter(t):
            with self.weight_scope():
                copy = t.to(dtype)
            kind: Optional[str] = WEIGHT
        else:
            copy = t.to(dtype)
            kind = UPCAST if self.narrow_upcasts and dtype.itemsize > t.dtype.itemsize else None
        if kind is not None and torch.is_grad_enabled():
            key = _storage_key(copy)
            if key is not None:
                self.copies[key] = (t, kind)
        return copy

    def map(self, value: Any, target: Callable[[torch.Tensor], Optional[torch.dtype]]) -> Any:
        """Cast the tensors in ``value`` for which ``target`` gives a dtype: a tensor, or a list or
        tuple of arguments whose items are tensors or lists of tensors (``cat``'s ``Tensor[]``)."""
        if isinstance(value, torch.Tensor):
            dtype = target(value)
            return value if dtype is None or dtype is value.dtype else self.cast(value, dtype)
        if not isinstance(value, (list, tuple)):
            return value
        out = None
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                dtype = target(item)
                new = item if dtype is None or dtype is item.dtype else self.cast(item, dtype)
            elif isinstance(item, (list, tuple)):
                new = self.map(item, target)
            else:
                continue
            if new is not item:
                if out is None:
                    out = list(value)
                out[i] = new
        if out is None:
            return value
        return out if isinstance(value, list) else tuple(out)

    def hooks(self) -> Optional[tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]]:
        """The ``(pack, unpack)`` pair under which autograd saves a `Recast` instead of any tensor on
        our copies (other tensors go to the hooks active outside); None when there is nothing to
        replace. Kernels push it around the op (``saved_tensors_hooks`` without its Python frames)."""
        if not self.copies or not saved_tensors_hooks_enabled():
            return None
        copies, weight_scope = self.copies, self.weight_scope
        outer = top_saved_tensors_hooks(False)
        null = contextlib.nullcontext

        def pack(t: torch.Tensor) -> Any:
            found = copies.get(_storage_key(t))
            if found is not None:
                source, kind = found
                return Recast(source, t, kind, weight_scope if kind == WEIGHT else null)
            return _Outer(outer[0](t), outer[1]) if outer is not None else t

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, Recast):
                return packed.unpack()
            if isinstance(packed, _Outer):
                return packed.unpack(packed.packed)
            return packed

        return pack, unpack

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Autograd saves a `Recast` instead of any tensor on our copies (others go to outer hooks)."""
        hooks = self.hooks()
        if hooks is None:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            yield


__all__ = ["CastSet", "FAKE_PARAMETERS", "Recast", "UPCAST", "WEIGHT", "fake_parameters", "is_parameter", "widest"]
