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
"""
from __future__ import annotations

import sys

import torch

_TIE = -32768  # 0x8000 as int16

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


__all__ = ["join", "split", "tie_bytes"]
