"""The memory pool without an engine: the allocator on its own (alignment, lifetime placement, reuse,
coalescing, fallbacks counted, exact figures), the tracker counting the reservation once, optimizer states
held in the pool, and bad sizes failing with the key, the value and what is allowed (engines:
test_deepspeed.py; CUDA: test_gpu.py)."""
import gc

import pytest
import torch

from xirang_ds.config.validate import XirangConfigError
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
