"""The ``profiler`` section of the ``"xirang"`` block, kept beside its plugin.

One frozen dataclass with a docstring under every field (docs/config.md's reference is generated from
them: ``make reference``) and its cross-field rules in ``check()``; the plugin registers it as the key
``profiler`` of the block (`xirang_ds.registry.register_plugin`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xirang_ds.config.section import Section
from xirang_ds.config.types import PositiveInt

TraceFormat = Literal["json", "pickle", "html", "png"]


@dataclass(frozen=True)
class ProfilerConfig(Section):
    """Record a per-tensor memory timeline of one step and print the breakdown at its peak."""

    step: PositiveInt = 2
    """Optimizer step to record (1 = the first)."""
    output_dir: str = "xirang_trace"
    """Folder for the trace files."""
    formats: tuple[TraceFormat, ...] = ("json", "html")
    """Files to write: ``json`` (our timeline), ``pickle`` (PyTorch memory_viz), ``html``, ``png``."""
    top_tensors: PositiveInt = 10
    """How many of the largest live tensors at the peak to name."""


__all__ = ["ProfilerConfig", "TraceFormat"]
