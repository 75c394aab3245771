"""Quantization maps for block-wise Adam states: analytic both ways, no lookup table.

A map turns a value normalised by its block's scale (``t`` in [-1, 1], or [0, 1] for the second
moment) into an integer code and back. bitsandbytes and torchao use a 256/16-entry table (the
dynamic map of Dettmers et al. 2022, the 4-bit DE map of Li et al. 2023) and find codes by binary
search. The maps here are companding curves computed with a square root and a multiply instead:

* first moment (signed): ``t = sign(q) * (|q| / L) ** 2``. Codes are dense near zero, like the
  dynamic map's exponent, so small momenta in a block with one large entry keep their sign and
  size (8-bit: ``L = 127``, smallest step 6e-5 of the block maximum; 4-bit: ``L = 7``).
* second moment, 8-bit: ``v = ((q + 1) / 256) ** 4``: a square-root curve on ``sqrt(v)``, the
  quantity Adam divides by, spanning ten decades below the block maximum, and without a zero code
  (the smallest value is 2.3e-10 of the block maximum). With a zero code (``(q / 255) ** 4``, the
  map of state-dict version 1) an entry at or below 1.5e-11 of its block's maximum decoded to 0, and
  its update became ``m / eps``: in a block with one noisy large entry and small steady gradients
  elsewhere, steps far above lr (15x in the test, growing with the step count). Without it, an entry
  below the smallest value reads that value, never zero: its step can only shrink, and rounding
  between the lowest codes moves it by at most the square root of their ratio.
* second moment, 4-bit: ``sqrt(v) = (q + 1) / 16``: linear in ``sqrt(v)`` and without a zero code.
  Li et al. 2023 (section 4) show that a zero code for the second moment sends updates of the
  entries rounded to it to ``m / eps``; excluding zero fixes that, and working on ``sqrt(v)``
  instead of ``v`` halves the dynamic range the 16 levels must cover.

Measured on the moments of a small GPT trained on tinyshakespeare
(``benchmarks/optimizer_states_maps.py``), the relative error of the Adam update ``m / sqrt(v)``
from decoded states is 1.0-1.2% with the 8-bit maps here (the same without the zero code) against
1.6-1.9% with bitsandbytes' dynamic maps, and 16-20% at 4 bits against 27-35% with Li et al.'s maps (as torchao ships them).
That is one round trip; over training, round to nearest also drops changes smaller than half a
code step, which matters at 4 bits (see docs/optimizer_states.md).

Rounding is to nearest (in the companded domain), or stochastic: up with the probability that
makes the decoded value's expectation equal the input (unbiased in value, not in code).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class CompandingMap:
    """``value(q) = sign(q) * ((|q| + offset) / levels) ** power`` for integer codes ``q``.

    Attributes:
        levels: codes per sign: ``q`` runs over ``[-levels, levels]`` (signed) or
            ``[0, levels - offset]`` (unsigned).
        power: 2 (square-root companding) or 4 (fourth-root companding).
        signed: the first moment is signed, the second is not.
        offset: 1 removes the zero code (``q = 0`` stands for ``1 / levels``).
    """

    levels: int
    power: int
    signed: bool
    offset: int = 0

    def __post_init__(self) -> None:
        if self.power not in (2, 4) or (self.signed and (self.power != 2 or self.offset)):
            raise ValueError(f"unsupported map: power={self.power}, signed={self.signed}, offset={self.offset}")

    @property
    def max_code(self) -> int:
        """Largest code; the smallest is ``-max_code`` (signed) or 0."""
        return self.levels - self.offset

    def encode(self, t: torch.Tensor, uniform: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Codes (float tensor of integers) of normalised values ``t`` (modified in place).

        Args:
            t: values divided by their block scale, fp32; consumed (overwritten).
            uniform: draws in ``[0, 1)`` shaped like ``t`` for stochastic rounding; ``None`` rounds to nearest.

        Returns:
            A float tensor holding integer codes, same shape as ``t``.
        """
        sign = torch.sign(t) if self.signed else None
        c = t.abs_() if self.signed else t.clamp_(min=0.0)
        c = c.sqrt_() if self.power == 2 else c.sqrt_().sqrt_()
        c.mul_(self.levels)
        if self.offset:
            c.sub_(self.offset)
        if uniform is None:
            c.round_()
        else:
            c = self._round_stochastic(c, uniform)
        c.clamp_(0.0, float(self.max_code))
        return c.mul_(sign) if sign is not None else c

    def _round_stochastic(self, c: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Round up with the probability that keeps the decoded value unbiased.

        With ``a = floor(c) + offset`` and ``f = c - floor(c)``, the value between codes is
        ``((a + f) / L) ** power``, so rounding up with probability
        ``((a + f) ** power - a ** power) / ((a + 1) ** power - a ** power)`` has the right mean.
        """
        low = c.floor()
        f = c.sub_(low)
        a = low + self.offset if self.offset else low.clone()
        if self.power == 2:  # f (2a + f) / (2a + 1)
            a.mul_(2)
            p = (a + f).mul_(f).div_(a.add_(1))
        else:
            a2 = a.square()
            b2 = (a + 1).square_()
            x2 = a.add_(f).square_()
            p = x2.square_().sub_(a2.square()).div_(b2.square_().sub_(a2.square_()))
        return low.add_(u.lt(p))

    def magnitude(self, codes: torch.Tensor) -> torch.Tensor:
        """``((|q| + offset) / levels) ** power`` as a new fp32 tensor."""
        x = codes.abs() if self.signed else codes.to(torch.float32, copy=True)
        return self._power_(x)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Normalised values of integer codes (any integer or float dtype) as a new fp32 tensor."""
        q = codes.to(torch.float32, copy=True)
        if self.signed:  # power 2 (checked in __post_init__): sign(q) * q**2 == q * |q|
            return q.abs().mul_(q).mul_(1.0 / self.levels ** 2)
        return self._power_(q)

    def _power_(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            x.add_(self.offset)
        x.mul_(x)
        if self.power == 4:
            x.mul_(x)
        return x.mul_(1.0 / self.levels ** self.power)

    def smallest_step(self) -> float:
        """Normalised value of the smallest non-zero code (how far below the block maximum a
        value can be and still be stored as non-zero)."""
        return ((1 + self.offset) / self.levels) ** self.power


FIRST_MOMENT_8BIT = CompandingMap(levels=127, power=2, signed=True)
SECOND_MOMENT_8BIT = CompandingMap(levels=256, power=4, signed=False, offset=1)
FIRST_MOMENT_4BIT = CompandingMap(levels=7, power=2, signed=True)
SECOND_MOMENT_4BIT = CompandingMap(levels=16, power=2, signed=False, offset=1)
"""The maps of the int8 and int4 formats, by moment."""
SECOND_MOMENT_8BIT_V1 = CompandingMap(levels=255, power=4, signed=False)
"""The int8 second moment's map in state-dict version 1 (with a zero code): read when such states
are loaded, and re-encoded in `SECOND_MOMENT_8BIT`."""
