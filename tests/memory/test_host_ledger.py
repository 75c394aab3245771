"""The host ledger (`xirang_ds.memory.host_ledger`): host-tier buffers counted as the host really holds them.
Pinned buffers are counted as torch's caching host allocator holds them (power-of-two blocks, a dropped block
kept for the next request of its size); on the CPU DeepSpeed's accelerator pins nothing, so ``pin=True`` here
exercises the count, not the page-locking."""
import logging

import torch

from xirang_ds.memory.host_ledger import HostLedger, pinned_block
from xirang_ds.plugins.activations.storage import HostPool

MiB = 1 << 20


def test_a_pinned_block_is_the_next_power_of_two():
    assert [pinned_block(n) for n in (1, 2, 3, 4096, 4097, 5 * MiB, 8 * MiB)] == [1, 2, 4, 4096, 8192, 8 * MiB, 8 * MiB]


def test_a_dropped_pinned_block_stays_held_and_serves_the_next_request_of_its_size():
    led = HostLedger()
    a = led.buffer((5 * MiB,), torch.uint8, True, "grad_release")
    assert (led.held_bytes, led.in_use_bytes) == (8 * MiB, 8 * MiB)  # 5 MiB asked, 8 MiB pinned
    del a
    assert (led.held_bytes, led.in_use_bytes) == (8 * MiB, 0)  # dropping it freed nothing
    assert led.cost(6 * MiB, True) == 0 and led.cost(9 * MiB, True) == 16 * MiB
    b = led.buffer((6 * MiB,), torch.uint8, True, "activations offload")  # the cached 8 MiB block
    assert led.held_bytes == 8 * MiB
    c = led.buffer((MiB // 4,), torch.float32, True, "activations offload")  # 1 MiB: a new block
    assert (led.held_bytes, led.in_use_bytes, led.high_water_bytes) == (9 * MiB, 9 * MiB, 9 * MiB)
    assert led.figures()["by_tier"] == {"activations offload": MiB, "grad_release": 8 * MiB}
    del b, c


def test_plain_host_memory_counts_its_bytes_and_gives_them_back():
    led = HostLedger()
    a = led.buffer((3, 1000), torch.float32, False, "grad_release")
    assert (led.held_bytes, led.in_use_bytes) == (12000, 12000)
    del a
    assert (led.held_bytes, led.in_use_bytes) == (0, 0)


def test_a_tier_that_must_go_over_the_budget_says_so_once_with_the_figures(caplog):
    led = HostLedger(budget_bytes=4 * MiB)
    assert led.fits(4 * MiB, True) and not led.fits(4 * MiB + 1, True)  # 4 MiB + 1 pins 8 MiB
    with caplog.at_level(logging.WARNING, logger="xirang_ds"):
        kept = [led.buffer((3 * MiB,), torch.uint8, True, "grad_release") for _ in range(3)]
    said = [r.getMessage() for r in caplog.records if "host_memory_budget" in r.getMessage()]
    # each 3 MiB pins 4 MiB: the second goes over, and the third says nothing more
    assert len(said) == 1 and "8,388,608 bytes held, over the budget of 4,194,304" in said[0]
    assert led.over_budget == {"grad_release"} and led.held_bytes == 12 * MiB
    del kept


def test_the_offload_pool_pins_whole_blocks_and_its_budget_is_every_tier_s():
    led = HostLedger(budget_bytes=16 * MiB)
    states = led.buffer((9 * MiB,), torch.uint8, True, "grad_release")  # 16 MiB pinned: the budget is full
    pool = HostPool(pin=True, ledger=led)
    assert pool.get(MiB) is None and pool.refused == 1  # the pool alone holds nothing, yet there is no room
    del states  # its 16 MiB block stays pinned and cached: a request of that size reuses it
    buf = pool.get(10 * MiB)
    assert buf is not None and buf.numel() == 10 * MiB and pool.allocated_bytes == 16 * MiB
    assert led.held_bytes == 16 * MiB
    pool.put(buf)
    assert pool.get(MiB) is None  # trimming the pool's cached block frees no pinned memory
    assert pool.trimmed_bytes == 16 * MiB and led.held_bytes == 16 * MiB and pool.refused == 2


def test_without_pinning_the_pool_s_trimmed_buffers_make_room():
    led = HostLedger(budget_bytes=64 * 1024)
    pool = HostPool(pin=False, ledger=led)
    bufs = [pool.get(16 * 1024) for _ in range(3)]
    for b in bufs:
        pool.put(b)
    del bufs, b
    assert led.held_bytes == 48 * 1024
    big = pool.get(40 * 1024)  # the two oldest cached buffers are dropped, and freed
    assert big is not None and led.held_bytes == 56 * 1024 and pool.trimmed_bytes == 32 * 1024
