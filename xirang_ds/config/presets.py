"""The three presets, each as the explicit block it stands for.

A preset turns on only plugins that are built; a user's keys next to ``"preset"`` override the
preset's key by key (`loader.resolve_block`). ``xirang-ds validate CONFIG --show-resolved`` prints
the result, and docs/config.md documents each preset key by key from this table.
"""
from __future__ import annotations

import copy

_LOSSLESS_STORAGE = ("keep", "compress", "offload", "chunk")
_RECOMPUTE = ("recompute", "selective_recompute", "recompute_offload", "recompute_tiled", "recompute_tiled_offload")
_LOSSY = ("quantize", "sparsify")

_CONSERVATIVE = {
    # ZeRO bucket sizes from the model and the budget, one arena allocated once
    "comm_buffers": {"enabled": True, "arena": True, "adapt": True},
    # the optimizer step in backward: gradients live a bucket at a time (bit-identical updates), bf16
    # masters as 16-bit remainders beside the weights (exact); where it is left out (ZeRO-3),
    # optimizer_states with fp32 states keeps DeepSpeed's masters as remainders (its `TakeOver`)
    "grad_release": {"enabled": True},
    # the planner keeps saved activations under what memory_budget leaves, storing them losslessly
    # (narrower exact storage, or host memory) and recomputing nothing but the output head's logits,
    # a slice of tokens at a time (chunk: the loss is bit-identical, the head's weight gradient
    # exact to bf16 rounding)
    "activations": {"enabled": True, "budget": "auto", "options": list(_LOSSLESS_STORAGE)},
    # one reservation for the encoded activations (and int8/int4 states where no grad_release holds
    # them), sized from the first steady step and reused at the same addresses every step
    "memory_pool": {"enabled": True, "size": "auto"},
    "monitor": {"enabled": True, "warn_at": 0.85, "act_at": 0.95, "actions": ["empty_cache"]},
}

PRESETS: dict[str, dict] = {
    # Lossless options only: no value is approximated, but two sums run in another order (grad_release
    # reduces in its own bucket order, so bf16 rounding can differ from DeepSpeed's: +0.01% / +0.16% final
    # loss in the convergence runs; a chunked head sums its weight gradient over the slices: losses within
    # 1.9e-5 relative of the unchunked run, benchmarks/presets_matrix.py --compare).
    "conservative": _CONSERVATIVE,
    # Adds int8 optimizer states from the first step (norms and small tensors stay fp32, embeddings
    # until their measured int8 error allows; no fp32 warm-up: its states would set the run's peak,
    # which is what a budget must hold), recompute among the planner's options, and bf16 masters kept
    # to 16 significant bits as 8-bit remainders (1 byte instead of 2.125, each update rounded
    # stochastically onto that grid; where grad_release is left out (ZeRO-3) handed to DeepSpeed's
    # masters, its registered `HandOver`; other dtypes keep their masters).
    "balanced": {
        **_CONSERVATIVE,
        "grad_release": {"enabled": True, "masters": "remainders_8bit"},
        "optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}],
                             "keep_fp32_embeddings_and_norms": "measured"},
        "activations": {"enabled": True, "budget": "auto", "options": list(_LOSSLESS_STORAGE + _RECOMPUTE)},
    },
    # Adds int4 optimizer states (an embedding int4 distorts goes int8 when int8's measured error
    # allows, docs/optimizer_states.md), bf16 weights with no master (each update rounded stochastically
    # into them; other dtypes keep their masters) and lossy 8-bit / sparse storage of the feed-forward
    # blocks' saved activations (bounded error, docs/activations.md); offload stays among the options.
    "aggressive": {
        **_CONSERVATIVE,
        "grad_release": {"enabled": True, "masters": "none"},
        # where grad_release is left out (ZeRO-3), its masters: none is handed to DeepSpeed's masters
        # (optimizer_states.masters, its registered `HandOver`)
        "optimizer_states": {"enabled": True, "schedule": [{"dtype": "int4"}],
                             "keep_fp32_embeddings_and_norms": "measured"},
        "activations": {"enabled": True, "budget": "auto", "options": list(_LOSSLESS_STORAGE + _RECOMPUTE + _LOSSY),
                        "tolerant": ["feed_forward"]},
    },
}
"""Preset name → the block it expands to (without the ``preset`` key)."""


def expand_preset(name: str) -> dict:
    """A fresh copy of the preset's block; the caller lays the user's keys over it."""
    return copy.deepcopy(PRESETS[name])
