"""The memory pool: the allocator on its own (alignment, lifetime placement, reuse, coalescing,
fallbacks counted, exact figures), the tracker counting the reservation once, and real DeepSpeed
engines on 2 CPU ranks with compressed activations and int8 optimizer states: training with the
pool equals training without it bit for bit (ZeRO 0 and 2, gradient accumulation), allocation
counts repeat step after step, checkpoints resume identically, removal restores plain allocations,
and bad sizes fail with the key, the value, what is allowed and the fix."""
import gc

import pytest
import torch

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.bench import optimizer_step
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.launch import run_ranks
from xirang_ds.memory.categories import DEVICE_CATEGORIES, MEMORY_POOL
from xirang_ds.memory.pool import ALIGNMENT, MemoryPool, PoolTooSmall, align_up
from xirang_ds.memory.tracker import MemoryTracker

CPU = torch.device("cpu")


def _offset(pool, t):
    return t.data_ptr() - pool.buffer.data_ptr()


def test_blocks_are_aligned_views_of_one_reservation_in_any_dtype():
    pool = MemoryPool(CPU, size=64 * 1024)
    a = pool.allocate(10, torch.uint8)
    b = pool.allocate(12, torch.float32)
    c = pool.allocate(16, torch.int64, persistent=True)
    for t in (a, b, c):
        assert pool.owns(t)
        assert _offset(pool, t) % ALIGNMENT == 0
    assert (a.numel(), b.numel(), c.numel()) == (10, 3, 2)
    assert b.dtype == torch.float32 and c.dtype == torch.int64
    s = pool.stats()
    assert s["reserved_bytes"] == 64 * 1024
    assert s["in_use_bytes"] == 3 * ALIGNMENT and s["persistent_bytes"] == ALIGNMENT
    assert s["pooled_allocations"] == 3 and s["fallbacks"] == 0
    with pytest.raises(ValueError):
        pool.allocate(6, torch.float32)  # not a whole number of elements


def test_persistent_blocks_pack_low_transient_blocks_high():
    pool = MemoryPool(CPU, size=16 * ALIGNMENT)
    p1 = pool.allocate(ALIGNMENT, persistent=True)
    t1 = pool.allocate(ALIGNMENT)
    p2 = pool.allocate(2 * ALIGNMENT, persistent=True)
    t2 = pool.allocate(ALIGNMENT)
    assert [_offset(pool, x) // ALIGNMENT for x in (p1, p2)] == [0, 1]
    assert [_offset(pool, x) // ALIGNMENT for x in (t1, t2)] == [15, 14]


def test_freed_blocks_are_reused_and_coalesced():
    pool = MemoryPool(CPU, size=8 * ALIGNMENT)
    blocks = [pool.allocate(ALIGNMENT) for _ in range(8)]
    assert pool.stats()["free_ranges"] == 0
    assert pool.allocate(1).data_ptr() not in {b.data_ptr() for b in blocks}  # full: a fallback
    assert pool.stats()["fallbacks"] == 1
    offsets = [_offset(pool, b) for b in blocks]
    del blocks[2:5]  # three neighbours die: one free range of three blocks
    gc.collect()
    s = pool.stats()
    assert s["free_ranges"] == 1 and s["largest_free_bytes"] == 3 * ALIGNMENT
    big = pool.allocate(3 * ALIGNMENT)  # fits only because the three were coalesced
    assert pool.owns(big) and _offset(pool, big) == min(offsets[2:5])
    del big, blocks
    gc.collect()
    s = pool.stats()
    assert s["in_use_bytes"] == 0 and s["free_ranges"] == 1 and s["largest_free_bytes"] == 8 * ALIGNMENT


def test_best_fit_takes_the_smallest_free_range():
    pool = MemoryPool(CPU, size=10 * ALIGNMENT)
    keep = [pool.allocate(ALIGNMENT, persistent=True) for _ in range(10)]
    for i in (1, 2, 3, 6):  # free ranges: [1, 3] (3 blocks) and [6] (1 block)
        keep[i] = None
    gc.collect()
    small = pool.allocate(ALIGNMENT)
    assert _offset(pool, small) == 6 * ALIGNMENT


def test_fallbacks_are_plain_allocations_counted_and_never_fail():
    pool = MemoryPool(CPU, size=2 * ALIGNMENT)
    held = [pool.allocate(ALIGNMENT) for _ in range(2)]
    extra = pool.allocate(100)
    assert not pool.owns(extra) and extra.numel() == 100
    s = pool.stats()
    assert (s["fallbacks"], s["fallback_bytes"], s["pooled_allocations"]) == (1, 100, 2)
    pool.end_step()
    huge = pool.allocate(10 * ALIGNMENT)  # larger than the pool after the first step: counted
    assert not pool.owns(huge) and pool.stats()["oversize_fallbacks"] == 1
    assert held


def test_a_request_larger_than_the_pool_in_the_first_step_is_a_config_error():
    pool = MemoryPool(CPU, size=ALIGNMENT)
    with pytest.raises(XirangConfigError) as e:
        pool.allocate(ALIGNMENT + 1, what="activations payload")
    assert isinstance(e.value, PoolTooSmall)
    text = str(e.value)
    assert "xirang.memory_pool.size" in text and "256 bytes" in text and "512" in text
    assert '"auto"' in text and "fix:" in text


def test_per_step_counts_repeat_and_high_water_is_exact():
    pool = MemoryPool(CPU, size=64 * ALIGNMENT)
    state = pool.allocate(4 * ALIGNMENT, persistent=True)
    for _ in range(4):
        payloads = [pool.allocate(n) for n in (300, 700, 100, 2000)]
        while payloads:  # die in backward, not in order
            payloads.pop(1 if len(payloads) > 1 else 0)
            gc.collect()
        pool.end_step()
    steps = list(pool.history)
    assert [(h["pooled"], h["fallbacks"]) for h in steps] == [(5, 0)] + [(4, 0)] * 3
    expected = 4 * ALIGNMENT + sum(align_up(n) for n in (300, 700, 100, 2000))
    assert pool.stats()["high_water_bytes"] == expected
    assert pool.stats()["in_use_bytes"] == 4 * ALIGNMENT
    assert state.numel() == 4 * ALIGNMENT


def test_auto_measures_then_reserves_and_owners_move_in():
    pool = MemoryPool(CPU, size=None)
    moved = []
    pool.on_reserved.append(lambda p: moved.append(p.size))
    state = pool.allocate(1000, persistent=True)  # warm-up: plain
    payloads = [pool.allocate(600), pool.allocate(300)]
    assert not any(pool.owns(t) for t in [state] + payloads)
    del payloads
    gc.collect()
    pool.end_step()
    size = pool.reserve_measured(persistent_bytes=2048)
    assert size == align_up(600) + align_up(300) + 2048 == moved[0]
    assert pool.stats()["warmup_allocations"] == 3 and not pool.warmup
    assert pool.owns(pool.allocate(600))


def test_close_makes_later_requests_plain_and_keeps_live_blocks_valid():
    pool = MemoryPool(CPU, size=4 * ALIGNMENT)
    live = pool.allocate(ALIGNMENT, torch.float32)
    live.fill_(3.0)
    pool.close()
    assert not pool.owns(pool.allocate(ALIGNMENT))
    assert torch.all(live == 3.0)


def test_an_alias_keeps_its_block_until_it_dies():
    """A ``.detach()`` or a view outliving the block tensor keeps the block: its bytes are not handed
    out again (they were before: the block was freed with the Python tensor, reproduced here)."""
    pool = MemoryPool(CPU, size=2 * ALIGNMENT)
    first = pool.allocate(ALIGNMENT)
    alias = first.detach()[:16]
    view = pool.allocate(ALIGNMENT).view(16, 16)[2]
    del first
    gc.collect()
    alias.fill_(7)
    view.fill_(9)
    again = pool.allocate(ALIGNMENT)  # both blocks are still held: a counted fallback
    again.fill_(1)
    assert not pool.owns(again) and pool.stats()["fallbacks"] == 1
    assert torch.all(alias == 7) and torch.all(view == 9)
    del alias, again
    gc.collect()
    reused = pool.allocate(ALIGNMENT)  # the alias died: its block serves again
    assert pool.owns(reused) and pool.stats()["pooled_allocations"] == 3
    del view
    gc.collect()
    assert pool.stats()["in_use_bytes"] == ALIGNMENT


def test_tracker_counts_the_reservation_once_as_memory_pool():
    tracker = MemoryTracker("cpu")
    with tracker:
        pool = MemoryPool(CPU, size=8 * ALIGNMENT)
        tracker.mark([pool.buffer], MEMORY_POOL)
        a = pool.allocate(ALIGNMENT, torch.float32, persistent=True)
        tracker.mark([a], "optimizer_states")  # a view: the reservation keeps its one role
        b = pool.allocate(2 * ALIGNMENT)
        b.fill_(1)
        extra = torch.empty(1000, dtype=torch.uint8)
    report = tracker.report()
    assert report.by_category[MEMORY_POOL] == 8 * ALIGNMENT
    assert sum(report.by_category[c] for c in DEVICE_CATEGORIES) == report.peak_bytes == 8 * ALIGNMENT + 1000
    assert a is not None and b is not None and extra is not None


# ------------------------------------------------------------------------------------------------
# real engines (2 CPU ranks, gloo)

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
def test_pool_on_and_off_train_bit_identically_with_stable_counts_two_ranks():
    for result in run_ranks(_on_off, 2, threads=1):
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
    first = _train(rank, world, config, 2, save_dir=tmp)
    resumed = _train(rank, world, config, 2, load_dir=tmp, skip=4)
    full = _train(rank, world, config, 4)
    return first, resumed, full


@pytest.mark.distributed
def test_checkpoint_round_trip_resumes_identically(tmp_path):
    for first, resumed, full in run_ranks(_round_trip, 2, str(tmp_path), threads=1):
        assert resumed["losses"] == full["losses"][2:]
        assert all(torch.equal(x, y) for x, y in zip(resumed["params"], full["params"]))
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
def test_removing_the_session_restores_plain_allocations():
    """After ``session.remove()`` the engine trains as it does when the pool was never there."""
    for pooled, plain in run_ranks(_removal, 2, threads=1):
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


@pytest.mark.parametrize("value, words", [(0, "must be"), ("lots", "byte count"), (-5, ">= 0")])
def test_bad_size_values_are_config_errors(value, words):
    from xirang_ds.config.loader import load_config

    with pytest.raises(XirangConfigError) as e:
        load_config({"xirang": {"memory_pool": {"enabled": True, "size": value}}})
    assert "xirang.memory_pool.size" in str(e.value) and words in str(e.value)


def test_optimizer_states_live_in_the_pool_train_identically_and_save_compact_copies():
    from xirang_ds.plugins.optimizer_states.optimizer import DynamicAdamW

    states = {"schedule": [{"dtype": "int8"}], "min_numel": 1024}
    results = []
    for pooled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = DynamicAdamW(model.parameters(), lr=1e-2, states=states)
        pool = MemoryPool(CPU, size=1 << 20) if pooled else None
        opt.state_pool = pool
        for _ in range(3):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        codes = opt.state[model.weight]["exp_avg_codes"]
        if pooled:
            assert pool.owns(codes) and pool.stats()["persistent_bytes"] > 0
            saved = opt.state_dict()["state"]
            assert not any(pool.owns(t) for st in saved.values() for t in st.values() if isinstance(t, torch.Tensor))
            assert torch.equal(saved[0]["exp_avg_codes"], codes)
        results.append(model.weight.detach().clone())
    assert torch.equal(results[0], results[1])


@pytest.mark.gpu
def test_cuda_reservation_comes_from_a_torch_mempool_and_fallbacks_do_not():
    """On CUDA the reservation lives in the pool's own ``torch.cuda.MemPool`` (where torch has one), so
    the default pool's segments do not see it; fallbacks come from the ordinary allocator, where the
    rest of training can reuse their memory."""
    if getattr(torch.cuda, "MemPool", None) is None:
        pytest.skip("this torch has no torch.cuda.MemPool")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    pool = MemoryPool(device, size=8 << 20, use_torch_mempool=True)
    assert pool.mempool is not None and pool.stats()["torch_mempool"]
    assert pool.mempool_bytes() >= 8 << 20
    assert torch.cuda.memory_allocated(device) - before == 8 << 20
    held = pool.allocate(8 << 20)  # fills the pool
    extra = pool.allocate(1 << 20)  # a fallback, outside the MemPool
    assert not pool.owns(extra) and pool.stats()["fallbacks"] == 1
    assert pool.mempool_bytes() < (8 << 20) + (1 << 20)
    plain = MemoryPool(device, size=1 << 20, use_torch_mempool=False)
    assert plain.mempool is None and plain.stats()["torch_mempool_bytes"] is None
    del held, extra


@pytest.mark.gpu
def test_a_block_freed_on_a_side_stream_is_reused_after_that_streams_work():
    """The side stream's queued write to a freed block lands before the default stream's new owner
    writes it: the pool makes the new owner's stream wait for the event recorded at the free."""
    device = torch.device("cuda", torch.cuda.current_device())
    pool = MemoryPool(device, size=1 << 20)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        block = pool.allocate(1 << 20)
        torch.cuda._sleep(50_000_000)  # the side stream is busy for a while
        block.fill_(1)
        del block
        gc.collect()
    reused = pool.allocate(1 << 20)  # on the default stream
    assert pool.owns(reused)
    reused.fill_(2)
    torch.cuda.synchronize()
    assert torch.all(reused == 2)


@pytest.mark.gpu
def test_a_block_recorded_on_a_side_stream_waits_for_it():
    """Handed out on the default stream, written late on a side stream (declared with record_stream),
    freed, handed out again on the default stream: the new owner's write lands after the side's."""
    device = torch.device("cuda", torch.cuda.current_device())
    pool = MemoryPool(device, size=1 << 20)
    side = torch.cuda.Stream(device)
    block = pool.allocate(1 << 20)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        block.fill_(1)
    pool.record_stream(block, side)
    del block
    gc.collect()
    reused = pool.allocate(1 << 20)
    assert pool.owns(reused)
    reused.fill_(2)
    torch.cuda.synchronize()
    assert torch.all(reused == 2)

