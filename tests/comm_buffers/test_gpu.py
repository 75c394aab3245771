"""comm_buffers on CUDA (skipped without one): a lease of the arena waits for the reduction stream (lending
itself on CUDA is in test_deepspeed_lending.py, beside the run it shares)."""

import pytest


@pytest.mark.gpu
def test_a_lease_waits_for_the_reduction_stream():
    """The reduction stream is still busy with the bucket when forward leases it: the lease's write
    lands after the reduction's (the current stream waits for the reduction stream)."""
    import torch

    from xirang_ds.plugins.comm_buffers.arena import Arena, ArenaLender

    class Bucket:
        elements, index = 0, 0

    class Optimizer:  # the attributes ArenaLender reads of DeepSpeed's ZeRO-1/2 optimizer
        ready_for_gradients = False
        reduce_bucket_size = 1 << 20
        contiguous_gradients = True
        overlap_comm = True
        reduction_stream = torch.cuda.Stream()

        def reduce_independent_p_g_buckets_and_remove_grads(self, param, i):
            return None

    opt = Optimizer()
    arena = Arena(1 << 20, 1, torch.uint8, "cuda")
    lender = ArenaLender(opt, arena)
    with torch.cuda.stream(opt.reduction_stream):  # a reduction still running on the bucket
        torch.cuda._sleep(50_000_000)
        arena.buffer.fill_(1)
    lease = lender.lease(4096, torch.device("cuda"))
    assert lease is not None
    lease.buffer.fill_(2)
    torch.cuda.synchronize()
    assert torch.all(lease.buffer == 2)
    lender.remove()
