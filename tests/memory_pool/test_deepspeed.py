"""memory_pool on real DeepSpeed engines (2 CPU ranks, gloo) with compressed activations and int8 optimizer
states: training with the pool equals training without it bit for bit (ZeRO 0 and 2, gradient
accumulation), allocation counts repeat step after step, checkpoints resume identically, removal restores
plain allocations, and a size too small for one tensor fails with the key, the value, what is allowed
and the fix."""

import pytest
import torch

from tests.harness.checks import assert_resumed, resume_runs
from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.bench import optimizer_step
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.launch import run_ranks
from xirang_ds.memory.categories import DEVICE_CATEGORIES, MEMORY_POOL


# gpt-tiny's GELU and SDPA leave nothing a lossless encoding shrinks in bf16, so the payloads here
# are int8 ones (quantize, on modules marked tolerant); compress stays on the attention modules.
COMPRESS = {"enabled": True, "planner": False, "quantize": ["blocks.*.mlp"], "compress": ["blocks.*.attn"],
            "tolerant": ["blocks.*"]}

INT8 = {"enabled": True, "schedule": [{"dtype": "int8"}], "min_numel": 1024}


def _train(rank, world, config, steps, save_dir=None, load_dir=None, skip=0, track=False, remove_after=None):
    import xirang_ds
    from xirang_ds.models import build_model, parse_model_spec

    spec = parse_model_spec("gpt-tiny")
    net = build_model(spec)
    engine, *_ = xirang_ds.initialize(model=net, model_parameters=net.parameters(), config=config)
    session = engine.xirang
    tracker = session.track_memory() if track else None
    window = tracker.open_window() if tracker is not None else None
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    data = data_iter(engine.train_micro_batch_size_per_gpu(), spec.seq, rank, world)
    for _ in range(skip):
        next(data)
    losses, stats = [], []
    pool = session.pool()
    for step in range(steps):
        if remove_after is not None and step == remove_after:
            stats.append(pool.stats() if pool is not None else None)
            session.remove()
            pool = None
        losses.append(optimizer_step(engine, data))
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    out = {"losses": losses, "params": [p.detach().float().clone() for p in engine.module.parameters()]}
    if pool is not None:
        out["stats"] = pool.stats()
        out["history"] = list(pool.history)
    if remove_after is not None:
        out["stats_at_removal"] = stats[0] if stats[0] is not None else {}
        out["pool_after_removal"] = getattr(engine, "xirang", None)
    if window is not None:
        report = window.report()
        out["peak"] = report.peak_bytes
        out["by_category"] = report.by_category
        window.close()
    if getattr(engine, "xirang", None) is not None:
        engine.xirang.remove()
    return out


def _same(a, b):
    return a["losses"] == b["losses"] and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def _two_rank_scenarios(rank, world, tmp):
    """The 2-rank runs of the tests below in one process pair (a process start costs more than a run): the
    measured on/off runs first, as in a fresh process; every run removes its session before the next."""
    return {"on_off": _on_off(rank, world), "round_trip": _round_trip(rank, world, tmp),
            "removal": _removal(rank, world)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_two_rank_scenarios, 2, str(tmp_path_factory.mktemp("memory_pool")), threads=1)


def _on_off(rank, world):
    out = {}
    for stage in (0, 2):
        block = {"activations": COMPRESS, "optimizer_states": INT8}
        off = _train(rank, world, ds_config(stage=stage, gas=2, xirang=block), 4, track=True)
        on = _train(rank, world, ds_config(stage=stage, gas=2, xirang={**block, "memory_pool": {"enabled": True}}),
                    4, track=True)
        fixed = _train(rank, world, ds_config(stage=stage, gas=2, xirang={
            **block, "memory_pool": {"enabled": True, "size": "4MiB"}}), 4)
        out[stage] = {"auto_same": _same(off, on), "fixed_same": _same(off, fixed), "auto": on["stats"],
                      "auto_history": on["history"], "fixed": fixed["stats"], "fixed_history": fixed["history"],
                      "peak": on["peak"], "by_category": on["by_category"], "off_by_category": off["by_category"]}
    return out


@pytest.mark.distributed
def test_pool_on_and_off_train_bit_identically_with_stable_counts_two_ranks(two_ranks):
    for result in (r["on_off"] for r in two_ranks):
        for stage, r in result.items():
            assert r["auto_same"] and r["fixed_same"], stage
            for key in ("auto", "fixed"):
                s, history = r[key], r[f"{key}_history"]
                assert s["reserved_bytes"] > 0 and s["pooled_allocations"] > 0, (stage, key, s)
                assert s["fallbacks"] == 0, (stage, key, s)
                assert s["persistent_bytes"] > 0  # the int8 states live in the pool
                steady = [(h["pooled"], h["fallbacks"], h["warmup"]) for h in history[2:]]
                assert len(set(steady)) == 1 and steady[0][0] > 0, (stage, key, history)
            assert r["auto_history"][0]["warmup"] > 0  # auto measured the first step
            assert r["fixed_history"][0]["warmup"] == 0
            # the reservation is counted once and the categories add up to the peak
            assert r["by_category"][MEMORY_POOL] == r["auto"]["reserved_bytes"]
            assert sum(r["by_category"][c] for c in DEVICE_CATEGORIES) == r["peak"]
            # the int8 buffers moved into the pool: no plain copy stays alive beside them
            moved = r["off_by_category"]["optimizer_states"] - r["by_category"]["optimizer_states"]
            assert 0.9 * r["auto"]["persistent_bytes"] <= moved <= r["auto"]["persistent_bytes"], (moved, r["auto"])


def _round_trip(rank, world, tmp):
    block = {"activations": COMPRESS, "optimizer_states": INT8, "memory_pool": {"enabled": True}}
    config = ds_config(stage=2, gas=2, xirang=block)
    full, first, resumed = resume_runs(_train, tmp, rank, world, config, skip=4)
    return first, resumed, full


@pytest.mark.distributed
def test_checkpoint_round_trip_resumes_identically(two_ranks):
    for first, resumed, full in (r["round_trip"] for r in two_ranks):
        assert_resumed(full, resumed, at=2, params=True)
        # the saved size is reserved at load, and the loaded states moved into the pool
        assert resumed["history"][0]["warmup"] == 0
        assert resumed["stats"]["reserved_bytes"] == first["stats"]["reserved_bytes"]
        assert resumed["stats"]["persistent_bytes"] == first["stats"]["persistent_bytes"] > 0


def _removal(rank, world):
    block = {"activations": COMPRESS, "optimizer_states": INT8}
    pooled = _train(rank, world, ds_config(stage=2, gas=2, xirang={**block, "memory_pool": {"enabled": True}}), 4,
                    remove_after=2)
    plain = _train(rank, world, ds_config(stage=2, gas=2, xirang=block), 4, remove_after=2)
    return pooled, plain


@pytest.mark.distributed
def test_removing_the_session_restores_plain_allocations(two_ranks):
    """After ``session.remove()`` the engine trains as it does when the pool was never there."""
    for pooled, plain in (r["removal"] for r in two_ranks):
        assert pooled["stats_at_removal"]["pooled_allocations"] > 0
        assert pooled["pool_after_removal"] is None
        assert _same(pooled, plain)


def _too_small(rank, world):
    block = {"optimizer_states": INT8, "memory_pool": {"enabled": True, "size": 1024}}
    try:
        _train(rank, world, ds_config(stage=0, xirang=block), 1)
    except XirangConfigError as e:
        return str(e)
    return None


def test_a_size_too_small_for_one_tensor_names_key_value_allowed_and_fix():
    (text,) = run_ranks(_too_small, 1, threads=1)
    assert text is not None
    assert "xirang.memory_pool.size" in text and "1024 bytes" in text
    assert "allowed:" in text and "fix:" in text and "optimizer_states" in text
