"""The chunked output head under Megatron-core (plugins/activations/head_megatron.py): GPTModel (local spec)
at tensor-parallel size 2 over gloo, vocabulary 4,096 (2,048 logits per rank), 2 micro-batches of 256 tokens
per step, 3 steps, through ``examples/megatron_gpt.py``; untied and tied output weights.

* ``chunk`` on ``output_layer`` with one slice per micro-batch gives losses bit-identical to plain Megatron;
  with 32-row slices within 1e-6 (the weight gradient adds one product per slice).
* What the loss saved for backward (Megatron's vocab-parallel cross-entropy keeps the fp32 softmax of
  every token) is no longer held: the activations' own highest falls by more than the logits' bytes.
* ``auto`` candidates hold the output layer; under a budget below what keeping it needs the planner
  chooses ``chunk`` for it, and training stays within 1e-6 of plain Megatron.
* A fixed ``chunk`` on something that is not an output layer, or on an output layer with sequence
  parallelism, is refused naming the key, the module and the reason; removal restores the owner's
  ``compute_language_model_loss`` and every forward.
"""
from __future__ import annotations

import os
from typing import Any

import pytest

from tests.harness.checks import megatron_built_and_removed, replaced_methods
from tests.harness.megatron_runs import config_error, example, prepare_error, write_block
from xirang_ds.launch import run_ranks

pytest.importorskip("megatron.core")

STEPS, TOKENS, VOCAB = 3, 4 * 64, 4096
LOGITS = TOKENS * VOCAB // 2 * 4
"""One micro-batch's fp32 logits on one rank (the vocabulary split over TP=2)."""

PLANS = {
    "keep": {"planner": False, "keep": ["output_layer"]},
    "one_slice": {"planner": False, "chunk": ["output_layer"], "chunk_tokens": TOKENS},
    "slices": {"planner": False, "chunk": ["output_layer"], "chunk_tokens": 32},
    "planner": {"budget": 2 * LOGITS, "options": ["keep", "recompute", "chunk"], "profile_steps": 1},
}


def head_runs(rank: int, world: int, tmp: str) -> dict:
    ex = example()
    created = ex.setup(rank, world, 2)

    def plan_of(model: Any, optimizer: Any, session: Any) -> dict:
        plugin = session.plugin("activations")
        return {"plan": dict(plugin.plan), "state": plugin.state, "candidates": list(plugin._candidates),
                "heads": sorted(plugin.head_names)}

    try:
        out = {}
        for tied in (False, True):
            common = ["--steps", str(STEPS), "--vocab-size", str(VOCAB)] + (
                ["--share-embeddings-and-output-weights"] if tied else [])
            runs = {"plain": ex.train(ex.parse_args(common))}
            for name, section in PLANS.items():
                block = {"monitor": {"enabled": True}, "activations": {"enabled": True, **section}}
                config = write_block(os.path.join(tmp, f"{name}{int(tied)}{rank}.json"), block)
                runs[name] = ex.train(ex.parse_args(common + ["--xirang-config", config]), plan_of)
            out["tied" if tied else "untied"] = runs
        chunk = write_block(os.path.join(tmp, f"removal{rank}.json"), {"activations": {"enabled": True,
                                                                                  **PLANS["slices"]}})
        out["removal"] = megatron_built_and_removed(
            ex, ["--xirang-config", chunk], lambda model, *_: replaced_methods(model, ("forward", "compute_"
                                                                                         "language_model_loss")))
        out["not_a_head"] = config_error(ex, {"activations": {"enabled": True, "planner": False,
                                                              "chunk": ["decoder.layers.0"]}}, tmp)
        out["sequence_parallel"] = _with_sequence_parallel()
        return out
    finally:
        ex.teardown(created)


def _with_sequence_parallel() -> str:
    block = {"activations": {"enabled": True, "planner": False, "chunk": ["output_layer"]}}
    return prepare_error(block, lambda model: setattr(model.output_layer, "sequence_parallel", True))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(head_runs, 2, str(tmp_path_factory.mktemp("head")))


def _saved(run: dict) -> int:
    return run["memory"]["category_peaks"]["activations"]


@pytest.mark.distributed
@pytest.mark.parametrize("weights", ["untied", "tied"])
def test_chunked_output_layer_is_exact_and_saves_the_loss(runs, weights):
    for rank in runs:
        r = rank[weights]
        plain = r["plain"]["losses"]
        assert r["keep"]["losses"] == plain
        assert r["one_slice"]["losses"] == plain  # one slice: bit-identical
        assert r["one_slice"]["plan"] == {"output_layer": "chunk"}
        assert r["slices"]["losses"] == pytest.approx(plain, rel=1e-6, abs=0)
        assert r["slices"]["losses"] != [0.0] * STEPS and r["slices"]["heads"] == ["output_layer"]
        # the vocab-parallel cross-entropy's saved fp32 softmax is gone; a 32-row slice's backward holds
        # at most three fp32 rows per token meanwhile (the logits, their softmax, its gradient)
        assert _saved(r["keep"]) - _saved(r["slices"]) > LOGITS - 3 * 32 * VOCAB // 2 * 4
        assert r["slices"]["memory"]["peak_bytes"] < r["keep"]["memory"]["peak_bytes"]


@pytest.mark.distributed
@pytest.mark.parametrize("weights", ["untied", "tied"])
def test_planner_chunks_the_output_layer_under_a_budget(runs, weights):
    for rank in runs:
        r = rank[weights]["planner"]
        assert "output_layer" in r["candidates"] and r["heads"] == ["output_layer"]
        assert r["state"] == "planned" and r["plan"]["output_layer"] == "chunk"
        assert r["losses"] == pytest.approx(rank[weights]["plain"]["losses"], rel=1e-6, abs=0)
    assert runs[0]["untied"]["planner"]["plan"] == runs[1]["untied"]["planner"]["plan"]


@pytest.mark.distributed
def test_refusals_and_removal(runs):
    for r in runs:
        assert r["removal"]["before"] == ["module", "module.output_layer"]  # the loss owner and the layer
        assert r["removal"]["after"] == []
        assert ("xirang.activations.chunk: 'decoder.layers.0' is a TransformerLayer; under Megatron-core chunk "
                "applies to a language model's output_layer") in r["not_a_head"]
        assert ("xirang.activations.chunk: 'output_layer' cannot be chunked with sequence parallelism"
                in r["sequence_parallel"])
