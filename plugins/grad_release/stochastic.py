"""bf16 weights without a master: each update's fp32 result rounded stochastically into the weight.

With ``masters: none`` a bucket keeps no master between updates. Its update starts from the bf16
weight widened to fp32, steps it, and rounds the result back to bf16 *stochastically*: up (away from
zero) with probability equal to the fraction of a bf16 step the low 16 bits are, down otherwise. The
expected weight is then the fp32 result, so an update smaller than half a bf16 step still moves the
weight on average instead of being rounded away every time (round-to-nearest would lose it). This
is what torchao's low-bit optimizers do with ``bf16_stochastic_round=True``; training is no longer
the fp32-master run's bit for bit, and docs/grad_release.md has the measured convergence.

The rounding works on the fp32 bits: add a uniform 16-bit integer to the magnitude's low half
(sign-magnitude: the same add moves both signs away from zero) and clear the low half. A carry is
the round up; the largest finite numbers can round up to infinity, as in torchao. Infinities and
NaNs stay what they are (a NaN becomes the canonical one first): their low half is zero, so the add
never carries out of it and clearing it gives them back, with no mask of them (4 bytes an element of
a chunk: the noise).

The noise is counter-based: a pure function of a seed and each element's index in the shard
(`random_bits`: splitmix64 of the seed, on the host, gives two 32-bit keys; each index is mixed with
them by two rounds of Wellons' ``lowbias32`` in int64 arithmetic masked to 32 bits, every product
below 2**63, so nothing overflows). The same code therefore runs eagerly and inside a compiled graph
(`optimizer_states.fused` folds the rounding into the update; a graph cannot take a
``torch.Generator``) and draws the same bits in both; a chunk at element ``o`` draws what elements
``o .. o+n`` of the whole shard draw, however the shard is chunked; and the seed is a function of
the bucket, the step and the rank holding the shard (`noise_seed`), not of a generator's running
state: stage 0's ranks, which update the same whole bucket, draw the same noise and keep identical
weights, and a resumed run draws what the uninterrupted one would have. (Before issue 58 the noise
came from a seeded ``torch.Generator``: runs recorded then drew other bits of the same distribution.)
"""
from __future__ import annotations

from typing import Iterator, Union

import torch

CHUNK_NUMEL = 1 << 18
"""Elements rounded per pass: the noise's temporaries (`NOISE_BYTES` an element) are this large."""
NOISE_BYTES = 16
"""Bytes an element of a chunk the noise takes at its peak: two int64 temporaries of `random_bits`
(three, 24 bytes, past element 2**32 of a shard; ``tests/grad_release/test_stochastic.py`` measures both)."""

_MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B - (1 << 32))
"""``lowbias32``'s multipliers (C. Wellons, hash-prospector), the second as the negative number it is
modulo 2**32: a 32-bit value times either stays inside int64."""
_STREAM = 0x9E3779B9
"""Added to the second key per stream: the moments' draws differ from the weight's at one seed."""


def noise_seed(bucket: int, step: int, rank: int) -> int:
    """The seed of a bucket's noise at ``step`` on the rank holding the shard (injective below
    2**24 steps and 2**16 ranks)."""
    return (bucket << 40) ^ (rank << 24) ^ step


def noise_keys(seed: int, device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """``seed``'s two 32-bit keys (splitmix64's finaliser, in Python integers) as an int64 tensor on
    ``device``: `random_bits`' first argument (a tensor: a new step is not a new graph)."""
    z = (seed + 0x9E3779B97F4A7C15) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    z ^= z >> 31
    return torch.tensor([z & _MASK32, z >> 32], dtype=torch.int64).to(device or "cpu", non_blocking=True)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` in place on int64 ``x`` holding 32-bit values."""
    x.bitwise_xor_(x >> 16).mul_(_MULTIPLIERS[0]).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(_MULTIPLIERS[1]).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def random_bits(keys: torch.Tensor, start: Union[int, torch.Tensor], n: int, bits: int,
                stream: int = 0) -> torch.Tensor:
    """Uniform ``bits``-bit integers (int64 in ``[0, 2**bits)``) of elements ``start .. start + n``: a
    pure function of ``keys``, the element's index and ``stream``, in tensor arithmetic only.

    Args:
        keys: `noise_keys`' tensor, on the result's device.
        start: the first element's index (an int, or a 0-d int64 tensor in a compiled graph).
        n: how many elements.
        bits: 1 to 32 (the hash's high bits).
        stream: a small constant telling draws of one seed and index apart (0: the weight's).
    """
    index = torch.arange(n, dtype=torch.int64, device=keys.device).add_(start)
    second = keys[1] + stream * _STREAM
    if isinstance(start, int) and start + n <= 1 << 32:  # every index's high half is 0: the same value, one scalar
        high = second.bitwise_and(_MASK32)
    else:
        high = (index >> 32).add_(second).bitwise_and_(_MASK32)
    x = _mix32_(index.bitwise_and_(_MASK32).bitwise_xor_(keys[0]))
    return _mix32_(x.bitwise_xor_(high)) >> (32 - bits)


def stochastic_round(values: torch.Tensor, keys: torch.Tensor, start: Union[int, torch.Tensor],
                     low_bits: int = 16) -> torch.Tensor:
    """fp32 ``values`` (flat; overwritten) rounded stochastically, their ``low_bits`` low bits cleared,
    with the noise of elements ``start ..`` under ``keys``; returns their int32 view. The eager
    rounding (`rounded_chunks`) and the compiled update (`optimizer_states.fused`) run this code."""
    values.masked_fill_(torch.isnan(values), float("nan"))  # a NaN whose payload is all low bits stays NaN
    noise = random_bits(keys, start, values.numel(), low_bits).to(torch.int32)
    return values.view(torch.int32).add_(noise).bitwise_and_(-(1 << low_bits))  # infinity, canonical NaN: kept


def rounded_chunks(master: torch.Tensor, seed: int, low_bits: int = 16,
                   offset: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Round fp32 ``master`` (flat; overwritten; its element 0 the shard's element ``offset``)
    stochastically, its ``low_bits`` low bits cleared, a chunk of `CHUNK_NUMEL` at a time; after each
    chunk yield ``(start, bits, scratch)``: the chunk's offset in ``master``, its int32 view and an
    int32 buffer of its size, free for the caller's use until the next chunk."""
    keys = noise_keys(seed, master.device)
    for start in range(0, master.numel(), CHUNK_NUMEL):
        part = stochastic_round(master[start:start + CHUNK_NUMEL], keys, offset + start, low_bits)
        scratch = torch.empty_like(part)
        yield start, part, scratch
        del scratch


def round_(master: torch.Tensor, out: torch.Tensor, seed: int, offset: int = 0) -> None:
    """Round fp32 ``master`` (flat; overwritten; element 0 the shard's element ``offset``)
    stochastically into bf16 ``out`` (flat, same numel)."""
    keys = noise_keys(seed, master.device)
    for start in range(0, master.numel(), CHUNK_NUMEL):
        part = stochastic_round(master[start:start + CHUNK_NUMEL], keys, offset + start)
        out[start:start + part.numel()].copy_(part.view(torch.float32))  # exact: the low half is zero


__all__ = ["CHUNK_NUMEL", "NOISE_BYTES", "noise_keys", "noise_seed", "random_bits", "round_", "rounded_chunks",
           "stochastic_round"]
