"""Bucket planning and the shard layout of one bucket: pure arithmetic on element counts.

A bucket is a run of parameters reduced together. Sharded over ``world`` ranks, each parameter is
cut into ``world`` chunks of ``ceil(numel / world)`` elements (the last chunk zero-padded), the way
FSDP2 shards each parameter rather than one flat buffer (ZeRO): every rank then owns ``1/world`` of
every parameter, so the work of a bucket is balanced whatever its parameters' sizes, and each rank's
optimizer sees one tensor per parameter.

The communication buffer of a bucket is ``[world, shard_numel]``: row ``r`` holds rank ``r``'s
chunk of every parameter, back to back. ``reduce_scatter`` of that buffer leaves each rank its row
summed over ranks; ``all_gather`` of each rank's row rebuilds the buffer. With ``world == 1`` the
same layout is the plain concatenation of the parameters (ZeRO stage 0: nothing sharded).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from xirang_ds.compat.torch import foreach

AUTO_BUCKET_FRACTION = 16
"""``auto`` bucket size: the trainable elements divided by this, raised toward the size at which one
collective runs at >= 90% of the link's bandwidth (`xirang_ds.links.efficient_numel`: a small model
then pays fewer, mostly-transfer collectives) ..."""
AUTO_BUCKET_MAX_FRACTION = 8
"""... but not above the trainable elements divided by this (at least this many buckets: the gradients
in flight, two buckets, stay about a quarter of the model's) ..."""
AUTO_BUCKET_MIN_NUMEL = 2**16
"""... and at least this many elements ..."""
AUTO_BUCKET_MAX_NUMEL = 2**25
"""... and at most this many (64 MiB of bf16 gradients)."""


def auto_bucket_numel(total_numel: int, efficient_numel: int = 0) -> int:
    """The ``bucket_size_numel: "auto"`` value for a model with ``total_numel`` trainable elements,
    on a link whose collectives need ``efficient_numel`` elements to run at >= 90% of its bandwidth."""
    share = total_numel // AUTO_BUCKET_FRACTION
    if efficient_numel > share:
        share = min(efficient_numel, total_numel // AUTO_BUCKET_MAX_FRACTION)
    return max(AUTO_BUCKET_MIN_NUMEL, min(AUTO_BUCKET_MAX_NUMEL, share))


def plan_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Group consecutive parameters into buckets of at most ``bucket_numel`` elements.

    Args:
        numels: element counts in the order gradients are expected (reverse registration order).
        bucket_numel: the bucket size; a parameter larger than it gets a bucket of its own.

    Returns:
        Lists of indices into ``numels``, in order, covering every index once.

    Raises:
        ValueError: ``bucket_numel`` is not positive.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1; got {bucket_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        if current and filled + numel > bucket_numel:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += numel
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class Piece:
    """One rank's slice of one parameter of a bucket.

    Attributes:
        index: position of the parameter in the bucket.
        start: first element of the slice in the flattened parameter.
        numel: elements in the slice (0 when the parameter is too small to reach this rank).
        offset: position of the slice in the rank's shard (row of the communication buffer).
    """

    index: int
    start: int
    numel: int
    offset: int


@dataclass(frozen=True)
class BucketLayout:
    """Where each parameter of a bucket lives in the ``[world, shard_numel]`` buffer.

    Attributes:
        numels: elements of each parameter, in bucket order.
        world: ranks the bucket is sharded over (1: not sharded).
        chunks: elements of each parameter per rank, ``ceil(numel / world)``.
        offsets: where each parameter's chunk starts in a row.
        shard_numel: elements of one row (one rank's shard).
    """

    numels: tuple[int, ...]
    world: int
    chunks: tuple[int, ...]
    offsets: tuple[int, ...]
    shard_numel: int

    @classmethod
    def build(cls, numels: Sequence[int], world: int) -> "BucketLayout":
        """The layout of parameters with these element counts over ``world`` ranks."""
        if world < 1:
            raise ValueError(f"world must be >= 1; got {world}")
        chunks = tuple(-(-n // world) for n in numels)
        offsets, total = [], 0
        for c in chunks:
            offsets.append(total)
            total += c
        return cls(tuple(numels), world, chunks, tuple(offsets), total)

    @property
    def numel(self) -> int:
        """Elements of the whole communication buffer (``world * shard_numel``, padding included)."""
        return self.world * self.shard_numel

    @property
    def padded(self) -> bool:
        """True if some chunk ends in padding (a parameter's size is not a multiple of ``world``)."""
        return any(c * self.world != n for c, n in zip(self.chunks, self.numels))

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """This rank's slice of every parameter, in bucket order (slices may be empty)."""
        out = []
        for i, (n, c, off) in enumerate(zip(self.numels, self.chunks, self.offsets)):
            start = min(rank * c, n)
            out.append(Piece(index=i, start=start, numel=max(0, min(c, n - start)), offset=off))
        return tuple(out)

    # tensor helpers ---------------------------------------------------------------------------
    def write(self, buffer: torch.Tensor, index: int, flat: torch.Tensor, add: bool = False) -> None:
        """Put parameter ``index``'s flattened values into the buffer (or add them), padding zeroed.

        Args:
            buffer: the ``[world * shard_numel]`` communication buffer.
            index: the parameter's position in the bucket.
            flat: its ``numel`` values, any dtype (converted on copy).
            add: add into the buffer instead of overwriting (padding is left as it is).
        """
        rows, cols = self._region(buffer, index)
        n, c = self.numels[index], self.chunks[index]
        full = n // c if c else 0
        if full:
            dst = rows[:full]
            src = flat[: full * c].view(full, c)
            dst.add_(src) if add else dst.copy_(src)
        tail = n - full * c
        if tail:
            dst = rows[full, :tail]
            src = flat[full * c:]
            dst.add_(src) if add else dst.copy_(src)
        if not add:
            if tail:
                rows[full, tail:].zero_()
            if full + (1 if tail else 0) < self.world:
                rows[full + (1 if tail else 0):].zero_()

    def read(self, buffer: torch.Tensor, index: int, flat_out: torch.Tensor) -> None:
        """Copy parameter ``index``'s values out of the buffer into ``flat_out`` (``numel`` elements)."""
        rows, _ = self._region(buffer, index)
        n, c = self.numels[index], self.chunks[index]
        full = n // c if c else 0
        if full:
            flat_out[: full * c].view(full, c).copy_(rows[:full])
        tail = n - full * c
        if tail:
            flat_out[full * c:].copy_(rows[full, :tail])

    def read_all(self, buffer: torch.Tensor, flats: Sequence[torch.Tensor]) -> None:
        """`read` of every parameter (``flats[i]``: parameter ``i``'s ``numel`` elements, out) in one
        multi-tensor copy: one op a bucket instead of one or two a parameter, the same values."""
        dst, src = [], []
        for index, flat_out in enumerate(flats):
            rows, _ = self._region(buffer, index)
            n, c = self.numels[index], self.chunks[index]
            full = n // c if c else 0
            if full:
                dst.append(flat_out[: full * c].view(full, c))
                src.append(rows[:full])
            if n - full * c:
                dst.append(flat_out[full * c:])
                src.append(rows[full, :n - full * c])
        if dst:
            foreach.copy_(dst, src)

    def zero(self, buffer: torch.Tensor, index: int) -> None:
        """Zero parameter ``index``'s region of the buffer (a parameter that got no gradient)."""
        self._region(buffer, index)[0].zero_()

    def _region(self, buffer: torch.Tensor, index: int) -> tuple[torch.Tensor, int]:
        if buffer.numel() != self.numel:
            raise ValueError(f"buffer has {buffer.numel()} elements; the layout needs {self.numel}")
        off, c = self.offsets[index], self.chunks[index]
        return buffer.view(self.world, self.shard_numel)[:, off:off + c], c


__all__ = ["BucketLayout", "Piece", "auto_bucket_numel", "plan_buckets"]
