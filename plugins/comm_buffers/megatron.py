"""comm_buffers under Megatron-core: only the DDP bucket size applies (`CommBuffersPlugin.prepare_ddp_config`).

Megatron's DDP allocates its gradient buffer once when it wraps the model, and its buckets are views of it:
there is no bucket allocation to serve from an arena, to lend, or to resize between steps (the section's
``inert_keys`` say so at validation).
"""
from __future__ import annotations

from typing import Any

from xirang_ds.registry import FrameworkPath


class MegatronBuffers(FrameworkPath):
    """Nothing to attach: the sizes were decided before Megatron's DDP wrapped the model."""

    def describe(self) -> str:
        if not self.plugin.decisions:
            return ""
        return "Megatron DDP buckets are views of its persistent grad buffer (no arena, no resizing)"

    def adapt(self) -> Any:
        """Nothing to adapt: Megatron's buckets are views of a buffer sized once."""
        return None


__all__ = ["MegatronBuffers"]
