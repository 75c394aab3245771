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

from xirang_ds.compat.torch import TorchDispatchMode
from xirang_ds.hooks import wrap_method
from xirang_ds.memory.lending import Lease


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


def reductions_ordered() -> Optional[str]:
    """None when the installed DeepSpeed reduces ZeRO-1/2 buckets on ``reduction_stream`` under
    ``overlap_comm`` (what `ArenaLender` orders its leases after), else the reason lending is unsafe."""
    import inspect

    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        source = inspect.getsource(DeepSpeedZeroOptimizer.average_tensor)
        init = inspect.getsource(DeepSpeedZeroOptimizer.__init__)
    except (ImportError, AttributeError, OSError, TypeError) as e:
        return f"cannot read DeepSpeed's ZeRO-1/2 reduction ({type(e).__name__}: {e})"
    if "self.reduction_stream = " not in init or "stream = self.reduction_stream" not in source:
        return ("the installed DeepSpeed no longer reduces buckets on DeepSpeedZeroOptimizer.reduction_stream "
                "(stage_1_and_2.py average_tensor), which lending orders its leases after")
    return None


def bucket_slots(optimizer: Any) -> Optional[int]:
    """Buffers ZeRO-1/2 allocate per backward: 2 with ``overlap_comm``, else 1; None if not ZeRO-1/2."""
    if not hasattr(optimizer, "setup_buckets") or not hasattr(optimizer, "ipg_buckets"):
        return None
    dtypes = max(1, len(getattr(optimizer, "ipg_buckets", {}) or {}))
    return (2 if getattr(optimizer, "overlap_comm", False) else 1) * dtypes


LEASE_ALIGN = 64
"""Byte alignment of lent regions (any dtype view of a lease is aligned)."""


class _LenderStats:
    """Per-step and whole-run counters of `ArenaLender` (bytes and leases)."""

    __slots__ = ("leases", "lent_bytes", "declined_bytes", "evicted_bytes", "evictions", "high_water",
                 "step_lent_bytes", "step_evicted_bytes", "steps")

    def __init__(self):
        self.leases = self.lent_bytes = self.declined_bytes = self.evicted_bytes = self.evictions = 0
        self.high_water = self.step_lent_bytes = self.step_evicted_bytes = 0
        self.steps: list[dict] = []

    def end_step(self, step: int) -> dict:
        record = {"step": step, "lent_bytes": self.step_lent_bytes, "evicted_bytes": self.step_evicted_bytes}
        self.steps.append(record)
        del self.steps[:-100]
        self.step_lent_bytes = self.step_evicted_bytes = 0
        return record

    def as_dict(self) -> dict:
        return {"leases": self.leases, "lent_bytes": self.lent_bytes, "declined_bytes": self.declined_bytes,
                "evicted_bytes": self.evicted_bytes, "evictions": self.evictions, "high_water": self.high_water,
                "steps": list(self.steps)}


class ArenaLender:
    """Lends the arena to saved activations while no reduction uses it (a `StorageProvider`).

    **When.** A lease is granted only while the optimizer is outside a backward's reductions
    (``ready_for_gradients`` is False: from the end of one backward's reduction to the first
    gradient hook of the next), i.e. during forward. Requests made while buckets are in use
    (recomputation inside backward) are declined and get plain memory.

    **Where: a layout from one observed pass.** Gradients fill the arena in *write order* (slot 0
    from offset 0 up, then slot 1 with ``overlap_comm``), starting with the last layers'; backward
    consumes the last layers' activations first. The first pass after (re)start observes: requests
    are stacked downwards from the end of the arena (what does not fit gets plain memory), and when
    each is consumed the lender records the *write frontier* (the highest arena byte any gradient
    copy of this backward has reached; an evicted request reports at its decode). The layout then
    places requests in the order they were consumed, each at the lowest free offset at or above
    its frontier: every lent activation is consumed before a gradient can reach it. Requests that
    do not fit are declined (plain memory). From the next forward, request ``i`` of a pass gets its
    planned region if its size matches.

    **Ordered after the reductions (accelerators).** With ``overlap_comm`` DeepSpeed reduces the
    bucket on its ``reduction_stream`` (``stage_1_and_2.py`` ``average_tensor``). The first lease of
    each forward makes the current stream wait for that stream (a GPU-side wait, no host sync), so
    no lent region is written while a reduction may still read the arena, whether or not DeepSpeed
    synchronizes the device in its epilogue (0.19.8 does, ``independent_gradient_partition_epilogue``,
    on devices that do not resolve data dependencies). `reductions_ordered` says whether the
    installed DeepSpeed still keeps its reductions on that stream; lending is refused with that reason
    when it does not (``tests/comm_buffers/test_deepspeed_lending.py`` reads DeepSpeed's source).

    **Never overwritten.** Whatever the plan, before DeepSpeed copies a gradient into the bucket
    (``reduce_independent_p_g_buckets_and_remove_grads``), the lender computes the byte range the
    copy will write (after a flush and the slot swap of ``overlap_comm``, as DeepSpeed does) and
    evicts every live lease overlapping it to host memory; the payload then decodes from its host
    copy. With ``verify`` on, returned and evicted regions are poisoned (``0xFF``) and the payloads
    are checksummed at store and checked at decode (``PayloadStorage.verify``).

    Args:
        optimizer: DeepSpeed's ZeRO-1/2 optimizer whose buckets the arena serves.
        arena: the arena (one communication dtype).
    """

    def __init__(self, optimizer: Any, arena: Arena, verify: bool = False):
        self.optimizer = optimizer
        self.verify = verify
        self.stats = _LenderStats()
        self._handle = wrap_method(optimizer, "reduce_independent_p_g_buckets_and_remove_grads", self._before_write)
        self._reset(arena)

    def _reset(self, arena: Arena) -> None:
        self.arena = arena
        self.bytes = arena.buffer.view(torch.uint8)
        self.slot_bytes = arena.slot_numel * arena.buffer.element_size()
        self.live: list[list] = []  # [start, end, lease or None once released, byte view]
        self.top = self.bytes.numel()  # lowest live start (the observed pass stacks downwards)
        self.plan: Optional[list[Optional[int]]] = None  # offset per request of a pass (None: declined)
        self._observed: list[list] = []  # [size, frontier at consumption or None, release order]
        self._released = 0
        self._index = 0
        self._frontier = 0
        self._in_backward = False
        self._ordered = False

    def _order_after_reductions(self) -> None:
        """Make the current stream wait for DeepSpeed's reduction stream (None on CPU: nothing to do)."""
        stream = getattr(self.optimizer, "reduction_stream", None)
        if stream is not None:
            from deepspeed.accelerator import get_accelerator

            get_accelerator().current_stream().wait_stream(stream)
        self._ordered = True

    @property
    def in_use(self) -> int:
        """Arena bytes lent out now."""
        return sum(e[1] - e[0] for e in self.live if e[2] is not None)

    # StorageProvider ------------------------------------------------------------------------
    def lease(self, nbytes: int, device: torch.device):
        """A `Lease` of arena bytes, ``None`` to decline; in the observed pass a request that does not
        fit gets a plain buffer that still reports when it is consumed."""
        if getattr(self.optimizer, "ready_for_gradients", False) or device.type != self.arena.device.type:
            return None
        if self._in_backward or not self._ordered:  # the first request after a backward starts a new pass
            self._order_after_reductions()
        if self._in_backward:
            self._in_backward = False
            self._frontier = 0
            self._index = 0
            if self.plan is None and self._observed:
                self.plan = self._layout()
        size = -(-int(nbytes) // LEASE_ALIGN) * LEASE_ALIGN
        index, self._index = self._index, self._index + 1
        observer = None
        if self.plan is None:
            # observing: stacked from the top (the guard evicts what gradients reach); every request,
            # lent or not, reports when it is consumed
            record = [size, None, None]
            self._observed.append(record)
            observer = lambda: self._observe(record)  # noqa: E731
            start = (self.top - size) // LEASE_ALIGN * LEASE_ALIGN
            if start < 0:
                return Lease(torch.empty(size, dtype=torch.uint8, device=self.arena.device), on_done=observer)
        else:
            start = self.plan[index] if index < len(self.plan) else None
            if start is None or self._planned_size[index] != size or any(
                    e[2] is not None and e[0] < start + size and start < e[1] for e in self.live):
                self.stats.declined_bytes += size
                return None
        entry = [start, start + size, None, self.bytes]
        self.live.append(entry)
        self.top = min(self.top, start)
        lease = Lease(self.bytes.narrow(0, start, size), on_release=lambda: self._release(entry), on_done=observer)
        entry[2] = lease
        self.stats.leases += 1
        self.stats.lent_bytes += size
        self.stats.step_lent_bytes += size
        self.stats.high_water = max(self.stats.high_water, self.in_use)
        return lease

    def _observe(self, record: list) -> None:
        record[1] = self._frontier if self._in_backward else 0
        record[2] = self._released
        self._released += 1

    def _layout(self) -> list[Optional[int]]:
        """Offsets for the observed requests: in consumption order, each at the lowest free byte at or
        above its frontier, above the requests consumed before it."""
        requests = self._observed
        self._planned_size = [r[0] for r in requests]
        plan: list[Optional[int]] = [None] * len(requests)
        cursor, capacity = 0, self.bytes.numel()
        order = sorted((r[2] if r[2] is not None else float("inf"), i) for i, r in enumerate(requests))
        for _, i in order:
            size, frontier, consumed = requests[i]
            if consumed is None:
                continue  # never consumed in the observed pass (no backward): not lent
            start = -(-max(cursor, frontier) // LEASE_ALIGN) * LEASE_ALIGN
            if start + size <= capacity:
                plan[i] = start
                cursor = start + size
        return plan

    def _release(self, entry: list) -> None:
        entry[2] = None
        if self.verify:
            entry[3][entry[0]:entry[1]].fill_(0xFF)  # poison: a read of a returned lease shows
        self.live = [e for e in self.live if e[2] is not None]
        self.top = min((e[0] for e in self.live), default=self.bytes.numel())

    # the write guard ------------------------------------------------------------------------
    def write_range(self, param: torch.Tensor) -> Optional[tuple[int, int]]:
        """Arena bytes DeepSpeed's next bucket copy of ``param``'s gradient writes (None: no copy)."""
        opt = self.optimizer
        n = param.numel()
        size = int(opt.reduce_bucket_size)
        if n == 0 or n > size or not getattr(opt, "contiguous_gradients", False):
            return None
        bucket = opt.ipg_buckets[opt.get_param_comm_dtype(param)]
        elements, index = bucket.elements, bucket.index
        if elements + n > size:
            elements = 0
            if opt.overlap_comm:
                index = 1 - index
        elem = self.arena.buffer.element_size()
        start = index * self.slot_bytes + elements * elem
        return start, start + n * elem

    def _before_write(self, original, param, *args: Any, **kwargs: Any) -> Any:
        span = self.write_range(param)
        self._in_backward = True
        self._ordered = False
        if span is not None:
            self._frontier = max(self._frontier, span[1])
            if self.live:
                self.evict(*span)
        return original(param, *args, **kwargs)

    def evict(self, start: int = 0, end: Optional[int] = None) -> int:
        """Move every live lease overlapping ``[start, end)`` to host memory; returns the bytes moved."""
        end = self.bytes.numel() if end is None else end
        moved = 0
        for entry in list(self.live):
            lease = entry[2]
            if lease is not None and entry[0] < end and start < entry[1]:
                moved += entry[1] - entry[0]
                lease.evict()
        self.stats.evicted_bytes += moved
        self.stats.step_evicted_bytes += moved
        self.stats.evictions += bool(moved)
        return moved

    def replace(self, arena: Arena) -> None:
        """Serve a resized arena: live leases move to host memory first, and the layout is observed anew."""
        self.evict()
        self._reset(arena)

    def remove(self) -> None:
        self.evict()
        self._handle.remove()
