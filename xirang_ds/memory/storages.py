"""Storages as the tracker sees them: which storage holds a tensor's bytes, and one storage's `Record`.

Storages are keyed by their C++ ``StorageImpl`` (`xirang_ds.compat.torch.storage_key`), so views
(ZeRO's parameters are views of one flat buffer) count once; a storage that aliases bytes another owns
(`SUBALLOCATIONS`) counts as its owner. Wrapper subclasses (torchao's quantized states, DTensor) count as
the plain tensors inside them. The tracker (`xirang_ds.memory.tracker`) keeps one `Record` per storage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from xirang_ds.compat.torch import is_traceable_wrapper_subclass, storage_key
from xirang_ds.memory.categories import TEMPORARIES


@dataclass
class Record:
    """One storage's life.

    Attributes:
        serial: creation order (unique for the tracker's life).
        nbytes: size of the storage in bytes.
        created, freed: event clock at creation and free (``freed`` is None while alive).
        last_used: event clock of the last op that read or wrote it (timeline mode only).
        backward_uses: the clocks at which the autograd nodes that read it in backward started, in order
            (`MemoryTracker.record_backward_uses`), else None.
        phase: phase at creation.
        category: role, or None until `resolve`.
        module: the module whose forward created it (recomputation in backward included), else ``""``.
        node: the autograd node whose backward created it, else ``""``.
        op: the op that created it, or ``"seed"``.
        shape, dtype: of the first tensor seen on the storage.
    """

    serial: int
    nbytes: int
    created: int
    phase: str
    category: Optional[str] = None
    module: str = ""
    node: str = ""
    op: str = ""
    shape: tuple = ()
    dtype: str = ""
    freed: Optional[int] = None
    last_used: int = -1
    backward_uses: Optional[list] = None
    ptr: int = 0
    host: bool = False

    def creator(self) -> str:
        """What created it, for tables: the module, else the autograd node, else the op."""
        return self.module or self.node or self.op

    def resolved_category(self) -> str:
        return self.category or TEMPORARIES


def storage_of(t: torch.Tensor):
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, meta-only or functional wrappers
        return None
    owner = SUBALLOCATIONS.get(storage_key(st))
    return owner if owner is not None else st


SUBALLOCATIONS: dict[int, Any] = {}
"""Storages that alias bytes another storage owns (a memory-pool block inside its reservation), by
`storage_key`, to that owner's storage: the tracker counts and marks the owner, so the bytes count once.
The pool adds a block when it hands it out and drops it when the block's storage dies."""


def inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors a wrapper subclass holds (``__tensor_flatten__``), recursively."""
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if is_traceable_wrapper_subclass(inner):
            yield from inner_tensors(inner)
        else:
            yield inner


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested lists, tuples, dicts and optimizer states (wrapper subclasses as the
    plain tensors inside them)."""
    if isinstance(obj, torch.Tensor):
        if is_traceable_wrapper_subclass(obj):
            yield from inner_tensors(obj)
        else:
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple, set)) or hasattr(obj, "__iter__") and not isinstance(obj, (str, bytes)):
        for v in obj:
            yield from tensors_in(v)
