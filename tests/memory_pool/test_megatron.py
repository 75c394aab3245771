"""memory_pool under Megatron-core (TP=2 over gloo, ``examples/megatron_gpt.py``): int8 optimizer states
(inside Megatron's optimizer, one DynamicAdamW per member) and compressed layer activations served from
one reservation made after the first steady step (``size: auto``), with losses bit-identical to the
same run without the pool."""
import pytest

from tests.harness import megatron_runs
from xirang_ds.launch import run_ranks

pytest.importorskip("megatron.core")

STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(megatron_runs.tp2_memory_pool, 2, str(tmp_path_factory.mktemp("pool")), STEPS)


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
