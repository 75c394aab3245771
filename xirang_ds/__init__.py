"""xirang_ds: cut the device memory of large-model training under DeepSpeed and Megatron-core.

Switch it on with one ``"xirang"`` block in an ordinary ds_config and call `initialize` instead
of ``deepspeed.initialize`` (same arguments, same 4-tuple), or call `patch_deepspeed` once when
the training code is not yours.

``import xirang_ds`` imports neither deepspeed nor megatron: the DeepSpeed integration loads on
first use of `initialize`, `patch_deepspeed` or `unpatch_deepspeed`.
"""
from __future__ import annotations

from typing import Any

from xirang_ds.version import __version__

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


def _checkout_plugins() -> None:
    """Name the repository's ``plugins/`` folder as ``xirang_ds.plugins`` when a source checkout is imported.

    setup.py installs that top-level folder under ``xirang_ds`` through ``package_dir``, so an
    install has ``xirang_ds/plugins``; a checkout does not, and only an editable install's finder
    knew where the plugins were. A checkout ahead of an install on ``sys.path`` (a script or pytest
    run from the repository root) then failed with "No module named 'xirang_ds.plugins'". The finder
    is consulted last, so an install's or an editable finder's answer comes first.
    """
    import importlib.abc
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    folder = os.path.join(os.path.dirname(here), "plugins")
    if os.path.isdir(os.path.join(here, "plugins")) or not os.path.isfile(os.path.join(folder, "__init__.py")):
        return  # an install, or a tree without the plugins

    class CheckoutPlugins(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):  # noqa: ANN001 (the finder protocol)
            if name != "xirang_ds.plugins":
                return None
            return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                          submodule_search_locations=[folder])

    if not any(type(f).__name__ == "CheckoutPlugins" for f in sys.meta_path):
        sys.meta_path.append(CheckoutPlugins())


_checkout_plugins()

from xirang_ds.config import XirangConfig, XirangConfigError, load_config  # noqa: E402
from xirang_ds.registry import OptimizerSpec, Plugin, register_plugin  # noqa: E402

_LAZY = {
    "initialize": "xirang_ds.integration.deepspeed",
    "patch_deepspeed": "xirang_ds.integration.deepspeed",
    "unpatch_deepspeed": "xirang_ds.integration.deepspeed",
    "MemoryTracker": "xirang_ds.memory.tracker",
    "MemoryReport": "xirang_ds.memory.usage",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xirang_ds' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["MemoryReport", "MemoryTracker", "OptimizerSpec", "Plugin", "XirangConfig", "XirangConfigError", "initialize",
           "load_config", "patch_deepspeed", "register_plugin", "unpatch_deepspeed", "__version__"]
