"""Value types of the ``"xirang"`` block and the rules that check them.

Each field of a section dataclass is annotated with one of these types; `validate.py` reads the
annotation and converts the JSON value, collecting every problem with its dotted path instead of
stopping at the first. Constraints ride along in ``typing.Annotated`` metadata, the way
``annotated_types`` does it, so a field's type, range and docstring sit in one place.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal, Union

AUTO = "auto"
"""The string a user writes for a value resolved at run time."""


@dataclass(frozen=True)
class Range:
    """Inclusive bounds for a number field; ``None`` leaves a side open."""

    low: float | None = None
    high: float | None = None
    low_exclusive: bool = False

    def check(self, value: float) -> str | None:
        if self.low is not None and (value <= self.low if self.low_exclusive else value < self.low):
            return self.describe()
        if self.high is not None and value > self.high:
            return self.describe()
        return None

    def describe(self) -> str:
        low = _fmt(self.low) if self.low is not None else None
        high = _fmt(self.high) if self.high is not None else None
        if low is not None and high is not None:
            return f"must be between {low} and {high}"
        if low is not None:
            return f"must be {'>' if self.low_exclusive else '>='} {low}"
        return f"must be <= {high}"


@dataclass(frozen=True)
class MultipleOf:
    """An integer field whose value must be a multiple of ``base``."""

    base: int

    def check(self, value: int) -> str | None:
        return None if value % self.base == 0 else f"must be a multiple of {self.base}"


class ByteSize(int):
    """A byte count written as an integer (``5e8``) or with a unit (``"40GB"``, ``"512MiB"``).

    Decimal units (KB, MB, GB, TB) are powers of 1000 and binary units (KiB, MiB, GiB, TiB) powers
    of 1024, as in DeepSpeed's and PyTorch's documentation.
    """


_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_byte_size(text: str) -> int | None:
    """Parse ``"40GB"``, ``"1.5 GiB"`` or ``"5e8"`` into bytes; ``None`` if it is not a size."""
    match = _SIZE_RE.match(text)
    if not match:
        return None
    unit = _UNITS.get(match.group(2).upper())
    if unit is None:
        return None
    return int(float(match.group(1)) * unit)


def format_bytes(n: float) -> str:
    """Human form of a byte count in binary units: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else repr(x)


# Shorthands used by the schema.
Fraction = Annotated[float, Range(0.0, 1.0)]
PositiveInt = Annotated[int, Range(1)]
NonNegativeInt = Annotated[int, Range(0)]
AutoInt = Union[Annotated[int, Range(1)], Literal["auto"]]
AutoBytes = Union[ByteSize, Literal["auto"]]
Glob = str
