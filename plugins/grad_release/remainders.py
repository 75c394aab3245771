"""Exact fp32 masters kept as the bf16 weight plus a 16-bit remainder.

An fp32 number is 32 bits; its bf16 rounding is the top 16 (sign, exponent, 7 mantissa bits), plus
one when round-to-nearest-even rounded the magnitude up. Beside the bf16 weight the model already
holds, the low 16 bits of the master and one bit more rebuild the master bit for bit:

* low half below ``0x8000``: the weight was rounded down, the high half is the weight's bits;
* above ``0x8000``: rounded up, the high half is the weight's bits minus one;
* exactly ``0x8000`` (a tie, about one element in 65,536 after each update): round-to-nearest-even
  went to the even neighbour, which the weight does not tell (either neighbour leaves an even
  weight), so one bit per element says whether the tie went down. The bits are packed, 8 a byte.

So a master costs 2 bytes of remainder and 1/8 byte of tie bits instead of 4, and training is the one
with fp32 masters, bit for bit, as long as the weight is the master's round-to-nearest-even (what
``tensor.to(torch.bfloat16)`` computes on every device). Megatron's precision-aware optimizer keeps
the same remainder (``store_param_remainders``) but rounds ties away from zero instead, which needs
no tie bit and makes the weight differ from the fp32-master run's at every tie.

Both functions work on views of the fp32 tensor's two 16-bit halves (little-endian: the low half
first), so they allocate nothing the size of the master.

**8-bit remainders** (``masters: remainders_8bit``, not exact): after each update the master is
rounded stochastically to 16 significant bits (its low 8 bits cleared: up, away from zero, with
probability equal to the fraction of a step they are; `round8_`), and the weight is that number
rounded to bf16 half away from zero, as Megatron rounds. Its fp32 bits then differ from the weight's
shifted left by 16 by ``-0x8000`` to ``0x7F00``, a multiple of 256: one signed byte, which is the
master's second byte (`split8`, `join8`). A master costs 1 byte instead of 4 and no tie bit; training
is no longer the fp32-master run's bit for bit. Against ``masters: none`` the stochastic rounding's
step is 256 times finer (2**-16 of the weight instead of 2**-8), so its noise is 256 times smaller.
A master already on that grid (rebuilt by `join8`, or loaded from a checkpoint this format wrote)
rounds to itself, so a save and load round trip is exact.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

from xirang_ds.plugins.grad_release.stochastic import round_, rounded_chunks

_TIE = -32768  # 0x8000 as int16
HALF = 1 << 15  # added to the bits before clearing the low half: rounds half away from zero
HIGH_HALF = -(1 << 16)  # 0xFFFF0000 as int32

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("xirang grad_release remainders assume little-endian fp32 layout")


def tie_bytes(numel: int) -> int:
    """Bytes of packed tie bits for ``numel`` masters."""
    return -(-numel // 8)


def _halves(master: torch.Tensor) -> torch.Tensor:
    return master.view(torch.int16).view(master.numel(), 2)


# Eight flags, one per byte of an int64, into one byte and back, by multiplication (int64 products
# wrap on every device): the product's top byte gathers bit i from byte i; a byte copied into all
# eight bytes and masked keeps bit i in byte i, and adding 0x7F moves it to the byte's top bit.
_GATHER = 0x0102040810204080
_SPREAD = 0x0101010101010101
_SELECT = 0x8040201008040201 - 2 ** 64
_CARRY = 0x7F7F7F7F7F7F7F7F


def _pack(flags: torch.Tensor, out: torch.Tensor) -> None:
    """``flags`` (bool) → ``out`` (uint8, ``tie_bytes(flags.numel())``), element i in bit i % 8."""
    whole = flags.numel() // 8 * 8
    words = flags[:whole].view(torch.uint8).view(torch.int64)
    torch.bitwise_right_shift(words * _GATHER, 56, out=words)  # reuses the flags' bytes
    out[:whole // 8].copy_(words)
    if whole < flags.numel():
        tail = flags[whole:].to(torch.uint8) << torch.arange(flags.numel() - whole, dtype=torch.uint8,
                                                              device=flags.device)
        out[-1] = tail.sum(dtype=torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``packed`` → one byte (0 or 1) per flag, ``8 * packed.numel()`` of them."""
    words = packed.to(torch.int64).mul_(_SPREAD).bitwise_and_(_SELECT)
    return words.add_(_CARRY).bitwise_right_shift_(7).bitwise_and_(_SPREAD).view(torch.uint8)


def split(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor, ties: torch.Tensor) -> None:
    """Write ``master``'s remainder and tie bits.

    Args:
        master: fp32, flat.
        weight: bf16, flat, ``master.to(torch.bfloat16)``.
        remainder: int16, flat, ``master.numel()`` elements (out).
        ties: uint8, ``tie_bytes(master.numel())`` elements (out).
    """
    halves = _halves(master)
    remainder.copy_(halves[:, 0])
    down = (remainder == _TIE).logical_and_(halves[:, 1] == weight.view(torch.int16))  # ties rounded down
    _pack(down, ties)


def join(weight: torch.Tensor, remainder: torch.Tensor, ties: torch.Tensor, master: torch.Tensor) -> None:
    """Rebuild the fp32 ``master`` (out, flat) from the bf16 ``weight``, ``remainder`` and ``ties``.

    The high half is the weight's bits minus one where the low half is ``0x8000`` or more (the
    weight was rounded up: ``low >> 15`` is -1 there), plus one back where a tie went down."""
    halves = _halves(master)
    high = halves[:, 1]
    torch.add(weight.view(torch.int16), remainder >> 15, out=high)
    high += _unpack(ties)[:master.numel()]
    halves[:, 0] = remainder


def round8_(master: torch.Tensor, out: torch.Tensor, seed: int, offset: int = 0) -> None:
    """Round fp32 ``master`` (flat; overwritten) stochastically to 16 significant bits and write its bf16
    rounding half away from zero into ``out`` (bf16, flat, same numel): the pair `split8` keeps.

    The noise is counter-based under ``seed`` (`stochastic.noise_seed`, `stochastic.random_bits`), a chunk of
    `stochastic.CHUNK_NUMEL` elements at a time; infinities stay, a NaN becomes the canonical one
    (whose low half is zero); the largest finite numbers can round to infinity, as to nearest. ``offset``: the
    index of ``master``'s element 0 in the shard its noise is drawn for."""
    for start, part, noise in rounded_chunks(master, seed, 8, offset):  # NOISE_BYTES an element of a chunk
        half = noise.fill_(HALF).add_(part).bitwise_and_(HIGH_HALF)  # half away from zero
        out[start:start + part.numel()].copy_(half.view(torch.float32))  # exact: the low half is zero


def round_into(master: torch.Tensor, out: torch.Tensor, seed: int, offset: int = 0, low_bits: int = 16,
               compiled: Optional[Callable[..., bool]] = None) -> None:
    """fp32 ``master`` (flat; consumed) rounded stochastically into bf16 ``out``: ``low_bits`` 16 as
    `stochastic.round_` (``masters: none``), 8 as `round8_` (``remainders_8bit``), the noise of elements ``offset
    ..`` under ``seed``. ``compiled``: an optimizer's one-call rounding with the same bits, tried first
    (optimizer_states' `FusedStep.round_`, which says False where it does not run)."""
    if compiled is not None and compiled(master, out, seed, offset, low_bits=low_bits):
        return
    (round8_ if low_bits == 8 else round_)(master, out, seed, offset)


def split8(master: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write ``master``'s 8-bit remainder (int8, flat, ``master.numel()``; out). ``master`` is what
    `round8_` left, its weight what it wrote: the master's bits minus the weight's shifted left by 16
    are the low half read as a signed number (negative where the weight was rounded up), a multiple
    of 256, so its high byte, the master's second, is the remainder."""
    remainder.copy_(master.view(torch.int8).view(master.numel(), 4)[:, 1])


def join8(weight: torch.Tensor, remainder: torch.Tensor, master: torch.Tensor) -> None:
    """Rebuild the fp32 ``master`` (out, flat) from the bf16 ``weight`` and its 8-bit ``remainder``:
    the high half is the weight's bits minus one where the remainder is negative, the second byte
    the remainder, the first zero."""
    halves = _halves(master)
    torch.add(weight.view(torch.int16), remainder >> 7, out=halves[:, 1])
    parts = master.view(torch.int8).view(master.numel(), 4)
    parts[:, 1] = remainder
    parts[:, 0] = 0


__all__ = ["join", "join8", "round8_", "round_into", "split", "split8", "tie_bytes"]
