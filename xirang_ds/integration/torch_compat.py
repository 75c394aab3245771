"""The torch internals xirang_ds reads outside the plugins' own compat modules, in one place.

* ``torch.compile(module)`` returns an ``OptimizedModule`` (``torch/_dynamo/eval_frame.py``, present
  from torch 2.0 to 2.13) that holds the user's module as ``_orig_mod`` and runs it through Dynamo.
  Plugins attach to the modules inside (their hooks and forward wrappers are traced with the rest);
  DeepSpeed still gets the compiled module, so parameter names and checkpoints are those of the plain
  compiled run. ``tests/test_presets.py`` fails when a torch release moves this.
"""
from __future__ import annotations

from typing import Any


def uncompiled(module: Any) -> Any:
    """The module ``torch.compile`` wrapped, or ``module`` itself when it was not compiled."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without Dynamo: nothing can be compiled
        return module
    while isinstance(module, OptimizedModule):
        module = module._orig_mod
    return module


__all__ = ["uncompiled"]
