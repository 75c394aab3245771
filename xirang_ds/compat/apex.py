"""NVIDIA Apex's AMP registries, read when Apex is importable (never installed by xirang_ds).

Apex's registry form (``apex/amp/amp.py``, https://github.com/NVIDIA/apex/blob/master/apex/amp/amp.py)
keeps ``register_half_function(module, name)`` and ``register_float_function(module, name)`` as
``(module, name, cast_fn)`` in ``_USER_CAST_REGISTRY`` (``cast_fn`` is ``utils.maybe_half`` or
``utils.maybe_float``) and ``register_promote_function`` as ``(module, name)`` in
``_USER_PROMOTE_REGISTRY``. Apex clears both when ``amp.init()`` runs. PyPI's ``apex`` is an unrelated
package without ``amp``: it reads as no Apex.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, NamedTuple, Optional

UPSTREAM_NAMES: dict[str, str] = {
    "apex.amp.amp._USER_CAST_REGISTRY": "apex/amp/amp.py",
    "apex.amp.amp._USER_PROMOTE_REGISTRY": "apex/amp/amp.py",
    "apex.amp.utils.maybe_half": "apex/amp/utils.py",
    "apex.amp.utils.maybe_float": "apex/amp/utils.py",
}
"""Dotted path in Apex → its file (``tests/structure/test_compat.py`` resolves them when Apex is importable)."""


class AmpRegistrations(NamedTuple):
    """What was registered with Apex AMP, as ``(module, name)`` pairs."""

    half: list[tuple[Any, str]]
    float: list[tuple[Any, str]]
    promote: list[tuple[Any, str]]


def _apex_amp() -> Optional[tuple[Any, Any]]:
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


def amp_registrations() -> Optional[AmpRegistrations]:
    """The functions registered with Apex AMP, each list sorted by (module, name); ``None`` without Apex."""
    found = _apex_amp()
    if found is None:
        return None
    amp, utils = found
    order = lambda r: (str(r[0]), r[1])  # noqa: E731
    half, floats = [], []
    for module, name, cast_fn in sorted(amp._USER_CAST_REGISTRY, key=order):
        if cast_fn is getattr(utils, "maybe_half", None):
            half.append((module, name))
        elif cast_fn is getattr(utils, "maybe_float", None):
            floats.append((module, name))
    promote = [(m, n) for m, n in sorted(getattr(amp, "_USER_PROMOTE_REGISTRY", ()), key=order)]
    return AmpRegistrations(half, floats, promote)


__all__ = ["AmpRegistrations", "UPSTREAM_NAMES", "amp_registrations"]
