"""torch.compile'd modules as units planned at their boundary.

Dynamo breaks its graph at a ``saved_tensors_hooks`` entered inside traced code (the plain per-module
wrappers), and runs a frame eagerly under a ``TorchDispatchMode`` (the live-storage tracker, the
profiler's op timer). Hooks entered *outside* the compiled call see every tensor the compiled graph
saves for backward and change nothing in it. So a candidate that runs compiled (a block compiled with
``torch.compile(block)`` or ``block.compile()``, or the whole model: compiled before ``initialize``, or
by ``engine.compile()`` after it, named `REGION`) is one unit, wrapped at its compiled entry
(`xirang_ds.compat.torch.compiled_entry`):

* every dispatch mode is off while the compiled code runs, so its kernels are the compiled plain run's;
  the pack hooks run tracked again, and what the unit keeps (saved tensors, outputs) is registered
  with the tracker as activations. On CPU the tracker therefore does not see a compiled unit's
  transient buffers; on accelerators the allocator's counter sees everything;
* options: keep, recompute, compress, offload, recompute_offload, and the lossy ones where tolerant,
  each applied from outside the compiled call (a recompute runs the compiled code again). Selective
  recompute (an op-level choice) and ``chunk`` (a deferred head) need hooks inside and do not apply;
  candidates inside a compiled module are replaced by it;
* profiling times the unit as one call, and prices its saved tensors as all back at once when its one
  backward node runs (no restore on demand).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from xirang_ds.compat.torch import compiled_entry, disable_current_modes, pytree
from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import ACTIVATIONS
from xirang_ds.plugins.activations.head_loss import DeferredLogits
from xirang_ds.plugins.activations.saved import PackContext
from xirang_ds.plugins.activations.wrapper import ModuleWrapper, Runtime, never

REGION = "<compiled model>"
"""The whole model as a unit, in plans, profiles and checkpoints."""

INSIDE_ONLY = ("selective_recompute", "chunk")
"""Options that need hooks inside the compiled code."""


def compiled_region(engine: Any) -> Optional[str]:
    """How the engine's whole model runs compiled (``None``: it does not)."""
    module = getattr(engine, "module", None)
    entry = compiled_entry(module) if isinstance(module, torch.nn.Module) else None
    if entry == "forward":
        return "the model was compiled before initialize"
    if entry is not None:
        return "the model runs compiled (engine.compile() or model.compile())"
    return None


def compiled_units(model: torch.nn.Module, candidates: list[str]) -> tuple[list[str], set[str]]:
    """``candidates`` with each one inside a compiled module replaced by that module (the outermost),
    and the names of the compiled modules among the result."""
    compiled = {name for name, m in model.named_modules() if name and compiled_entry(m) is not None}
    out: list[str] = []
    for name in candidates:
        outer = [c for c in compiled if name == c or name.startswith(c + ".")]
        unit = min(outer, key=len) if outer else name
        if unit not in out:
            out.append(unit)
    return out, {n for n in out if n in compiled}


def fixed_problems(fixed: dict[str, str], compiled: set[str], region: Optional[str]) -> list[tuple[str, str]]:
    """Fixed options that cannot apply: on a module inside compiled code, or one that needs hooks inside."""
    problems = []
    for name, option in fixed.items():
        inside = [c for c in compiled if name.startswith(c + ".")]
        if region is not None or inside:
            where = f"the compiled model ({region})" if region is not None else f"the compiled module {inside[0]!r}"
            problems.append((f"xirang.activations.{option}", f"{name!r} runs inside {where}, where no per-module "
                                                             "option applies; remove it, or name the compiled module"))
        elif name in compiled and option in INSIDE_ONLY:
            problems.append((f"xirang.activations.{option}", f"{name!r} runs compiled, and {option} needs hooks "
                                                             "inside its compiled code; use recompute"))
    return problems


def synchronizer(device: torch.device) -> Callable[[], None]:
    """The accelerator's synchronize (nothing on CPU): what timings wait for."""
    if device.type == "cpu":
        return lambda: None
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().synchronize


def _whole(value: Any) -> Any:
    return value.whole("a compiled module") if isinstance(value, DeferredLogits) else value


class _TrackedPack(PackContext):
    """A pack context around a compiled call: packs with the tracker running, and registers as
    activations what stays on the device."""

    def __init__(self, handler: Any, eligible: Callable[[torch.Tensor], bool], tracker: Any, reserve: Any = None):
        super().__init__(handler, eligible, reserve)
        self.tracker = tracker

    def pack(self, t: torch.Tensor) -> Any:
        with self.tracker.resumed():
            packed = super().pack(t)
            if isinstance(packed, torch.Tensor):
                self.tracker.seed([t], ACTIVATIONS)
        return packed


class CompiledWrapper(ModuleWrapper):
    """A compiled module under its option, wrapped at its compiled entry (see the module docstring).

    Args:
        name: the unit's name (`REGION` for the whole model).
        module: the compiled module (an ``OptimizedModule``, or a module with ``_compiled_call_impl``).
        runtime: the wrappers' shared `Runtime`.
        tracker: returns the session's tracker (``None`` until something made it).
    """

    def __init__(self, name: str, module: torch.nn.Module, runtime: Runtime, tracker: Callable[[], Any]):
        self.tracker = tracker
        self.synchronize = synchronizer(runtime.device)
        super().__init__(name, module, runtime)

    def _wrap(self) -> Any:
        return wrap_method(self.module, compiled_entry(self.module), self.forward, over_instance=True)

    def _active_tracker(self) -> Any:
        tracker = self.tracker()
        return tracker if tracker is not None and tracker.active else None

    def _pack(self, handler: Any, eligible: Callable[[torch.Tensor], bool], reserve: Any = None) -> PackContext:
        tracker = self._active_tracker()
        return (PackContext(handler, eligible, reserve) if tracker is None
                else _TrackedPack(handler, eligible, tracker, reserve))

    def forward(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        rt = self.runtime
        call = self._outside(original)
        if not torch.is_grad_enabled():
            return call(*args, **kwargs)
        profiling = rt.profiler is not None and bool(rt.profiler.stack)
        if profiling or self.option not in (None, "keep") or self._active_tracker() is None:
            return super().forward(call, *args, **kwargs)
        with self._pack(rt.keep_handler, never):  # keep, registering what it saves with the tracker
            return call(*args, **kwargs)

    def _outside(self, original: Callable) -> Callable:
        """``original`` with every dispatch mode off (timed while profiling); its outputs registered."""
        def call(*args: Any, **kwargs: Any) -> Any:
            profiler = self.runtime.profiler if self.runtime.profiler is not None and self.runtime.profiler.stack \
                else None
            if profiler is not None:
                profiler.profile(self.name).compiled = 1
                self.synchronize()
            # a deferred head's logits going into compiled code are made whole first (Dynamo cannot
            # trace their __torch_function__)
            args, kwargs = pytree.tree_map(_whole, (args, kwargs))
            start = time.perf_counter()
            with disable_current_modes():
                out = original(*args, **kwargs)
            if profiler is not None:
                self.synchronize()
                profiler.record_compiled(time.perf_counter() - start)
            tracker = self._active_tracker()
            if tracker is not None and torch.is_grad_enabled():
                tracker.seed([out], ACTIVATIONS)
            return out

        return call


__all__ = ["INSIDE_ONLY", "REGION", "CompiledWrapper", "compiled_region", "compiled_units", "fixed_problems",
           "synchronizer"]
