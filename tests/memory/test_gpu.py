"""GPU checks (skipped without CUDA): the tracker against the caching allocator, and the bench's
allocator peak. Run them with `pytest -m gpu` on a CUDA machine."""
import pytest
import torch

from xirang_ds.memory.categories import PARAMETERS
from xirang_ds.memory.tracker import MemoryTracker


@pytest.mark.gpu
def test_tracker_matches_allocator_on_cuda():
    """Within the window, every byte the allocator hands out is one the tracker sees, rounded up.
    One forward and backward first: cuBLAS allocates its workspace (megabytes, through the caching
    allocator) at its first matmul on a stream, which no tensor of the step owns."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    model(torch.randn(256, 1024, device="cuda")).square().mean().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t = MemoryTracker("cuda")
    t.seed(model.parameters(), PARAMETERS)
    t.reset_peak()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with t:
        t.set_phase("forward")
        loss = model(torch.randn(256, 1024, device="cuda")).square().mean()
        t.set_phase("backward")
        loss.backward()
    torch.cuda.synchronize()
    allocator_delta = torch.cuda.max_memory_allocated() - before
    tracker_delta = t.peak_bytes - t.baseline_bytes
    # the allocator rounds every block up to 512 bytes; the tracker counts requested bytes (the step
    # makes under 64 tensors)
    assert tracker_delta > 4 * 256 * 4096  # the hidden activation at least: the window saw the step
    assert 0 <= allocator_delta - tracker_delta <= 512 * 64


@pytest.mark.gpu
def test_bench_reports_allocator_peak_on_cuda():
    from tests.harness.engine_runs import ds_config
    from xirang_ds.bench import bench_rank
    from xirang_ds.launch import run_ranks

    (r,) = run_ranks(bench_rank, 1, "gpt-tiny", ds_config(stage=2, xirang={"monitor": {"enabled": True}}), 3, None,
                     0, True)
    assert r["allocator_peak_bytes"] >= r["peak_bytes"] > 0


@pytest.mark.gpu
def test_device_peak_windows_keep_their_peaks_on_cuda():
    from xirang_ds.memory.device_peak import device_peak

    torch.cuda.synchronize()
    owner = device_peak()
    run = owner.open()
    base = torch.cuda.memory_allocated()
    step = owner.open()
    spike = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del spike
    assert step.peak_bytes >= base + (64 << 20)
    step.reset()  # as the monitor does after each step
    assert step.peak_bytes < base + (64 << 20)
    assert run.peak_bytes >= base + (64 << 20)  # the bench's window still sees the spike
    step.close()
    run.close()
