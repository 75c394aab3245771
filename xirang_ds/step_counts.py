"""What one training step asks of the device, counted rather than timed.

A CPU hides what dominates a GPU step beside its arithmetic: a kernel launch, a host sync and a host
copy cost next to nothing there. So the bench and the GPU check count them for one step:

* ``ops``: ATen ops that compute (views and metadata-only ops left out), seen by a dispatch mode;
  the same count on any machine for the same program, and the eager launch count's upper bound;
* ``kernels`` and ``memcpys`` (CUDA only): device kernels and copies the profiler saw launched;
* ``host_syncs`` (CUDA only): the times the host waited for the device, as
  ``torch.cuda.set_sync_debug_mode`` reports them (``.item()``, ``bool(tensor)``, a copy to pageable
  host memory, ``nonzero``...).

Example:
    counts = count_step(lambda: optimizer_step(engine, data), device)
    counts.as_dict()   # {"ops": 691, "kernels": 702, "memcpys": 3, "host_syncs": 4}
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from xirang_ds.compat.torch import TorchDispatchMode, op_schema

_FREE: dict[Any, bool] = {}


def _launches_nothing(func: Any) -> bool:
    """Views (outputs alias an input without writing it) and ops on sizes alone compute nothing."""
    known = _FREE.get(func)
    if known is None:
        schema = op_schema(func)
        aliases = schema is not None and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        known = bool(aliases or func in _SIZE_OPS)
        _FREE[func] = known
    return known


_SIZE_OPS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
             torch.ops.aten.sym_storage_offset.default, torch.ops.aten.is_same_size.default}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _launches_nothing(func):
            self.ops += 1
        return func(*args, **(kwargs or {}))


@dataclass
class StepCounts:
    """One step's launches and waits (`count_step`); ``None`` where the device cannot tell."""

    ops: Optional[int]
    kernels: Optional[int] = None
    memcpys: Optional[int] = None
    host_syncs: Optional[int] = None

    def as_dict(self) -> dict[str, Optional[int]]:
        return asdict(self)


def count_ops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` under an op-counting dispatch mode; its result and the ops that compute."""
    mode = _OpCounter()
    with mode:
        out = fn()
    return out, mode.ops


def _device_events(fn: Callable[[], Any]) -> tuple[int, int]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = memcpys = 0
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        if event.name.startswith(("Memcpy", "Memset")):
            memcpys += 1
        else:
            kernels += 1
    return kernels, memcpys


def _host_syncs(fn: Callable[[], Any]) -> int:
    """Synchronizing calls in ``fn``: debug mode 1 makes each one warn (c10's ``warn_or_error_on_sync``)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(1 for w in caught if "synchronizing" in str(w.message))


def count_step(step: Callable[[], Any], device: torch.device | str = "cpu") -> StepCounts:
    """Counts for ``step``, which is run once per count: ops under a dispatch mode, then on CUDA once
    under the profiler (kernels, copies) and once in sync debug mode (host syncs). Each run is a real
    step (the model trains three steps): count after the timed steps. A step that cannot run under a
    dispatch mode (Dynamo declines to trace under one) leaves ``ops`` ``None``."""
    try:
        _, ops = count_ops(step)
    except Exception:  # e.g. a compiled region refused under the mode: counted on the device alone
        ops = None
    if torch.device(device).type != "cuda":
        return StepCounts(ops=ops)
    torch.cuda.synchronize()
    kernels, memcpys = _device_events(step)
    syncs = _host_syncs(step)
    return StepCounts(ops=ops, kernels=kernels, memcpys=memcpys, host_syncs=syncs)


__all__ = ["StepCounts", "count_step", "count_ops"]
