"""The counter-based noise of stochastic rounding (`plugins/grad_release/stochastic.py`): uniform bits,
a pure function of the seed and the element's index (so chunking does not matter, and eager and
compiled code draw the same bits), unbiased rounding, infinities and NaN kept, and its temporaries."""
import math

import torch

from tests.optimizer_states.test_units import one_thread  # noqa: F401  (autouse: one thread per test)
from xirang_ds.plugins.grad_release.stochastic import (
    CHUNK_NUMEL,
    NOISE_BYTES,
    noise_keys,
    noise_seed,
    random_bits,
    round_,
    stochastic_round,
)

N = 1 << 20


def test_bits_are_uniform_bit_by_bit_and_by_value():
    bits = random_bits(noise_keys(noise_seed(3, 17, 1)), 0, N, 16)
    assert int(bits.min()) >= 0 and int(bits.max()) < 1 << 16
    sigma = math.sqrt(0.25 / N)  # one bit's mean
    for b in range(16):
        assert abs(((bits >> b) & 1).double().mean().item() - 0.5) < 5 * sigma, b
    counts = torch.bincount(bits >> 10, minlength=64).double()  # 64 bins: a chi-square of 63 degrees
    chi2 = ((counts - N / 64) ** 2 / (N / 64)).sum().item()
    assert chi2 < 63 + 5 * math.sqrt(2 * 63), chi2
    pairs = (bits[:-1] >> 8) * 256 + (bits[1:] >> 8)  # neighbours independent: 65,536 bins of pairs
    assert torch.bincount(pairs, minlength=1 << 16).double().std().item() < 1.1 * math.sqrt(N / (1 << 16))


def test_draws_are_a_function_of_seed_index_and_stream_alone():
    keys = noise_keys(noise_seed(0, 5, 0))
    whole = random_bits(keys, 0, 10_000, 16)
    assert torch.equal(torch.cat([random_bits(keys, o, n, 16) for o, n in ((0, 4096), (4096, 17), (4113, 5887))]),
                       whole)  # a chunk at offset o draws elements o..o+n of the whole
    assert torch.equal(random_bits(keys, torch.tensor(4096), 17, 16), whole[4096:4113])
    assert torch.equal(random_bits(noise_keys(noise_seed(0, 5, 0)), 0, 10_000, 16), whole)  # no running state
    for other in (random_bits(noise_keys(noise_seed(0, 6, 0)), 0, 10_000, 16),  # the next step
                  random_bits(noise_keys(noise_seed(0, 5, 1)), 0, 10_000, 16),  # another rank
                  random_bits(keys, 0, 10_000, 16, stream=1),
                  random_bits(keys, 1 << 32, 10_000, 16)):  # indices past 32 bits
        assert (other == whole).double().mean().item() < 5 / 65536 + 1e-3


def test_rounding_is_unbiased_where_round_to_nearest_is_not():
    """E[round(x)] = x for a value 1/7 of a bf16 step past 1.0 (nearest never moves it), over 2**20 draws."""
    ulp = 2.0 ** -7
    value = 1.0 + ulp / 7
    out = torch.empty(N, dtype=torch.bfloat16)
    round_(torch.full((N,), value), out, seed=noise_seed(2, 9, 0))
    mean = out.double().mean().item()
    stderr = ulp * math.sqrt((1 / 7) * (6 / 7) / N)
    assert abs(mean - value) < 4 * stderr, (mean - value) / stderr
    assert torch.full((1,), value).to(torch.bfloat16).item() == 1.0


def test_compiled_rounding_draws_the_same_bits_as_the_eager_one():
    """One static graph of `stochastic_round` at an offset: bit for bit the eager result, infinities
    and NaN included (a NaN becomes the canonical one)."""
    keys = noise_keys(noise_seed(1, 2, 3))
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e3
    x[:4] = torch.tensor([math.inf, -math.inf, math.nan, 0.0])
    x[4:5].view(torch.int32)[0] = 0x7F800001  # a NaN whose payload is in the low half only
    compiled = torch.compile(stochastic_round, dynamic=False, fullgraph=True)
    got = compiled(x.clone(), keys, torch.tensor(CHUNK_NUMEL + 5))
    want = stochastic_round(x.clone(), keys, CHUNK_NUMEL + 5)
    assert torch.equal(got, want)
    assert want[:2].view(torch.float32).tolist() == [math.inf, -math.inf]
    assert int(want[2]) == int(want[4]) == 0x7FC00000 and int(want[3]) == 0


def test_the_noise_temporaries_are_noise_bytes_an_element_of_a_chunk():
    from xirang_ds.memory.tracker import MemoryTracker

    master, out = torch.randn(CHUNK_NUMEL + 100), torch.empty(CHUNK_NUMEL + 100, dtype=torch.bfloat16)
    tracker = MemoryTracker("cpu")
    tracker.seed([master, out], "parameters")
    before = tracker.live_bytes
    with tracker:
        round_(master, out, seed=1)
    assert NOISE_BYTES * CHUNK_NUMEL <= tracker.peak_bytes - before <= NOISE_BYTES * CHUNK_NUMEL + 4096  # two int64
    master, out = torch.randn(CHUNK_NUMEL), torch.empty(CHUNK_NUMEL, dtype=torch.bfloat16)
    tracker = MemoryTracker("cpu")
    tracker.seed([master, out], "parameters")
    before = tracker.live_bytes
    with tracker:
        round_(master, out, seed=1, offset=1 << 32)  # past 2**32: three
    assert (NOISE_BYTES + 8) * CHUNK_NUMEL <= tracker.peak_bytes - before <= (NOISE_BYTES + 8) * CHUNK_NUMEL + 4096
