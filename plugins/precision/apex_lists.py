"""Functions registered with NVIDIA Apex AMP, honoured when Apex is importable.

Apex's registry form (``apex/amp/amp.py``, https://github.com/NVIDIA/apex/blob/master/apex/amp/amp.py)
keeps ``register_half_function(module, name)`` and ``register_float_function(module, name)`` as
``(module, name, cast_fn)`` in ``_USER_CAST_REGISTRY`` (``cast_fn`` is ``utils.maybe_half`` or
``utils.maybe_float``) and ``register_promote_function`` as ``(module, name)`` in
``_USER_PROMOTE_REGISTRY``. Apex clears both when ``amp.init()`` runs.

Apex is never installed by xirang (PyPI's ``apex`` is an unrelated package, which has no ``amp``
and is ignored here). A registered name must be an ATen operator (``torch.sigmoid`` is
``aten::sigmoid``); a Python-only function cannot be cast at the dispatcher and is an error.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from xirang_ds.plugins.precision.op_lists import OpNameError, Registrations, resolve


def _apex_amp() -> tuple[Any, Any] | None:
    """``(apex.amp.amp, apex.amp.utils)`` of NVIDIA Apex, or ``None``."""
    try:
        if importlib.util.find_spec("apex") is None or importlib.util.find_spec("apex.amp") is None:
            return None
        amp = importlib.import_module("apex.amp.amp")
        utils = importlib.import_module("apex.amp.utils")
    except ImportError:
        return None
    if not hasattr(amp, "_USER_CAST_REGISTRY"):
        return None
    return amp, utils


def apex_registrations(path: str, problems: list[tuple[str, str]]) -> Registrations:
    """The op names registered with Apex AMP (empty without NVIDIA Apex); bad names become problems."""
    found = _apex_amp()
    if found is None:
        return Registrations()
    amp, utils = found
    half, floats, promote = [], [], []

    def take(module: Any, name: str, into: list[str], how: str) -> None:
        try:
            resolve(name)
        except OpNameError as e:
            where = getattr(module, "__name__", repr(module))
            problems.append((path, f"apex.amp.{how}({where}, {name!r}): {e}; xirang's lists act on ATen "
                                   f"operators, so register the operator the function calls instead"))
            return
        into.append(name)

    for module, name, cast_fn in sorted(amp._USER_CAST_REGISTRY, key=lambda r: (str(r[0]), r[1])):
        if cast_fn is getattr(utils, "maybe_half", None):
            take(module, name, half, "register_half_function")
        elif cast_fn is getattr(utils, "maybe_float", None):
            take(module, name, floats, "register_float_function")
    for module, name in sorted(getattr(amp, "_USER_PROMOTE_REGISTRY", ()), key=lambda r: (str(r[0]), r[1])):
        take(module, name, promote, "register_promote_function")
    return Registrations(half=tuple(half), float=tuple(floats), promote=tuple(promote))


__all__ = ["apex_registrations"]
