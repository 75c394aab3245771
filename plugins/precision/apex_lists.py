"""Functions registered with NVIDIA Apex AMP, honoured when Apex is importable.

`xirang_ds.compat.apex` reads Apex's registries. A registered name must be an ATen operator
(``torch.sigmoid`` is ``aten::sigmoid``); a Python-only function cannot be cast at the dispatcher and is
an error.
"""
from __future__ import annotations

from typing import Any

from xirang_ds.compat.apex import amp_registrations
from xirang_ds.plugins.precision.op_lists import OpNameError, Registrations, resolve


def apex_registrations(path: str, problems: list[tuple[str, str]]) -> Registrations:
    """The op names registered with Apex AMP (empty without NVIDIA Apex); bad names become problems."""
    found = amp_registrations()
    if found is None:
        return Registrations()

    def take(pairs: list[tuple[Any, str]], how: str) -> tuple[str, ...]:
        names = []
        for module, name in pairs:
            try:
                resolve(name)
            except OpNameError as e:
                where = getattr(module, "__name__", repr(module))
                problems.append((path, f"apex.amp.{how}({where}, {name!r}): {e}; xirang's lists act on ATen "
                                       f"operators, so register the operator the function calls instead"))
                continue
            names.append(name)
        return tuple(names)

    return Registrations(half=take(found.half, "register_half_function"),
                         float=take(found.float, "register_float_function"),
                         promote=take(found.promote, "register_promote_function"))


__all__ = ["apex_registrations"]
