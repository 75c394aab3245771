"""One device reservation that serves plugin tensors, with blocks reused by lifetime.

Plugins make two kinds of requests (``xirang.memory_pool``, docs/memory_pool.md):

* **persistent** blocks live for many steps: the codes and scales of int8/int4 optimizer states,
  allocated at a tensor's first step or format change and freed at its next change. They are
  placed first-fit from the low end of the reservation, so they pack together and never sit
  between the short-lived blocks.
* **transient** blocks live within one step: compressed activation payloads, made in forward and
  dead after their backward node. They take the best-fitting free range (ties: the highest
  address) and are carved from its high end.

Free ranges are one address-ordered list, coalesced with both neighbours on every free. A stack
per phase would be cheaper, but payloads do not die in exact reverse order (recompute and offload
interleave them, and a payload dies with its autograd node, not at its decode), and their sizes
vary with the data (lossless encodings); a best-fit list with coalescing serves any order, and the
same sequence of requests lands on the same addresses every step, so counts are stable.

A block is the tensor `allocate` returns, with a storage of its own over the reservation's bytes
(`block_storage`): it is free again when that storage dies, which is when the block and every view,
``detach()`` or alias of it are gone (a ``weakref.finalize`` on the storage; frees are queued and
applied at the next call, so a collection inside an allocation never edits the free list under it).
The finalizer holds the reservation, so a block outlives `close` safely. On CUDA each free records
an event on the block's stream (and on every stream `record_stream` named for it), and a request
on another stream waits for those events before it gets any block.

When no free range fits, the request gets a plain allocation and is counted as a fallback: the
pool never fails a request. Fallbacks come from the ordinary caching allocator, where the rest of
training can reuse their memory. On CUDA, with ``use_torch_mempool`` and a torch that has
``torch.cuda.MemPool``, the reservation is made inside ``torch.cuda.use_mem_pool``, so it comes from
a private pool of the caching allocator and does not fragment the segments the rest of training uses.
"""
from __future__ import annotations

import bisect
import contextlib
import threading
import weakref
from collections import deque
from typing import Any, Callable, ContextManager, Optional

import torch

from xirang_ds.compat.torch import storage_at, storage_key
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.memory.tracker import SUBALLOCATIONS

SIZE_KEY = "xirang.memory_pool.size"

ALIGNMENT = 256
"""Bytes every block starts on and is rounded up to (the CUDA caching allocator rounds to 512)."""

HISTORY_STEPS = 256
"""Per-step counters kept for `MemoryPool.history`."""


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-int(nbytes) // alignment) * alignment


def block_storage(base: torch.Tensor, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A storage of its own over ``nbytes`` of ``base``'s bytes from ``offset``, owning nothing: a
    block's life is then its storage's (views and aliases keep it), not the Python tensor's.

    `xirang_ds.compat.torch.storage_at` (present in torch 2.4 to 2.13).
    """
    return storage_at(base, offset, nbytes)


def torch_mempool(device: torch.device) -> Optional[Any]:
    """A ``torch.cuda.MemPool`` for ``device`` when it is CUDA and the installed torch has one."""
    if device.type != "cuda":
        return None
    if getattr(torch.cuda, "MemPool", None) is None or getattr(torch.cuda, "use_mem_pool", None) is None:
        return None
    return torch.cuda.MemPool()


class PoolTooSmall(XirangConfigError):
    """One request is larger than the whole reservation: ``xirang.memory_pool.size`` is too small.

    Attributes:
        nbytes: the request's size after alignment.
        size: the reservation's size.
        what: who asked (``"optimizer states"``, ``"activations"``).
    """

    def __init__(self, nbytes: int, size: int, what: str):
        self.nbytes, self.size, self.what = nbytes, size, what
        super().__init__([(SIZE_KEY, f"{size} bytes cannot hold one {what} block of {nbytes} bytes; allowed: "
                                     f"\"auto\" or a byte count of at least {nbytes}; fix: set size to \"auto\" "
                                     f"(sized from the first steady step) or to at least {nbytes}")])


class MemoryPool:
    """A reservation of ``size`` bytes on ``device`` serving aligned blocks.

    Args:
        device: where the reservation and the blocks live.
        size: bytes to reserve now; ``None`` (``auto``) reserves later, from `reserve`.
        use_torch_mempool: on CUDA, allocate inside a ``torch.cuda.MemPool`` where torch has it.
        alignment: block alignment in bytes.

    Attributes:
        buffer: the reservation (``uint8``), ``None`` before `reserve` and after `close`.
        warmup: True until a reservation is made in auto mode: requests are plain allocations and
            only measured (`transient_high_water`).
        on_reserved: callbacks run after `reserve` (owners move warm-up blocks in).

    Example:
        >>> pool = MemoryPool(torch.device("cpu"), size=1 << 20)
        >>> codes = pool.allocate(4096, torch.int8, persistent=True)   # a view of the reservation
        >>> pool.stats()["in_use_bytes"]
        4096
    """

    def __init__(self, device: torch.device | str, size: Optional[int] = None, use_torch_mempool: bool = True,
                 alignment: int = ALIGNMENT):
        self.device = torch.device(device)
        self.alignment = int(alignment)
        self.mempool = torch_mempool(self.device) if use_torch_mempool else None
        self.buffer: Optional[torch.Tensor] = None
        self.warmup = size is None
        self.closed = False
        self.on_reserved: list[Callable[["MemoryPool"], None]] = []
        self._free: list[list[int]] = []  # [offset, nbytes], address order, coalesced
        self._live: dict[int, tuple[int, bool]] = {}  # offset -> (nbytes, persistent)
        self._generation = 0
        self._pending: deque = deque()  # frees queued by finalizers
        self._free_events: dict[Any, Any] = {}  # CUDA: stream -> event recorded at its latest free
        self._block_streams: dict[int, set] = {}  # CUDA: block storage -> other streams that used it
        self._lock = threading.RLock()
        self.in_use_bytes = 0
        self.persistent_bytes = 0
        self.high_water_bytes = 0
        self.pooled = 0
        self.fallbacks = 0
        self.fallback_bytes = 0
        self.oversize = 0
        self.warmup_allocations = 0
        self.steps = 0
        self.history: deque = deque(maxlen=HISTORY_STEPS)
        self._step_pooled = 0
        self._step_fallbacks = 0
        self._step_warmup = 0
        # warm-up measurement (auto): plain blocks live now, and the most transient bytes at once
        self.plain_transient_bytes = 0
        self.plain_persistent_bytes = 0
        self.transient_high_water = 0
        if size is not None:
            self.reserve(size)

    # ----------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Bytes reserved (0 before a reservation)."""
        return 0 if self.buffer is None else self.buffer.numel()

    def allocation_context(self) -> ContextManager:
        """Where plain allocations of this pool are made (the MemPool on CUDA, else nowhere special)."""
        if self.mempool is None:
            return contextlib.nullcontext()
        return torch.cuda.use_mem_pool(self.mempool, device=self.device)

    def reserve(self, nbytes: int) -> None:
        """Make the reservation (one allocation of ``nbytes`` rounded to the alignment).

        Raises:
            RuntimeError: a reservation already exists.
        """
        with self._lock:
            if self.buffer is not None:
                raise RuntimeError("the pool already holds a reservation")
            nbytes = align_up(max(int(nbytes), 0), self.alignment)
            self.warmup = False
            if nbytes:
                with self.allocation_context():
                    self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                self._free = [[0, nbytes]]
        for callback in list(self.on_reserved):
            callback(self)

    def reserve_measured(self, persistent_bytes: int = 0) -> int:
        """Auto mode: reserve the warm-up's most transient bytes at once plus ``persistent_bytes``
        (at least the persistent bytes allocated plain during warm-up). Returns the bytes reserved."""
        self._drain()
        persistent = max(int(persistent_bytes), self.plain_persistent_bytes)
        size = align_up(self.transient_high_water, self.alignment) + align_up(persistent, self.alignment)
        self.reserve(size)
        return self.size

    def owns(self, t: torch.Tensor) -> bool:
        """True when ``t`` lies in the reservation."""
        buf = self.buffer
        if buf is None or t.device != buf.device:
            return False
        start = buf.data_ptr()
        return start <= t.untyped_storage().data_ptr() < start + buf.numel()

    # ----------------------------------------------------------------------------------------
    def allocate(self, nbytes: int, dtype: torch.dtype = torch.uint8, persistent: bool = False,
                 what: str = "") -> torch.Tensor:
        """A 1-D tensor of ``nbytes // dtype.itemsize`` elements, from the pool when it fits.

        Args:
            nbytes: bytes wanted (a multiple of the dtype's size).
            dtype: element type of the returned tensor.
            persistent: lives for many steps (packed at the low end) rather than within one.
            what: who asks, for error messages.

        Returns:
            A view of the reservation, or a plain allocation (counted as a fallback, or during
            warm-up as a warm-up allocation). Its block is free again when the tensor is collected.

        Raises:
            PoolTooSmall: the request alone is larger than the reservation, before the first step
                ended (after that it falls back and counts as ``oversize``).
        """
        nbytes = int(nbytes)
        if nbytes % dtype.itemsize:
            raise ValueError(f"{nbytes} bytes is not a whole number of {dtype} elements")
        size = align_up(nbytes, self.alignment)
        with self._lock:
            self._drain()
            if self.closed or nbytes == 0:
                return self._plain(nbytes, dtype, persistent, counted=False)
            if self.warmup:
                self.warmup_allocations += 1
                self._step_warmup += 1
                return self._plain(nbytes, dtype, persistent, counted=False, measure=size)
            offset = self._take(size, persistent)
            if offset is None:
                if self.size and size > self.size:
                    if self.steps == 0:
                        raise PoolTooSmall(size, self.size, what or ("persistent" if persistent else "transient"))
                    self.oversize += 1
                self.fallbacks += 1
                self.fallback_bytes += nbytes
                self._step_fallbacks += 1
                return self._plain(nbytes, dtype, persistent, counted=True)
            self._live[offset] = (size, persistent)
            self.in_use_bytes += size
            if persistent:
                self.persistent_bytes += size
            self.high_water_bytes = max(self.high_water_bytes, self.in_use_bytes)
            self.pooled += 1
            self._step_pooled += 1
            return self._block(offset, nbytes, dtype)

    def _block(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.buffer
        stream = self._order_after_other_streams()
        storage = block_storage(buffer, offset, nbytes)
        block = torch.empty(0, dtype=dtype, device=self.device).set_(storage, 0, (nbytes // dtype.itemsize,))
        key = storage_key(storage)
        SUBALLOCATIONS[key] = buffer.untyped_storage()
        # the finalizer's arguments hold the reservation: a block outliving close() keeps its bytes
        weakref.finalize(block.untyped_storage(), self._on_block_freed, key, self._generation, offset, stream, buffer)
        return block

    def record_stream(self, block: torch.Tensor, stream: Any) -> None:
        """``block`` (from `allocate`) is also used on ``stream``: its free then records an event there
        too, and later requests on other streams wait for it (as ``Tensor.record_stream`` does for
        the caching allocator's blocks)."""
        if stream is not None and self.device.type == "cuda":
            self._block_streams.setdefault(storage_key(block.untyped_storage()), set()).add(stream)

    def _on_block_freed(self, key: int, generation: int, offset: int, stream: Any, buffer: torch.Tensor) -> None:
        SUBALLOCATIONS.pop(key, None)
        streams = self._block_streams.pop(key, set()) | ({stream} if stream is not None else set())
        for used in streams:  # work queued there may still read the block: later users wait for it
            event = torch.cuda.Event()
            event.record(used)
            self._free_events[used] = event
        self._pending.append((generation, offset))

    def _order_after_other_streams(self) -> Any:
        """CUDA: make the current stream wait for the latest free on every other stream (a GPU-side
        wait, no host sync) and return it; None elsewhere."""
        if self.device.type != "cuda":
            return None
        stream = torch.cuda.current_stream(self.device)
        for other, event in list(self._free_events.items()):
            if other != stream:
                stream.wait_event(event)
        return stream

    def _plain(self, nbytes: int, dtype: torch.dtype, persistent: bool, counted: bool,
               measure: int = 0) -> torch.Tensor:
        # from the ordinary caching allocator (not the reservation's MemPool): training can reuse it
        t = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=self.device)
        if measure:
            if persistent:
                self.plain_persistent_bytes += measure
            else:
                self.plain_transient_bytes += measure
                self.transient_high_water = max(self.transient_high_water, self.plain_transient_bytes)
            weakref.finalize(t, self._pending.append, ("plain", measure, persistent))
        return t

    def _take(self, size: int, persistent: bool) -> Optional[int]:
        """Offset of a free range of ``size`` bytes taken from the free list, or None."""
        free = self._free
        if persistent:  # first fit from the low end
            for i, (offset, length) in enumerate(free):
                if length >= size:
                    if length == size:
                        del free[i]
                    else:
                        free[i] = [offset + size, length - size]
                    return offset
            return None
        best = None
        for i, (offset, length) in enumerate(free):  # best fit; ties go to the higher address
            if length >= size and (best is None or length <= free[best][1]):
                best = i
        if best is None:
            return None
        offset, length = free[best]
        if length == size:
            del free[best]
            return offset
        free[best][1] = length - size
        return offset + length - size  # carve from the high end

    def _release(self, offset: int) -> None:
        size, persistent = self._live.pop(offset)
        self.in_use_bytes -= size
        if persistent:
            self.persistent_bytes -= size
        free = self._free
        i = bisect.bisect_left(free, [offset, 0])
        merged = [offset, size]
        if i < len(free) and free[i][0] == offset + size:  # coalesce with the next range
            merged[1] += free.pop(i)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # and with the previous one
            free[i - 1][1] += merged[1]
        else:
            free.insert(i, merged)

    def _drain(self) -> None:
        with self._lock:
            while self._pending:
                item = self._pending.popleft()
                if item[0] == "plain":
                    _, size, persistent = item
                    if persistent:
                        self.plain_persistent_bytes -= size
                    else:
                        self.plain_transient_bytes -= size
                elif item[0] == self._generation and item[1] in self._live:
                    self._release(item[1])

    # ----------------------------------------------------------------------------------------
    def end_step(self) -> dict:
        """Close one optimizer step's counters; returns them (also kept in `history`)."""
        with self._lock:
            self._drain()
            self.steps += 1
            entry = {"step": self.steps, "pooled": self._step_pooled, "fallbacks": self._step_fallbacks,
                     "warmup": self._step_warmup, "in_use_bytes": self.in_use_bytes}
            self.history.append(entry)
            self._step_pooled = self._step_fallbacks = self._step_warmup = 0
            return entry

    def stats(self) -> dict:
        """Figures of the pool: bytes reserved, in use (persistent and transient), high-water mark,
        free ranges, and counts of pooled, fallback and warm-up allocations."""
        with self._lock:
            self._drain()
            return {
                "reserved_bytes": self.size, "in_use_bytes": self.in_use_bytes,
                "persistent_bytes": self.persistent_bytes,
                "transient_bytes": self.in_use_bytes - self.persistent_bytes,
                "high_water_bytes": self.high_water_bytes, "free_ranges": len(self._free),
                "largest_free_bytes": max((length for _, length in self._free), default=0),
                "pooled_allocations": self.pooled, "fallbacks": self.fallbacks, "fallback_bytes": self.fallback_bytes,
                "oversize_fallbacks": self.oversize, "warmup_allocations": self.warmup_allocations,
                "steps": self.steps, "torch_mempool": self.mempool is not None,
                "torch_mempool_bytes": self.mempool_bytes(),
            }

    def mempool_bytes(self) -> Optional[int]:
        """Bytes the caching allocator holds in this pool's ``torch.cuda.MemPool`` (CUDA only)."""
        if self.mempool is None:
            return None
        return int(sum(segment["total_size"] for segment in self.mempool.snapshot()))

    def close(self) -> None:
        """Stop serving: later requests are plain allocations; the reservation is dropped (live
        blocks keep its storage alive until they die)."""
        with self._lock:
            self.closed = True
            self.buffer = None
            self._free = []
            self._live.clear()
            self._generation += 1
            self._pending.clear()
            self.in_use_bytes = self.persistent_bytes = 0
