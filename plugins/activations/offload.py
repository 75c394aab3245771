"""Asynchronous copies of saved storages to host memory and back, with prefetch in backward.

Device-to-host: the side stream waits for the compute stream (the tensor is final when it is
saved), copies into a pooled pinned buffer and ``record_stream`` keeps the device block from being
reused before the copy ends; forward continues meanwhile. Host-to-device: when backward reaches an
offloaded module (a hook on its output's gradient), the copies of the next ``prefetch`` offloaded
modules in backward order start on the side stream, so they are ready when their unpack asks;
unpack makes the compute stream wait on the copy's event only.

All stream and event calls go through ``deepspeed.accelerator.get_accelerator()``. The CPU
accelerator has no streams: copies are synchronous and a module's tensors come back on demand, at
its first unpack (prefetching would only bring memory back earlier). On CPU the host tier is
accounted, not physically separate: host buffers are created inside the tracker's host tier.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, ContextManager, Optional

import torch

from xirang_ds.compat.torch import graph_retained
from xirang_ds.plugins.activations.storage import HostPool


class HostCopy:
    """One storage's bytes on the host, and (after a fetch) on the device again.

    Attributes:
        nbytes: size in bytes.
        device: where the bytes came from and go back to.
    """

    __slots__ = ("host", "nbytes", "device", "d2h", "dev", "h2d", "__weakref__")

    def __init__(self, host: torch.Tensor, nbytes: int, device: torch.device, d2h: Any):
        self.host, self.nbytes, self.device, self.d2h = host, nbytes, device, d2h
        self.dev: Optional[torch.Tensor] = None
        self.h2d: Any = None


class OffloadGroup:
    """The host copies of one module call, linked to the group offloaded just before it."""

    __slots__ = ("copies", "previous", "__weakref__")

    def __init__(self, previous: Optional["OffloadGroup"]):
        self.copies: list[HostCopy] = []
        self.previous = weakref.ref(previous) if previous is not None else None


class Offloader:
    """Moves storages to pooled host buffers and back through the accelerator's streams.

    Args:
        device: the training device.
        prefetch: how many offloaded groups ahead backward prefetches (streams only).
        host_tier: the tracker's host-tier context.
        scope: context for tensors brought back to the device (the tracker's activations scope).
        host_budget_bytes: without ``ledger``: the most host bytes the offload buffers may hold; a storage
            that does not fit stays on the device.
        ledger: the `xirang_ds.memory.host_ledger.HostLedger` the buffers are counted in, whose budget
            (``xirang.host_memory_budget``, over every host tier) applies.
    """

    def __init__(self, device: torch.device, prefetch: int = 1,
                 host_tier: Optional[Callable[[], ContextManager]] = None,
                 scope: Optional[Callable[[], ContextManager]] = None, host_budget_bytes: Optional[int] = None,
                 ledger: Any = None):
        from deepspeed.accelerator import get_accelerator

        self.acc = get_accelerator()
        self.device = device
        self.prefetch = prefetch
        self.scope = scope or contextlib.nullcontext
        on_accelerator = device.type != "cpu" and self.acc.Stream is not None
        self.stream = self.acc.Stream() if on_accelerator else None
        self.pool = HostPool(pin=on_accelerator, host_tier=host_tier, budget_bytes=host_budget_bytes, ledger=ledger)
        self.last_group: Optional[OffloadGroup] = None
        self.offloaded_bytes = 0
        self.fetched_bytes = 0
        self.kept_on_device_bytes = 0
        """Bytes the host budget refused, kept on the device instead (`HostPool.refused`)."""

    # ---------------------------------------------------------------------------------------------
    def begin_group(self) -> OffloadGroup:
        """Start the group of one module call (forward order)."""
        group = OffloadGroup(self.last_group)
        self.last_group = group
        return group

    def to_host(self, flat: torch.Tensor, group: Optional[OffloadGroup] = None) -> HostCopy:
        """Start copying the bytes of ``flat`` (a 1-D ``uint8`` view of a storage) to host memory."""
        nbytes = flat.numel()
        host = self.pool.get(nbytes)
        if host is None:  # the host-memory budget is full: these bytes stay on the device
            copy = HostCopy(None, nbytes, flat.device, None)
            copy.dev = flat
            self.kept_on_device_bytes += nbytes
            return copy
        event = None
        if self.stream is not None:
            self.stream.wait_stream(self.acc.current_stream())
            with self.acc.stream(self.stream):
                host.copy_(flat, non_blocking=True)
                event = self.acc.Event()
                event.record(self.stream)
            flat.record_stream(self.stream)
        else:
            host.copy_(flat)
        copy = HostCopy(host, nbytes, flat.device, event)
        if group is not None:
            group.copies.append(copy)
        self.offloaded_bytes += nbytes
        return copy

    def start_fetch(self, copy: HostCopy, keep: bool = False) -> None:
        """Start the host-to-device copy of ``copy`` (no-op when already started); with ``keep`` the host
        buffer stays with ``copy`` (a backward over a retained graph: the next one fetches it again)."""
        if copy.dev is not None or copy.host is None:
            return
        with self.scope():
            if self.stream is not None:
                with self.acc.stream(self.stream):
                    copy.dev = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
                    copy.dev.copy_(copy.host, non_blocking=True)
                    copy.h2d = self.acc.Event()
                    copy.h2d.record(self.stream)
                if not keep:
                    self.pool.put(copy.host, copy.h2d)
            else:
                copy.dev = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
                copy.dev.copy_(copy.host)
                if not keep:
                    self.pool.put(copy.host)
        if not keep:
            copy.host = None
        self.fetched_bytes += copy.nbytes

    def fetch(self, copy: HostCopy, keep: bool = False) -> torch.Tensor:
        """The bytes back on the device, ready for the compute stream (the copy keeps no reference, except
        with ``keep`` where the bytes never left the device: the host budget was full)."""
        self.start_fetch(copy, keep)
        dev = copy.dev
        if not keep or copy.host is not None:
            copy.dev = None
        if dev is None:
            raise RuntimeError("xirang activations: an offloaded tensor was unpacked again after a backward "
                               "that did not retain its graph handed its bytes back")
        if self.stream is not None and copy.h2d is not None:  # None: kept on the device (host budget)
            current = self.acc.current_stream()
            current.wait_event(copy.h2d)
            dev.record_stream(current)
        return dev

    def backward_reached(self, group: OffloadGroup) -> None:
        """Backward arrived at the module of ``group``: prefetch it and the groups before it."""
        if self.stream is None:
            return
        g: Optional[OffloadGroup] = group
        for _ in range(self.prefetch + 1):
            if g is None:
                break
            for copy in g.copies:
                self.start_fetch(copy, graph_retained())
            g = g.previous() if g.previous is not None else None

    def end_forward(self) -> None:
        """Forget the group chain (a new forward starts its own)."""
        self.last_group = None

    def synchronize(self) -> None:
        """Wait for every copy in flight."""
        if self.stream is not None:
            self.stream.synchronize()

