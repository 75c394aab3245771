"""The Hugging Face transformers names xirang_ds relies on, in one version-guarded place.

Read in transformers 5.24.0 (the tested version). `UPSTREAM_NAMES` lists, per file of the installed package, the
lines relied on; ``tests/structure/test_compat.py`` checks that they are still there. transformers is optional:
nothing here imports it.
"""
from __future__ import annotations

from typing import Any

TESTED_VERSION = "5.24.0"

UPSTREAM_NAMES: dict[str, tuple[str, ...]] = {
    # GradientCheckpointingLayer.forward_with_checkpointing: a checkpointed layer runs with use_cache=False and,
    # unless it only reads its cache, without the cache (cache / layer_past)
    "transformers/modeling_layers.py": ("class GradientCheckpointingLayer(nn.Module):",
                                        "_can_checkpoint_with_cache = False",
                                        'kwargs["use_cache"] = False', 'kwargs["cache"] = None',
                                        'kwargs["layer_past"] = None'),
}


def is_checkpointing_layer(module: Any) -> bool:
    """``module`` is a Hugging Face ``GradientCheckpointingLayer`` (a decoder layer that may get a KV cache)."""
    return any(c.__name__ == "GradientCheckpointingLayer" and c.__module__.startswith("transformers")
               for c in type(module).__mro__)


def reads_cache_only(layer: Any) -> bool:
    """The layer only reads its KV cache, so HF keeps the cache under gradient checkpointing
    (``GradientCheckpointingLayer._can_checkpoint_with_cache``)."""
    return bool(getattr(layer, "_can_checkpoint_with_cache", False))


__all__ = ["TESTED_VERSION", "UPSTREAM_NAMES", "is_checkpointing_layer", "reads_cache_only"]
