"""The one place where xirang_ds touches what its frameworks do not publish.

* `xirang_ds.compat.torch`: PyTorch's private names (saved-tensor hooks, the dispatcher, storages).
* `xirang_ds.compat.deepspeed`: DeepSpeed's engine and ZeRO optimizers' private methods and attributes.
* `xirang_ds.compat.megatron`: megatron-core's internals (grad buffers, optimizer members, RNG tracker).
* `xirang_ds.compat.apex`: NVIDIA Apex's amp registries, read when Apex is importable.
* `xirang_ds.compat.accelerate`: Accelerate's ``"auto"`` filling of the ds_config, kept off the block.

Each module names its version range, the release its names were read in, and each name's upstream
file and line. ``tests/structure/test_compat.py`` checks two things: every name listed there still resolves in the
installed packages, and no module of ``xirang_ds`` or ``xirang_ds.plugins`` outside this folder reaches a
private name of another package itself (an attribute, an import, or a ``getattr``/``setattr``/
``wrap_method`` string that starts with one underscore and that xirang_ds does not define).
"""
from __future__ import annotations

import importlib
from typing import Any


def resolve(path: str) -> Any:
    """The object at a dotted path (``"torch._C._DisableAutocast"``): the longest importable module
    prefix, then attributes. An attribute that only instances have is read from an instance made with no
    arguments (``torch.nn.Module._parameters``).

    Raises:
        ImportError: no prefix of the path imports.
        AttributeError: an attribute is missing (upstream moved it).
    """
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    else:
        raise ImportError(f"no module of {path!r} imports")
    for name in parts[i:]:
        try:
            obj = getattr(obj, name)
        except AttributeError:
            if not isinstance(obj, type):
                raise
            obj = getattr(obj(), name)
    return obj


__all__ = ["resolve"]
