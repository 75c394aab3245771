"""The device peak counter's one owner (`xirang_ds.memory.device_peak`): every reader's window keeps
its own peak whoever resets; tested against an allocator stand-in with CUDA's semantics (one peak per
process, reset for everybody), and on CUDA in tests/memory/test_gpu.py."""
import pytest

from xirang_ds.memory.device_peak import DevicePeak, device_peak


class Allocator:
    """``memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats`` as CUDA keeps them."""

    def __init__(self):
        self.allocated = self.peak = 0
        self.resets = 0

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n):
        self.allocated -= n

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.resets += 1
        self.peak = self.allocated


def test_a_reader_resetting_every_step_leaves_another_readers_peak():
    alloc = Allocator()
    owner = DevicePeak(alloc)
    alloc.alloc(1000)  # model states before anybody reads
    bench = owner.open()
    monitor = owner.open()
    per_step = []
    for spike in (500, 4000, 200):
        alloc.alloc(spike)
        alloc.free(spike)
        per_step.append(monitor.peak_bytes)
        monitor.reset()  # what the monitor does after every step
    assert per_step == [1500, 5000, 1200]  # each step's own peak
    assert bench.peak_bytes == 5000  # the whole run's peak, not the resting 1000
    assert alloc.resets == owner.resets == 5  # two opens, three resets: only the owner resets


def test_windows_start_where_they_open_and_close_independently():
    alloc = Allocator()
    owner = DevicePeak(alloc)
    early = owner.open()
    alloc.alloc(800)
    alloc.free(800)
    late = owner.open()  # opens after the spike: does not see it
    assert late.peak_bytes == 0
    assert early.peak_bytes == 800
    alloc.alloc(300)
    late.close()
    late_peak = late.peak_bytes
    early.reset()  # a reset after `late` closed folds nothing into it
    alloc.alloc(100)
    assert early.peak_bytes == 400 and late_peak == 300
    assert late.closed and not early.closed


def test_the_cpu_has_no_counter():
    class Cpu:
        def current_device_name(self):
            return "cpu"

    with pytest.raises(ValueError, match="live-storage tracker"):
        device_peak(Cpu())


def test_one_owner_per_device():
    class Cuda(Allocator):
        def current_device_name(self):
            return "fake:7"

    first = device_peak(Cuda())
    assert device_peak(Cuda()) is first
