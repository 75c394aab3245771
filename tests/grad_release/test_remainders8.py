"""``masters: remainders_8bit``'s number format (`remainders.round8_`, `split8`, `join8`) on CPU and,
marked ``gpu``, on CUDA: the master rounded stochastically to 16 significant bits, the weight its bf16
rounding half away from zero, one signed byte rebuilding the master exactly."""
import math

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_the_byte_rebuilds_the_rounded_master_and_the_weight_is_its_nearest_bf16(device):
    """Random bit patterns (ties of bf16 rounding forced on every 7th element, which the weight takes
    away from zero), signed zeros, infinities, subnormals and the largest finite numbers, over two
    chunks: the master keeps its top 24 bits up to one step of the last, the weight is that number
    rounded half away from zero, and weight and byte give it back bit for bit."""
    from xirang_ds.plugins.grad_release.remainders import join8, round8_, split8
    from xirang_ds.plugins.grad_release.stochastic import CHUNK_NUMEL

    g = torch.Generator().manual_seed(0)
    numel = CHUNK_NUMEL + 100_003
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (numel,), dtype=torch.int32, generator=g)
    bits[::7] = (bits[::7] & ~0xFFFF) | 0x8000
    original = bits.view(torch.float32).clone()
    original[original.isnan()] = 1.0
    original[:10] = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0, -1.0])
    original = original.to(device)
    master = original.clone()
    weight = torch.empty(numel, dtype=torch.bfloat16, device=device)
    round8_(master, weight, seed=3)
    assert bool((_bits(master) & 0xFF).eq(0).all())
    step = _bits(master) - (_bits(original) & -256)  # 0 (down) or 256 (up, away from zero)
    assert bool(((step == 0) | (step == 256)).all()) and bool((step == 256).any())
    away = ((_bits(master) + 0x8000) & -(1 << 16)).view(torch.float32).to(torch.bfloat16)
    finite = torch.isfinite(original)
    assert torch.equal(weight[finite].view(torch.int16), away[finite].view(torch.int16))
    tied = (_bits(master) & 0xFFFF) == 0x8000
    nearest_even = master.to(torch.bfloat16)
    assert bool((weight.view(torch.int16) != nearest_even.view(torch.int16))[finite].any())  # only at ties
    assert bool(((weight.view(torch.int16) != nearest_even.view(torch.int16)) & finite <= tied).all())
    remainder = torch.empty(numel, dtype=torch.int8, device=device)
    split8(master, remainder)
    rebuilt = torch.empty_like(master)
    join8(weight, remainder, rebuilt)
    assert torch.equal(_bits(rebuilt), _bits(master))
    assert weight[2:4].tolist() == [math.inf, -math.inf]
    again = rebuilt.clone()  # on the grid already: rounds to itself, whatever the seed
    weight_again = torch.empty_like(weight)
    round8_(again, weight_again, seed=99)
    assert torch.equal(_bits(again), _bits(master)) and torch.equal(weight_again.view(torch.int16),
                                                                        weight.view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
def test_the_rounding_to_16_significant_bits_is_unbiased_and_carries_small_updates(device):
    """A value 1/32 of a grid step past 1.0 rounds up about 1/32 of the time (the mean is the value,
    within 5 sigma); 2,000 updates of 2**-20 (1/32 of a grid step, 1/8192 of a bf16 step) carried
    by the byte move the master as the fp32 sum does (rounded to nearest they would never move it),
    while the bf16 weight stays its nearest."""
    from xirang_ds.plugins.grad_release.remainders import join8, round8_, split8

    n = 1 << 20
    value = 1.0 + 2 ** -20
    master = torch.full((n,), value, device=device)
    weight = torch.empty(n, dtype=torch.bfloat16, device=device)
    round8_(master, weight, seed=1)
    p = 1 / 32
    assert abs(float((master == 1.0 + 2 ** -15).double().mean()) - p) <= 5 * math.sqrt(p * (1 - p) / n)
    weight = torch.ones(4096, dtype=torch.bfloat16, device=device)
    remainder = torch.zeros(4096, dtype=torch.int8, device=device)
    master = torch.empty(4096, device=device)
    for step in range(2000):
        join8(weight, remainder, master)
        master += 2 ** -20
        round8_(master, weight, seed=step)
        split8(master, remainder)
    join8(weight, remainder, master)
    sigma = 2 ** -15 * math.sqrt(2000 * p * (1 - p) / 4096)  # each element a walk of 2,000 such roundings
    assert abs(float(master.double().mean()) - (1 + 2000 * 2 ** -20)) < 5 * sigma < 2000 * 2 ** -20 / 100
    assert bool((weight == 1.0).all())  # 0.0019 past 1.0 is below half a bf16 step (0.0039)
