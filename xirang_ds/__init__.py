"""xirang_ds: cut the device memory of large-model training under DeepSpeed and Megatron-core.

Switch it on with one ``"xirang"`` block in an ordinary ds_config and call `initialize` instead
of ``deepspeed.initialize`` (same arguments, same 4-tuple), or call `patch_deepspeed` once when
the training code is not yours.

``import xirang_ds`` imports neither deepspeed nor megatron: the DeepSpeed integration loads on
first use of `initialize`, `patch_deepspeed` or `unpatch_deepspeed`.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

import logging as _logging  # noqa: E402


def _configure_logger() -> None:
    """xirang's own console logger, like DeepSpeed's: INFO to stderr unless the user configured one."""
    log = _logging.getLogger("xirang_ds")
    if not log.handlers:
        handler = _logging.StreamHandler()
        handler.setFormatter(_logging.Formatter("[xirang] %(message)s"))
        log.addHandler(handler)
        log.setLevel(_logging.INFO)
        log.propagate = False


_configure_logger()

from xirang_ds.config import XirangConfig, XirangConfigError, load_config  # noqa: E402
from xirang_ds.registry import OptimizerSpec, Plugin, register_plugin  # noqa: E402

_LAZY = {
    "initialize": "xirang_ds.integration.deepspeed",
    "patch_deepspeed": "xirang_ds.integration.deepspeed",
    "unpatch_deepspeed": "xirang_ds.integration.deepspeed",
    "MemoryTracker": "xirang_ds.memory.tracker",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xirang_ds' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["MemoryTracker", "OptimizerSpec", "Plugin", "XirangConfig", "XirangConfigError", "initialize",
           "load_config", "patch_deepspeed", "register_plugin", "unpatch_deepspeed", "__version__"]
