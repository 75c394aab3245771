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

The noise is a function of the bucket, the step and the rank holding the shard (`noise_seed`), not of
a generator's running state: stage 0's ranks, which update the same whole bucket, draw the same
noise and keep identical weights, and a resumed run draws what the uninterrupted one would have.
"""
from __future__ import annotations

from typing import Iterator

import torch

CHUNK_NUMEL = 1 << 20
"""Elements rounded per pass: the noise (4 bytes an element) is this large."""



def noise_seed(bucket: int, step: int, rank: int) -> int:
    """The seed of a bucket's noise at ``step`` on the rank holding the shard (injective below
    2**24 steps and 2**16 ranks)."""
    return (bucket << 40) ^ (rank << 24) ^ step


def chunk_seed(seed: int, offset: int) -> int:
    """The seed of the chunk at element ``offset`` of a shard whose noise seed is ``seed`` (an
    optimizer that rounds chunk by chunk: the draws do not depend on which chunks came before)."""
    return (seed * 0x9E3779B97F4A7C15 + offset) % (1 << 63)


def rounded_chunks(master: torch.Tensor, seed: int,
                   low_bits: int = 16) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Round fp32 ``master`` (flat; overwritten) stochastically, its ``low_bits`` low bits cleared, a chunk
    of `CHUNK_NUMEL` at a time; after each chunk yield ``(start, bits, noise)``: the chunk's offset, its
    int32 view and the chunk's noise buffer (free for the caller's use until the next chunk)."""
    generator = torch.Generator(device=master.device)
    generator.manual_seed(seed)
    bits = master.view(torch.int32)
    for start in range(0, master.numel(), CHUNK_NUMEL):
        part = bits[start:start + CHUNK_NUMEL]
        values = master[start:start + CHUNK_NUMEL]
        values.masked_fill_(torch.isnan(values), float("nan"))  # a NaN whose payload is all low bits stays NaN
        noise = torch.randint(0, 1 << low_bits, part.shape, dtype=torch.int32, device=part.device,
                              generator=generator)
        part.add_(noise).bitwise_and_(-(1 << low_bits))  # an infinity or a canonical NaN has them zero: it stays
        yield start, part, noise
        del noise


def round_(master: torch.Tensor, out: torch.Tensor, seed: int) -> None:
    """Round fp32 ``master`` (flat; overwritten) stochastically into bf16 ``out`` (flat, same numel)."""
    for start, part, _ in rounded_chunks(master, seed):
        out[start:start + part.numel()].copy_(part.view(torch.float32))  # exact: the low half is zero


__all__ = ["CHUNK_NUMEL", "chunk_seed", "noise_seed", "round_", "rounded_chunks"]
