"""What plugins contribute to the core's tables beyond their class: the fit planner's hand-overs and take-overs.

A plugin's module registers its entries at import, for its own section (`register_fit`); the core asks
here (`hand_overs`, `take_over`) and names no plugin. The built-in plugins are loaded first
(`xirang_ds.registry.load_builtins`), so an entry is there before anyone asks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from xirang_ds.registry import load_builtins


@dataclass(frozen=True)
class HandOver:
    """A key of a section a preset leaves out, handed to the section that does the same job there
    (`xirang_ds.planning.fit`): grad_release's ``masters: none`` becomes optimizer_states' at ZeRO-3."""

    source: str
    key: str
    target: str
    target_key: str


@dataclass(frozen=True)
class TakeOver:
    """A section that takes over the job of a section a preset leaves out, where the preset does not turn it
    on itself (`xirang_ds.planning.fit`): ``keys`` are what it is turned on with, ``job`` what it then does."""

    source: str
    target: str
    keys: dict
    job: str


_HAND_OVERS: list[HandOver] = []
_TAKE_OVERS: dict[str, TakeOver] = {}


def register_fit(entry: Any) -> None:
    """Register a `HandOver` or a `TakeOver` (a plugin's module does, at import, for its own section)."""
    if isinstance(entry, TakeOver):
        _TAKE_OVERS[entry.source] = entry
    elif entry not in _HAND_OVERS:
        _HAND_OVERS.append(entry)


def hand_overs() -> tuple[HandOver, ...]:
    """Every registered `HandOver`."""
    load_builtins()
    return tuple(_HAND_OVERS)


def take_over(section: str) -> Optional[TakeOver]:
    """The `TakeOver` of ``section`` when a preset leaves it out, or ``None``."""
    load_builtins()
    return _TAKE_OVERS.get(section)


__all__ = ["HandOver", "TakeOver", "hand_overs", "register_fit", "take_over"]
