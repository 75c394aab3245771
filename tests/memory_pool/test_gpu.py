"""memory_pool on CUDA (skipped without one; `tools/gpu_check/run.sh` runs them on a lent GPU): the
reservation from a torch MemPool, blocks freed or recorded on side streams, and a block alias."""
import gc

import pytest
import torch

from xirang_ds.memory.pool import MemoryPool

pytestmark = pytest.mark.gpu


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


def test_a_pool_block_alias_keeps_its_bytes_on_cuda():
    from xirang_ds.memory.pool import MemoryPool

    pool = MemoryPool(torch.device("cuda"), size=1 << 20, use_torch_mempool=False)
    block = pool.allocate(1 << 20)
    alias = block.view(torch.float32)[:16]
    del block
    gc.collect()
    alias.fill_(3.0)
    other = pool.allocate(1 << 20)  # the alias holds the only block: a fallback
    other.fill_(0)
    assert not pool.owns(other)
    torch.cuda.synchronize()
    assert torch.all(alias == 3.0)
