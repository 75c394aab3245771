"""The lending seam for device bytes: a `Lease` over memory one plugin holds idle, and the `StorageProvider`
that lends it (`xirang_ds.roles.LendsStorage`; the comm_buffers arena lends to packed activations).

It sits in the memory layer so the lender and the borrower meet here without importing each other; the
borrower's side (`PayloadStorage`, which asks a provider first) is in the activations plugin, whose
``storage`` module re-exports both names.

* ``provider.lease(nbytes, device)`` returns a `Lease` over ``nbytes`` of its memory, or ``None``
  to decline (the payload then gets a plain allocation).
* The payload calls ``lease.release()`` once it is decoded or freed; the provider's
  ``on_release`` callback then gets its bytes back.
* When the lender needs its memory earlier (a reduction is about to run), it calls
  ``lease.evict()``: the payload's bytes move to host memory (counted as host tier) and the lease
  is released at once. Payloads read their buffer through ``lease.buffer`` at decode time, so an
  evicted payload decodes from its host copy.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch

from xirang_ds.memory.host_ledger import ledger


class Lease:
    """``nbytes`` of memory lent to one payload.

    Args:
        buffer: a 1-D ``uint8`` tensor of at least the requested size.
        on_release: called once when the payload no longer needs the bytes (``None`` for plain
            allocations, which are simply dropped).
        host_tier: context under which an eviction creates its host copy.

    Attributes:
        buffer: where the payload's bytes are now (device, or host after `evict`).
        evicted: True once the bytes were moved to host memory.
    """

    __slots__ = ("buffer", "_on_release", "_on_done", "_host_tier", "evicted", "lent", "_copied", "__weakref__")

    def __init__(self, buffer: torch.Tensor, on_release: Optional[Callable[[], None]] = None,
                 host_tier: Optional[Callable[[], ContextManager]] = None,
                 on_done: Optional[Callable[[], None]] = None):
        self.buffer = buffer
        self._on_release = on_release
        self._on_done = on_done
        """Called once when the payload is decoded or freed, even after an eviction (the lender
        learns when each request is consumed)."""
        self._host_tier = host_tier or contextlib.nullcontext
        self.evicted = False
        self.lent = on_release is not None
        self._copied: Any = None  # accelerators: the event of an eviction's copy to the host

    @property
    def readable(self) -> bool:
        """False once lent bytes went back to the lender without being evicted first."""
        return self.evicted or not self.lent or self._on_release is not None

    def host_ready(self) -> None:
        """Wait until an eviction's copy has landed, before the host reads the bytes itself."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def release(self) -> None:
        """The payload is done with the bytes: give them back to the lender (idempotent)."""
        for name in ("_on_release", "_on_done"):
            callback = getattr(self, name)
            setattr(self, name, None)
            if callback is not None:
                callback()

    def evict(self) -> None:
        """Move the bytes to host memory and give the lent memory back now (called by the lender).

        On an accelerator the copy goes into pinned memory, queued on the current stream (no host
        sync): whatever reuses the lent bytes on that stream runs after it, a decode copies back on it,
        and a host-side read waits for it (`host_ready`)."""
        if self._on_release is None or self.evicted:
            return
        on_device = self.buffer.device.type != "cpu"
        host = ledger().buffer((self.buffer.numel(),), torch.uint8, on_device, "evictions", self._host_tier)
        host.copy_(self.buffer, non_blocking=on_device)
        if on_device:
            from deepspeed.accelerator import get_accelerator

            self._copied = get_accelerator().Event()
            self._copied.record()
        self.buffer = host
        self.evicted = True
        callback, self._on_release = self._on_release, None
        callback()


class StorageProvider(Protocol):
    """Lends device memory to packed activations (see the module docstring)."""

    def lease(self, nbytes: int, device: torch.device) -> Optional[Lease]:
        """A lease over ``nbytes`` on ``device``, or ``None`` to decline."""


__all__ = ["Lease", "StorageProvider"]
