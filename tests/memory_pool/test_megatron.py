"""memory_pool under Megatron-core (TP=2 over gloo, ``examples/megatron_gpt.py``): int8 optimizer states
(inside Megatron's optimizer, one DynamicAdamW per member) and compressed layer activations served from
one reservation made after the first steady step (``size: auto``), with losses bit-identical to the
same run without the pool."""
from __future__ import annotations

import os
from typing import Any

import pytest

from tests.harness.megatron_runs import example, write_block
from xirang_ds.launch import run_ranks

pytest.importorskip("megatron.core")


STEPS = 4


def tp2_memory_pool(rank: int, world: int, tmp: str, steps: int) -> dict:
    """TP=2 on 2 ranks: int8 optimizer states and compressed layer activations, without and with
    memory_pool (``size: auto``); the pool's figures."""
    ex = example()
    created = ex.setup(rank, world, 2)

    def pool_figures(model: Any, optimizer: Any, session: Any) -> dict:
        plugin = session.plugin("memory_pool")
        return {"pool": plugin.figures() if plugin is not None else None}

    try:
        block = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]},
                 "activations": {"enabled": True, "planner": False, "compress": ["decoder.layers.*"]}}
        common = ["--steps", str(steps), "--overlap-grad-reduce"]
        out = {}
        for name, extra in (("without", {}), ("with", {"memory_pool": {"enabled": True}})):
            config = write_block(os.path.join(tmp, f"pool_{name}{rank}.json"), {**block, **extra})
            out[name] = ex.train(ex.parse_args(common + ["--xirang-config", config]), pool_figures)
        return out
    finally:
        ex.teardown(created)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(tp2_memory_pool, 2, str(tmp_path_factory.mktemp("pool")), STEPS)


@pytest.mark.distributed
def test_pool_serves_states_and_payloads_without_changing_results(runs):
    for r in runs:
        without, pooled = r["without"], r["with"]
        assert pooled["plugins"] == ["memory_pool", "activations", "optimizer_states"]
        assert pooled["losses"] == without["losses"]
        s = pooled["pool"]
        assert s["reserved_bytes"] > 0 and s["steps"] == STEPS
        assert s["pooled_allocations"] > 0 and s["fallbacks"] == 0
        assert s["persistent_bytes"] > 0  # the int8 codes and scales moved in
        peak = pooled["memory"]["peak_by_category"]
        assert peak["memory_pool"] == s["reserved_bytes"]  # the reservation, counted once
        assert peak["optimizer_states"] < without["memory"]["peak_by_category"]["optimizer_states"]
        assert without["pool"] is None


def test_presets_leave_memory_pool_off_under_megatron_but_it_runs_when_named():
    from xirang_ds.integration import megatron as xm

    assert not xm.validate_for_megatron({"preset": "conservative"}).memory_pool.enabled
    assert xm.validate_for_megatron({"preset": "conservative", "memory_pool": {"enabled": True}}).memory_pool.enabled
