"""The dispatch mode through which the tracker sees every tensor an op returns.

A ``TorchDispatchMode`` sees every op's outputs; the tracker (`xirang_ds.memory.tracker`) gives each new
storage of its device type a record. An output that aliases an input (a view, an in-place or out= op,
known from the op's schema) is not a new storage.
"""
from __future__ import annotations

from typing import Any

import torch

from xirang_ds.compat.torch import TorchDispatchMode, op_schema



_ALIASING: dict[Any, bool] = {}


def returns_alias(func: Any) -> bool:
    """True for ops whose outputs alias an input (views, in-place and out= ops)."""
    known = _ALIASING.get(func)
    if known is None:
        schema = op_schema(func)
        known = bool(schema is not None and any(r.alias_info is not None for r in schema.returns))
        _ALIASING[func] = known
    return known


class TrackingMode(TorchDispatchMode):
    def __init__(self, tracker: Any):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tracker = self.tracker
        if tracker.record_uses or tracker.record_backward_uses and tracker.phase == "backward":
            tracker._use(args, kwargs)
        if tracker.on_op is not None:
            tracker.on_op(func, args, kwargs, out)
        # An output that aliases an input is not a new storage: only a known storage is looked
        # at (it may have been resized in place); an untracked one stays untracked.
        new = not returns_alias(func)
        if isinstance(out, torch.Tensor):
            tracker._see(out, func, new=new)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    tracker._see(t, func, new=new)
                elif isinstance(t, (tuple, list)):
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            tracker._see(u, func, new=new)
        # In-place ops that resize an argument (resize_, set_) return it, so `_see` catches the
        # new size through the output; out= ops return their out tensor likewise.
        return out
