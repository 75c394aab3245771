"""Module-level rules: ``fp32_modules`` globs, and Megatron-core's tensor-parallel linear layers.

* An fp32 module runs with autocast off and its floating inputs widened to fp32 (the widening
  saved narrow, see `recast`); its weights are fp32 masters already, so nothing else is cast.
  Globs match full module names (``fnmatchcase``: ``"blocks.2"`` does not match ``"blocks.20"``);
  a glob that matches no module is an error.
* Megatron-core's ``ColumnParallelLinear``/``RowParallelLinear`` compute in a custom autograd
  function whose backward does its own matmuls. Under ``torch.autocast`` its forward casts per
  op, but its backward only sees autocast again through ``custom_bwd(device_type="cuda")``: on
  other devices it multiplies a 16-bit gradient with the fp32 weight and fails. So the layer
  runs as a whole in the dtype the lists give ``matmul``: its inputs and its weight and bias cast
  once (the weight copy made on demand and remade in backward, like every weight copy), with
  autocast off inside. On CUDA this is also what Megatron's own bf16 mode computes.
"""
from __future__ import annotations

import contextlib
import fnmatch
import sys
from typing import Any, Callable, Iterator, Optional

import torch

from xirang_ds.compat.torch import DisableAutocast, parameter_table
from xirang_ds.plugins.precision.recast import CastSet


def match_modules(model: torch.nn.Module, globs: tuple[str, ...], path: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Names of the modules matched by any glob, in model order; a glob matching none is a problem."""
    names = [n for n, _ in model.named_modules() if n]
    matched: list[str] = []
    problems: list[tuple[str, str]] = []
    for i, glob in enumerate(globs):
        hits = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not hits:
            import difflib

            close = difflib.get_close_matches(glob, names, n=3, cutoff=0.5)
            hint = f"; close names: {', '.join(close)}" if close else f"; module names look like {', '.join(names[:4])}"
            problems.append((f"{path}[{i}]", f"glob {glob!r} matches no module (globs match full names, like "
                                             f"\"blocks.*.ln_1\"){hint}"))
        matched.extend(h for h in hits if h not in matched)
    order = {n: i for i, n in enumerate(names)}
    return sorted(matched, key=order.__getitem__), problems


def outermost(names: list[str]) -> list[str]:
    """Drop names inside another listed name (``blocks.0.ln`` under ``blocks.0``)."""
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


@contextlib.contextmanager
def _swapped_parameters(module: torch.nn.Module, casts: CastSet, dtype: torch.dtype) -> Iterator[None]:
    """The module's own parameters replaced by ``dtype`` copies for the duration of the block."""
    table = parameter_table(module)
    originals = dict(table)
    try:
        for name, p in originals.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                table[name] = casts.cast(p, dtype)  # bypasses Module.__setattr__ on purpose
        yield
    finally:
        table.update(originals)


class ModuleCast:
    """Runs a module's forward in one dtype; ``forward`` is the `xirang_ds.hooks.wrap_method` wrapper.

    Args:
        module: the module whose ``forward`` is wrapped.
        device_type: the autocast device; the wrapper does nothing outside autocast on it.
        dtype: a fixed dtype, or a callable giving it per call (Megatron layers follow ``matmul``).
        weight_scope: context factory entered while weight copies are made.
        narrow_upcasts: save widened inputs narrow (see `recast`).
        cast_parameters: also run on copies of the module's own parameters in ``dtype``.
    """

    def __init__(self, module: torch.nn.Module, device_type: str, dtype: "torch.dtype | Callable[[], torch.dtype]",
                 weight_scope: Callable[[], Any], narrow_upcasts: bool, cast_parameters: bool) -> None:
        self.module = module
        self.device_type = device_type
        self.dtype = dtype
        self.weight_scope = weight_scope
        self.narrow_upcasts = narrow_upcasts
        self.cast_parameters = cast_parameters

    def forward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_autocast_enabled(self.device_type):
            return original(*args, **kwargs)
        dtype = self.dtype() if callable(self.dtype) else self.dtype
        device, fp64 = self.device_type, torch.float64

        def target(t: torch.Tensor) -> Optional[torch.dtype]:
            return dtype if t.is_floating_point() and t.dtype is not fp64 and t.device.type == device else None

        casts = CastSet(self.weight_scope, self.narrow_upcasts)
        with DisableAutocast():
            args = casts.map(args, target)
            kwargs = {k: casts.map(v, target) for k, v in kwargs.items()}
            swap = _swapped_parameters(self.module, casts, dtype) if self.cast_parameters else contextlib.nullcontext()
            with swap, casts.saving():
                return original(*args, **kwargs)


def megatron_layer_types() -> tuple[type, ...]:
    """Megatron-core's tensor-parallel linear layers, if the user's program imported Megatron-core."""
    layers = sys.modules.get("megatron.core.tensor_parallel.layers")
    if layers is None:
        return ()
    return tuple(getattr(layers, n) for n in ("ColumnParallelLinear", "RowParallelLinear") if hasattr(layers, n))


__all__ = ["ModuleCast", "match_modules", "megatron_layer_types", "outermost"]
