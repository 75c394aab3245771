"""The ``comm_buffers`` section of the ``"xirang"`` block, kept beside its plugin.

One frozen dataclass with a docstring under every field (docs/config.md's reference is generated from
them: ``make reference``) and its cross-field rules in ``check()``; the plugin registers it as the key
``comm_buffers`` of the block (`xirang_ds.registry.register_plugin`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Union

from xirang_ds.config.section import Issues, Section
from xirang_ds.config.types import AutoInt, PositiveInt, Range

@dataclass(frozen=True)
class CommBuffersConfig(Section):
    """Communication buckets sized from the model, the links and the budget, in one arena reused
    every step."""

    reduce_bucket_size: AutoInt = "auto"
    """ZeRO ``reduce_bucket_size`` in elements; ``auto`` applies the sizing rule (a value set in
    ``zero_optimization`` is kept)."""
    allgather_bucket_size: AutoInt = "auto"
    """ZeRO ``allgather_bucket_size`` in elements, likewise."""
    max_fraction_of_budget: Annotated[float, Range(0.0, 1.0, low_exclusive=True)] = 0.05
    """Upper bound of the reduction buffers (all of them) as a fraction of the memory budget."""
    collective_latency_us: Union[Literal["auto"], Annotated[float, Range(0.0, low_exclusive=True)]] = "auto"
    """Fixed cost of one collective in the sizing rule; ``auto``: by backend (NCCL 30, gloo 50)."""
    collective_bandwidth_gbps: Union[Literal["auto"], Annotated[float, Range(0.0, low_exclusive=True)]] = "auto"
    """Link bandwidth in GB/s in the sizing rule; ``auto``: by backend (NCCL 100, gloo 2)."""
    adapt: bool = True
    """Resize the reduction bucket between steps from memory headroom and the number of reductions."""
    adapt_every_steps: PositiveInt = 10
    """Consider a resize every N optimizer steps."""
    arena: bool = True
    """Serve ZeRO-1/2 reduction buckets from one allocation made once, instead of one per backward."""
    lend_to_activations: bool = False
    """Lend the arena to the activations plugin while no reduction uses it (forward): tensors of
    modules under ``compress`` / ``quantize`` / ``sparsify`` are stored there, encoded or as they
    are, instead of in memory of their own; a lease a gradient copy is about to overwrite moves to
    host memory first. Needs ``arena`` and ZeRO 1 or 2."""

    def check(self) -> Issues:
        if self.lend_to_activations and not self.arena:
            return [("lend_to_activations", "lends the arena, but arena is false; set arena to true or "
                                            "lend_to_activations to false")]
        return []


__all__ = ["CommBuffersConfig"]
