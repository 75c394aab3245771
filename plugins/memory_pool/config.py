"""The ``memory_pool`` section of the ``"xirang"`` block, kept beside its plugin.

One frozen dataclass with a docstring under every field (docs/config.md's reference is generated from
them: ``make reference``) and its cross-field rules in ``check()``; the plugin registers it as the key
``memory_pool`` of the block (`xirang_ds.registry.register_plugin`).
"""
from __future__ import annotations

from dataclasses import dataclass

from xirang_ds.config.section import Issues, Section
from xirang_ds.config.types import AutoBytes

@dataclass(frozen=True)
class MemoryPoolConfig(Section):
    """One device reservation serving plugin tensors: int8/int4 optimizer states (packed, long-lived)
    and compressed activation payloads (reused every step), plain allocations when it is full."""

    size: AutoBytes = "auto"
    """Bytes reserved at attach; ``auto`` measures the first optimizer step run with every plan in
    force (plain allocations meanwhile) and then reserves the most activation payload bytes live at
    once plus what the optimizer states will hold. Must hold the largest single request."""
    use_torch_mempool: bool = True
    """On CUDA, make the reservation and the fallback allocations inside a ``torch.cuda.MemPool``
    where the installed torch has one (a private pool of the caching allocator)."""

    def check(self) -> Issues:
        if self.size != "auto" and int(self.size) == 0:
            return [("size", 'must be "auto" or a byte count above 0; got 0 (to run without a pool, set enabled '
                             "to false)")]
        return []


__all__ = ["MemoryPoolConfig"]
