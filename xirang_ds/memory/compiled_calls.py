"""The tracker around torch.compile'd modules: the compiled kernels run, and what they keep is counted.

Dynamo runs a frame eagerly under a ``TorchDispatchMode``, so while the live-storage tracker runs, a
compiled module would run its eager twin (other numerics, other memory). `watch_compiled` wraps the
compiled call of every compiled module of a model (`xirang_ds.compat.torch.compiled_entry`): every
dispatch mode is off inside it, and what the call saves for backward (a saved-tensor pack hook,
composed with any pair active outside it) and returns is registered with the tracker, the saved
tensors as activations. On CPU the tracker therefore does not see a compiled call's transient buffers;
on accelerators the allocator's counter sees everything. The activations plugin wraps the modules it
plans the same way (`plugins/activations/compiled.py`); the two compose.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from xirang_ds.compat.torch import (
    compiled_entry,
    current_saved_tensors_hooks,
    disable_current_modes,
    is_checkpoint_hook,
    outside_dynamo,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
)
from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import ACTIVATIONS
from xirang_ds.memory.tracker import MemoryTracker


def watch_compiled(tracker: MemoryTracker, model: torch.nn.Module, known: Sequence[Any] = ()) -> list[Any]:
    """Wrap the compiled call of ``model`` and of every compiled module inside it, except those ``known``
    handles already wrap; returns the new handles."""
    watched = {id(h.obj) for h in known if isinstance(getattr(h, "wrapper", None), _Call)}
    handles = []
    for module in model.modules():
        entry = compiled_entry(module)
        if entry is not None and id(module) not in watched:
            handles.append(wrap_method(module, entry, _Call(tracker), over_instance=True))
    return handles


class _Call:
    """One compiled module's call with every dispatch mode off, its saved tensors and outputs registered."""

    def __init__(self, tracker: MemoryTracker):
        self.tracker = tracker

    def __call__(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        tracker = self.tracker
        if not tracker.active:
            return original(*args, **kwargs)
        outer = current_saved_tensors_hooks()
        seeing = torch.is_grad_enabled() and not is_checkpoint_hook(outer)
        if seeing:
            push_saved_tensors_hooks(*_seeing_hooks(tracker, outer))
        try:
            with disable_current_modes():
                out = original(*args, **kwargs)
        finally:
            if seeing:
                pop_saved_tensors_hooks()
        tracker.seed([out], ACTIVATIONS if torch.is_grad_enabled() else None)
        return out


def _seeing_hooks(tracker: MemoryTracker, outer: Any) -> tuple[Callable, Callable]:
    """A pack hook that registers each saved tensor the device keeps, after the outer pair's pack (which
    may move it elsewhere), and the outer pair's unpack."""
    def pack(t: torch.Tensor) -> Any:
        with tracker.resumed():
            packed = outer[0](t) if outer is not None else t
            if isinstance(packed, torch.Tensor):
                tracker.seed([packed], ACTIVATIONS)
        return packed

    def unpack(packed: Any) -> torch.Tensor:
        return outer[1](packed) if outer is not None else packed

    return outside_dynamo(pack), outside_dynamo(unpack)


__all__ = ["watch_compiled"]
