"""The three presets, each as the explicit block it stands for.

A preset turns on only plugins that are built; a user's keys next to ``"preset"`` override the
preset's key by key (`loader.resolve_block`). ``xirang-ds validate CONFIG --show-resolved`` prints
the result, and the README documents each preset key by key from this table.
"""
from __future__ import annotations

import copy

_COMMON = {
    "comm_buffers": {"enabled": True, "arena": True, "adapt": True},
    "monitor": {"enabled": True, "warn_at": 0.85, "act_at": 0.95, "actions": ["empty_cache"]},
}

PRESETS: dict[str, dict] = {
    # Lossless options only.
    "conservative": {**_COMMON},
    # Adds lossy-but-safe options (int8 optimizer states with a schedule, planned recompute).
    "balanced": {**_COMMON},
    # Adds int4 states, lossy activation compression on tolerant tensors, offload.
    "aggressive": {**_COMMON},
}
"""Preset name → the block it expands to (without the ``preset`` key)."""


def expand_preset(name: str) -> dict:
    """A fresh copy of the preset's block; the caller lays the user's keys over it."""
    return copy.deepcopy(PRESETS[name])
