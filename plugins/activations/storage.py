"""Where packed activations live: the lending seam for device bytes, and the host buffer pool.

Device payloads (compressed or quantized saved tensors) are allocated through `PayloadStorage`.
By default each is a plain ``torch.empty``, or a block of the memory pool when one is installed as
``PayloadStorage.allocator`` (the ``memory_pool`` plugin; the block is free again when the payload
dies, exactly when the plain allocation would be). Another plugin can lend memory it holds idle
(the comm_buffers arena between reductions) by installing a `StorageProvider`, asked first (the seam,
`StorageProvider` and `Lease`, is `xirang_ds.memory.lending`, where lender and borrower meet):

* ``provider.lease(nbytes, device)`` returns a `Lease` over ``nbytes`` of its memory, or ``None``
  to decline (the payload then gets a plain allocation).
* The payload calls ``lease.release()`` once it is decoded or freed; the provider's
  ``on_release`` callback then gets its bytes back.
* When the lender needs its memory earlier (a reduction is about to run), it calls
  ``lease.evict()``: the payload's bytes move to host memory (counted as host tier) and the lease
  is released at once. Payloads read their buffer through ``lease.buffer`` at decode time, so an
  evicted payload decodes from its host copy.

Offloaded tensors go to host buffers from `HostPool`: pinned through the accelerator where it
pins, reused by size across steps, and created inside the tracker's host tier.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch

from xirang_ds.compat.torch import view_base
from xirang_ds.memory.host_ledger import HostLedger, pinned_block
from xirang_ds.memory.lending import Lease, StorageProvider


class PayloadStorage:
    """Allocates payload buffers: the installed provider first, then plain device memory.

    Args:
        host_tier: the tracker's host-tier context (evictions create host copies under it).
    """

    def __init__(self, host_tier: Optional[Callable[[], ContextManager]] = None):
        self.provider: Optional[StorageProvider] = None
        self.allocator: Optional[Callable[[int, torch.device], torch.Tensor]] = None
        """Makes the payloads no provider lends: ``allocator(nbytes, device)`` returns a ``uint8``
        tensor of ``nbytes`` whose memory is reused once the tensor dies (``None``: ``torch.empty``)."""
        self.host_tier = host_tier or contextlib.nullcontext
        self.leased_bytes = 0
        """Bytes served by the provider so far (for reports and tests)."""
        self.verify = False
        """Checksum lent payloads at store and check them at decode (tests; see `checksum`)."""

    def allocate(self, nbytes: int, device: torch.device) -> Lease:
        """A lease of ``nbytes`` (``uint8``) on ``device``."""
        lease = self.lend(nbytes, device)
        if lease is not None:
            return lease
        if self.allocator is not None:
            return Lease(self.allocator(nbytes, device))
        return Lease(torch.empty(nbytes, dtype=torch.uint8, device=device))

    def lend(self, nbytes: int, device: torch.device) -> Optional[Lease]:
        """A lease from the provider only (``None`` when there is none or it declines)."""
        if self.provider is None:
            return None
        lease = self.provider.lease(nbytes, device)
        if lease is None:
            return None
        if lease.buffer.numel() < nbytes or lease.buffer.dtype != torch.uint8:
            raise RuntimeError(f"storage provider {type(self.provider).__name__} returned a lease of "
                               f"{lease.buffer.numel()} {lease.buffer.dtype} elements for {nbytes} bytes; "
                               "a lease must be a uint8 buffer of at least the requested size")
        lease._host_tier = self.host_tier
        self.leased_bytes += nbytes
        return lease


def checksum(data: torch.Tensor) -> int:
    """A position-weighted sum of ``data``'s bytes (a changed or moved byte changes it)."""
    b = data.reshape(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(b.numel(), dtype=torch.int64, device=b.device) % 65521 + 1
    return int((b * weights).sum())


MIN_HOST_CLASS_BYTES = 4096
"""The smallest host buffer (a page)."""


def host_size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a size class: a page at least, else the next of 1, 1.25, 1.5, 1.75 and
    2 times a power of two (at most 25% more than asked), so tensors whose sizes vary step to step
    (variable sequence lengths) share buffers."""
    nbytes = max(int(nbytes), MIN_HOST_CLASS_BYTES)
    step = 1 << max(nbytes.bit_length() - 3, 0)  # a quarter of the power of two at or below nbytes
    return -(-nbytes // step) * step


def pool_buffer_bytes(nbytes: int, pin: bool) -> int:
    """The buffer `HostPool` hands out for ``nbytes``: the allocator's own block pinned, else its size class."""
    return pinned_block(nbytes) if pin else host_size_class(nbytes)


class HostPool:
    """Host buffers for offloaded tensors, reused by size class and trimmed.

    A buffer comes back to the cache when its copy to the device has completed (its event). The
    cache never holds more than the most bytes ever in use at once, nor, with a budget, more than the
    budget leaves beside the buffers in use; the oldest cached buffers go first. Buffers are made and
    counted by the ``ledger`` (`xirang_ds.memory.host_ledger`): pinned, a buffer is the allocator's own
    power-of-two block, and the budget is on what every host tier holds, a dropped pinned block
    included. A request that cannot fit even after the pool's cache is emptied gets ``None``: the caller
    keeps the tensor where it is (counted in ``refused`` / ``refused_bytes``).

    Args:
        pin: pin buffers through the accelerator (page-locked memory for async copies).
        host_tier: the tracker's host-tier context; buffers are created under it.
        budget_bytes: without ``ledger``: the most host bytes the pool may hold (``None``: no cap).
        ledger: the ledger that makes and counts the buffers, whose budget applies (the run's: the
            process's, with ``host_memory_budget``); default a ledger of the pool's own.

    Attributes:
        allocated_bytes: host bytes the pool holds now (in use, in flight and cached).
        in_use_bytes: bytes of buffers handed out and not yet returned (or returned, copy in flight).
        high_water_bytes: the most ``in_use_bytes`` seen.
    """

    def __init__(self, pin: bool, host_tier: Optional[Callable[[], ContextManager]] = None,
                 budget_bytes: Optional[int] = None, ledger: Optional[HostLedger] = None):
        self.pin = pin
        self.host_tier = host_tier or contextlib.nullcontext
        self.ledger = ledger if ledger is not None else HostLedger(budget_bytes)
        self._cached: list[torch.Tensor] = []  # oldest first
        self._pending: list[tuple[torch.Tensor, object]] = []
        self._out: set[int] = set()  # ids of the buffers handed out (alive while out)
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.high_water_bytes = 0
        self.refused = 0
        self.refused_bytes = 0
        self.trimmed_bytes = 0

    def get(self, nbytes: int) -> Optional[torch.Tensor]:
        """A ``uint8`` host buffer of ``nbytes`` (a view of a size-class buffer), or ``None`` when the
        budget cannot hold it."""
        self._reap()
        size = pool_buffer_bytes(nbytes, self.pin)
        for i in range(len(self._cached) - 1, -1, -1):  # the most recently returned buffer of the class
            if self._cached[i].numel() == size:
                buf = self._cached.pop(i)
                break
        else:
            while self._cached and not self.ledger.fits(size, self.pin):  # the oldest cached buffers go first
                self._drop_oldest()
            if not self.ledger.fits(size, self.pin):  # what every host tier holds leaves no room
                self.refused += 1
                self.refused_bytes += nbytes
                return None
            buf = self.allocate(size)
            self.allocated_bytes += size
        self.in_use_bytes += size
        self.high_water_bytes = max(self.high_water_bytes, self.in_use_bytes)
        self._out.add(id(buf))
        return buf[:nbytes]

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A new (pinned) host buffer outside the pool, counted in the ledger."""
        return self.ledger.buffer((nbytes,), torch.uint8, self.pin, "activations offload", self.host_tier)

    @property
    def budget_bytes(self) -> Optional[int]:
        """``host_memory_budget`` (the ledger's), in bytes; ``None``: no cap."""
        return self.ledger.budget_bytes

    def put(self, buf: torch.Tensor, event: object = None) -> None:
        """Return a buffer from `get`; with ``event``, reusable only once that copy has completed."""
        base = view_base(buf)
        base = buf if base is None else base
        if id(base) not in self._out:
            return  # handed out before a `clear`: not the pool's any more
        self._out.discard(id(base))
        if event is not None:
            self._pending.append((base, event))
        else:
            self._cache(base)

    def _cache(self, base: torch.Tensor) -> None:
        self.in_use_bytes -= base.numel()
        self._cached.append(base)
        limit = self.high_water_bytes - self.in_use_bytes
        if self.budget_bytes is not None:
            limit = min(limit, self.budget_bytes - self.in_use_bytes)
        self._trim(limit)

    def _trim(self, limit: int) -> None:
        """Drop the oldest cached buffers until the cache holds at most ``limit`` bytes."""
        cached = sum(b.numel() for b in self._cached)
        while self._cached and cached > limit:
            cached -= self._drop_oldest()

    def _drop_oldest(self) -> int:
        """Drop the oldest cached buffer (plain memory is freed; a pinned block goes back to the allocator's
        cache, which the ledger still counts); its bytes."""
        dropped = self._cached.pop(0).numel()
        self.allocated_bytes -= dropped
        self.trimmed_bytes += dropped
        return dropped

    def _reap(self) -> None:
        if not self._pending:
            return
        still = []
        for base, event in self._pending:
            if event.query():
                self._cache(base)
            else:
                still.append((base, event))
        self._pending = still

    def clear(self) -> None:
        """Drop every pooled buffer (after `Offloader.synchronize`)."""
        self._cached.clear()
        self._pending.clear()
        self._out.clear()
        self.allocated_bytes = 0
        self.in_use_bytes = 0


def use_pool(session: Any, storage: PayloadStorage, ready: Callable[[], bool]) -> None:
    """Payloads no provider lends come from the memory pool when the section is on (transient
    blocks); the pool measures them only once ``ready()`` (the plan is in force)."""
    pool = session.pool()
    if pool is None:
        return

    def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type != pool.device.type:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return pool.allocate(nbytes, what="activations payload")

    storage.allocator = allocate
    session.pool_owner.add_client("activations", ready=ready)
