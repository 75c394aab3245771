"""Test-only shim: megatron-core 0.19's Python sources imported on Python 3.11 without triton.

megatron-core 0.17 and newer ship cp312 wheels only. Their sources compile under Python 3.11, and two
imports are all that stop the GPT path from importing on this CPU machine (checked with 0.19.2):

* ``typing.override`` (new in 3.12) decorates methods of ``megatron/training/models/*.py``
  (``GPTModelConfig.__getattr__``/``__setattr__``, ...). `install` sets it to ``typing_extensions.override``
  when ``typing`` has none: the same decorator (it only marks the function), back-ported.
* ``megatron/training/models/dist_utils.py`` ``_ddp_wrap`` builds DDP inside a new
  ``torch.cuda.Stream()``; without CUDA, `install` answers ``torch.cuda.Stream``, ``current_stream`` and
  ``stream`` with ``torch.cpu``'s (the same API; on CPU work is ordered anyway).
* ``megatron/core/transformer/moe/ops/paged_stash.py`` does ``import triton`` at module level, reached
  from ``pipeline_parallel/schedules.py`` through ``moe/paged_stash.py``, so every GPT run imports it.
  Its two kernels serve MoE's paged activation stash only (``--moe-paged-stash``), which a dense GPT never
  calls. When ``triton`` does not import, `install` registers a stand-in for that one module (not for
  ``triton``: torch's inductor probes ``triton`` and must keep seeing it absent): its constants are read
  from the file, and each kernel name is bound to a function that raises `TritonUnavailable` when called
  or launched. A kernel that is called fails loudly; nothing is computed in its place. At 0.18 the
  kernels sit in ``moe/paged_stash.py`` itself, with the paged-stash manager around them (only used under
  ``--moe-paged-stash``; the schedules call ``paged_stash_reset`` only then): that whole module is stood
  in for the same way, its functions and classes raising when called.

Nothing in megatron's files is changed; the shim lives in the test process only (the package never
imports this module). The CUDA-only calls megatron makes on CPU are `tests.harness.megatron_shim`'s.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
import typing
from typing import Any, Callable

import torch

SET_ASIDE = (
    "typing.override: typing_extensions.override on Python < 3.12",
    "triton: megatron.core.transformer.moe.ops.paged_stash (two triton kernels, MoE --moe-paged-stash only) "
    "replaced by a stand-in whose kernels raise if called",
    "CUDA streams: torch.cuda.Stream/current_stream/stream answered by torch.cpu's (DDP wrap in "
    "megatron/training/models/dist_utils.py _ddp_wrap opens an initialisation stream)",
    "triton (0.18): megatron.core.transformer.moe.paged_stash (MoE --moe-paged-stash: its triton kernels and "
    "the Python around them, one module at 0.18) replaced by a stand-in whose functions and classes raise if "
    "called",
)
"""What the shim replaces, as recorded with each run."""


PAGED_STASH_KERNELS = "megatron.core.transformer.moe.ops.paged_stash"
"""The one module of the GPT import path that needs triton at 0.19 (two ``@triton.jit`` kernels, nothing else)."""
PAGED_STASH_018 = "megatron.core.transformer.moe.paged_stash"
"""At 0.18 the kernels live in the paged-stash module itself, which imports triton at its top."""


class TritonUnavailable(RuntimeError):
    """A paged-stash kernel was called under the stand-in module (triton is not installed here)."""


def _unavailable_kernel(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise TritonUnavailable(f"paged stash: {name} called, but triton is not installed; "
                                "tests/harness/megatron_v019_shim.py stands in for that module at import only")

    class Launcher:  # kernel[grid](...) is how triton kernels are launched
        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            return kernel

        __call__ = staticmethod(kernel)

    return Launcher()


def _paged_stash_stand_in(path: str, name: str) -> types.ModuleType:
    """The module ``name`` with its functions and classes (read from the file, not executed) bound to
    `_unavailable_kernel`, and its constants."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    module = types.ModuleType(name)
    module.__doc__ = "stand-in from tests/harness/megatron_v019_shim.py: triton is not installed"
    module.__file__ = path
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            setattr(module, node.name, _unavailable_kernel(node.name))
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Constant, ast.List)):
            for target in node.targets:
                setattr(module, target.id, ast.literal_eval(node.value))
    return module


def install() -> list[str]:
    """Put the two stand-ins in place where needed; returns the entries of `SET_ASIDE` that were used."""
    used = []
    if not hasattr(typing, "override"):
        from typing_extensions import override

        typing.override = override
        used.append(SET_ASIDE[0])
    try:
        importlib.import_module("triton")
    except ImportError:
        # the file is located from the top package only: importing megatron.core.transformer (what
        # find_spec of the module would do) already reaches the kernels through the schedules
        spec = importlib.util.find_spec("megatron")
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            kernels = os.path.join(root, *PAGED_STASH_KERNELS.split(".")[1:]) + ".py"
            whole = os.path.join(root, *PAGED_STASH_018.split(".")[1:]) + ".py"
            if os.path.isfile(kernels):
                sys.modules[PAGED_STASH_KERNELS] = _paged_stash_stand_in(kernels, PAGED_STASH_KERNELS)
                used.append(SET_ASIDE[1])
                break
            if os.path.isfile(whole) and "\nimport triton\n" in open(whole, encoding="utf-8").read():
                sys.modules[PAGED_STASH_018] = _paged_stash_stand_in(whole, PAGED_STASH_018)
                used.append(SET_ASIDE[3])
                break
    if not torch.cuda.is_available():
        torch.cuda.Stream = torch.cpu.Stream
        torch.cuda.current_stream = lambda device=None: torch.cpu.current_stream()
        torch.cuda.stream = torch.cpu.stream
        used.append(SET_ASIDE[2])
    return used


__all__ = ["SET_ASIDE", "TritonUnavailable", "install"]
