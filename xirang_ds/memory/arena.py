"""One persistent arena for communication buckets, allocated once and reused every backward.

DeepSpeed's ZeRO-1/2 allocate their reduction bucket with ``torch.empty(reduce_bucket_size)`` at the
first gradient hook of every backward and free it at the end (``stage_1_and_2.py`` ``setup_buckets``,
``_release_ipg_buffers``). `ArenaServer` wraps ``setup_buckets`` on the optimizer instance and, while it
runs, answers exactly those ``aten.empty`` calls (the bucket's element count and dtype, on the device)
with views of the arena, in order: slot 0, then slot 1 with ``overlap_comm``. Any other allocation
passes through untouched, so the mechanism does not depend on the body of ``setup_buckets``; the
version guard is that `serve` counts a miss when no bucket was taken from the arena, and the tests
check that no miss happens.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xirang_ds.hooks import wrap_method


class Arena:
    """``slots`` contiguous regions of ``slot_numel`` elements in one tensor.

    Attributes:
        buffer: the single allocation.
        served: how many bucket allocations the arena answered.
    """

    def __init__(self, slot_numel: int, slots: int, dtype: torch.dtype, device: torch.device | str):
        self.slot_numel = int(slot_numel)
        self.slots = int(slots)
        self.dtype = dtype
        self.device = torch.device(device)
        self.buffer = torch.empty(self.slot_numel * self.slots, dtype=dtype, device=self.device)
        self.served = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def slot(self, i: int) -> torch.Tensor:
        return self.buffer.narrow(0, i * self.slot_numel, self.slot_numel)


class _Serve(TorchDispatchMode):
    def __init__(self, arena: Arena):
        super().__init__()
        self.arena = arena
        self.next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        arena = self.arena
        if func is torch.ops.aten.empty.memory_format and self.next < arena.slots:
            size = list(args[0]) if args else []
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            device = torch.device(kwargs.get("device") or "cpu")
            if size == [arena.slot_numel] and dtype == arena.dtype and device.type == arena.device.type:
                view = arena.slot(self.next)
                self.next += 1
                arena.served += 1
                return view
        return func(*args, **kwargs)


class ArenaServer:
    """Serve a ZeRO-1/2 optimizer's bucket allocations from ``arena`` (removable).

    Args:
        optimizer: DeepSpeed's ``DeepSpeedZeroOptimizer`` (``engine.optimizer``).
        arena: the arena; its slot size must equal ``optimizer.reduce_bucket_size``.
    """

    def __init__(self, optimizer: Any, arena: Arena):
        self.optimizer = optimizer
        self.arena = arena
        self._handle = wrap_method(optimizer, "setup_buckets", self._setup_buckets)
        self.misses = 0

    def _setup_buckets(self, original, *args: Any, **kwargs: Any) -> Any:
        if getattr(self.optimizer, "ready_for_gradients", False):
            return original(*args, **kwargs)
        if int(self.optimizer.reduce_bucket_size) != self.arena.slot_numel:
            self.misses += 1  # the bucket size changed; the owner resizes the arena between steps
            return original(*args, **kwargs)
        before = self.arena.served
        with _Serve(self.arena):
            result = original(*args, **kwargs)
        if self.arena.served == before:
            self.misses += 1
        return result

    def replace(self, arena: Arena) -> None:
        self.arena = arena

    def remove(self) -> None:
        self._handle.remove()


def bucket_slots(optimizer: Any) -> Optional[int]:
    """Buffers ZeRO-1/2 allocate per backward: 2 with ``overlap_comm``, else 1; None if not ZeRO-1/2."""
    if not hasattr(optimizer, "setup_buckets") or not hasattr(optimizer, "ipg_buckets"):
        return None
    dtypes = max(1, len(getattr(optimizer, "ipg_buckets", {}) or {}))
    return (2 if getattr(optimizer, "overlap_comm", False) else 1) * dtypes
