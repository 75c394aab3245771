"""A parameter's gradient handed over a round of rows at a time, reduced as it comes.

A language model's largest parameters, the output head's and the input embedding's weights
(vocabulary x hidden), get gradients that autograd makes whole before any hook sees them. Their
producers can instead make them a round of rows at a time, each row complete: the chunked head
(`xirang_ds.plugins.activations.head_rows`) and an input embedding (`embedding_rows`). A `RowSink`
takes those rounds: in each, every rank makes the same rows of every rank's shard, and the round is
reduce-scattered at once into this rank's shard of the reduced gradient and freed. So the device
holds this rank's shard (``1/world`` of the gradient) and one round, never the whole; and not even
the shard where each round's rows have somewhere to go as they come: into the fp32 accumulator
(gradient accumulation, and the last micro-step of one), or into the host buffer where exact clipping
keeps the reduced shards until the norm is known (``exact_method: host``). Then the device holds one
round. The rounds' squared norms are summed as they come, so the norm does not depend on where they
went (the rows' norm is a sum over rounds, one summation order more than the whole shard's).

Offered (`RowHandOver.take`) only where it changes nothing else: a sharded bucket (ZeRO 1/2 over
more than one rank) holding this one parameter, a 2-D parameter whose rows split evenly over the
ranks (each rank's shard is whole rows), held by one module (not tied), without a ``register_hook``
hook, the bucket next to reduce, and the producer its one use in this step's graph. After the last
round the bucket continues as any bucket whose reduction finished: accumulated, held, stashed or
applied.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Optional

import torch

from xirang_ds.compat.torch import has_grad_hooks
from xirang_ds.memory.categories import GRADIENTS
from xirang_ds.plugins.grad_release.pipeline import Pass

if TYPE_CHECKING:  # pragma: no cover
    from xirang_ds.plugins.grad_release.bucket import Bucket
    from xirang_ds.plugins.grad_release.pipeline import ReleasePipeline

FINAL = (Pass.FUSED, Pass.UPDATE, Pass.HOLD)
"""The passes whose reduced gradient is the step's: the rounds' squared norms are summed."""

ATTR = "xirang_rows"
"""The attribute grad_release sets on a parameter whose gradient it can take by rows: its `RowHandOver`."""


def owners(module: torch.nn.Module) -> Counter:
    """Parameter id → how many modules hold it (a weight tied between two modules has 2)."""
    return Counter(id(p) for m in module.modules() for p in m.parameters(recurse=False))


def fits(bucket: "Bucket", param: torch.Tensor, owners: int) -> bool:
    """Whether ``param``'s gradient can be taken by rows in ``bucket`` (module docstring)."""
    world = bucket.layout.world
    return (bucket.sharded and len(bucket.params) == 1 and not bucket.layout.padded and param.ndim == 2
            and param.shape[0] % world == 0 and owners == 1)


class RowSink:
    """This backward's rows of one parameter's gradient, reduced a round at a time.

    Attributes:
        world: ranks the gradient is sharded over.
        rows: rows of the parameter in each rank's shard (rank ``r`` owns rows ``[r*rows, (r+1)*rows)``).
        row_numel: elements of one row.
    """

    def __init__(self, pipeline: "ReleasePipeline", b: int):
        self.pipeline, self.b = pipeline, b
        self.bucket = pipeline.buckets[b]
        param = self.bucket.params[0]
        self.world = self.bucket.layout.world
        self.rows = param.shape[0] // self.world
        self.row_numel = param.shape[1]
        self.done = 0
        self.dtype = self.bucket.comm_dtype
        self.device = param.device
        self.closed = False
        kind, bucket = pipeline.kind, self.bucket
        self.into_acc = kind is Pass.ACCUMULATE or (kind in FINAL and bucket.acc is not None)
        self.to_host = not self.into_acc and kind is Pass.HOLD and pipeline.stash_held
        counted = bucket.norm_counted is None or bucket.norm_counted[0]
        self.sumsq = torch.zeros((), dtype=torch.float64, device=self.device) if kind in FINAL and counted else None
        self.host = bucket.host_shard(torch.Size([bucket.layout.shard_numel]), self.dtype) if self.to_host else None

    def round_rows(self, parts: int = 8) -> int:
        """Rows of each shard per round when the caller has no size of its own: ``1/parts`` of the shard."""
        return max(1, -(-self.rows // parts))

    def buffer(self, rows: int) -> torch.Tensor:
        """A round's buffer: ``[world, rows, row_numel]``, row block ``r`` for rank ``r``'s next ``rows`` rows."""
        with self.bucket.scope(GRADIENTS):
            return torch.empty((self.world, rows, self.row_numel), dtype=self.dtype, device=self.device)

    def reduce(self, buffer: torch.Tensor) -> None:
        """Reduce a filled round (`buffer`): every rank's rows ``[done, done + rows)`` of its shard."""
        bucket = self.bucket
        rows = buffer.shape[1]
        if self.closed or self.done + rows > self.rows:
            raise RuntimeError(f"xirang.grad_release: {bucket.names[0]}: a round of {rows} rows past the "
                               f"{self.rows} rows of each shard ({self.done} reduced)")
        start, end = self.done * self.row_numel, (self.done + rows) * self.row_numel
        if self.into_acc or self.to_host:
            with bucket.scope(GRADIENTS):
                out = torch.empty(end - start, dtype=self.dtype, device=self.device)
        else:
            if bucket.reduced is None:
                with bucket.scope(GRADIENTS):
                    bucket.reduced = torch.empty(bucket.layout.shard_numel, dtype=self.dtype, device=self.device)
            out = bucket.reduced[start:end]
        work = bucket.comm.reduce_scatter(out, buffer.view(-1))
        if work is not None:
            work.wait()
        if self.into_acc:  # as `Bucket.fold` and `Bucket.finalize` add the whole shard
            out = bucket._accumulator()[start:end].add_(out, alpha=1.0 / self.world)
        if self.sumsq is not None:
            norm = torch.linalg.vector_norm(out, dtype=torch.float32).double()
            self.sumsq += (norm if self.into_acc else norm / self.world) ** 2
        if self.to_host:  # queued as `Bucket.stash` copies (`Bucket.to_host`)
            bucket.to_host(self.host[start:end], out)
        self.done += rows

    def close(self) -> None:
        """Every row is in: the bucket's reduction is finished (`ReleasePipeline.delivered`)."""
        if self.done != self.rows:
            raise RuntimeError(f"xirang.grad_release: {self.bucket.names[0]}: {self.done} of {self.rows} rows "
                               "reduced when the rows ended")
        self.closed = True
        bucket = self.bucket
        bucket.rows_taken = "acc" if self.into_acc else "host" if self.to_host else None
        bucket.rows_sumsq = self.sumsq
        self.pipeline.delivered(self.b)


class RowHandOver:
    """What a parameter's one producer of rows asks: `used` in forward, `take` in backward.

    The rows are taken only from the parameter's one use in this step's graph: each forward use that
    records a graph counts (`used`), and the count restarts when ``engine.backward`` returns (the
    pipeline's `ReleasePipeline.forget_uses`). A head called twice, a loss left from an earlier
    forward, or a hook on the parameter (``register_hook``) gives the gradient whole, as without the
    hand-over. Every rank decides alike only if each holds the same hooks, as each runs the same graph."""

    def __init__(self, pipeline: "ReleasePipeline", param: torch.Tensor):
        self.pipeline = pipeline
        self.b, self.i = pipeline.slots[param]

    def used(self) -> None:
        """A forward use whose graph will give the parameter a gradient."""
        self.pipeline.row_uses[self.b] += 1

    def take(self) -> Optional[RowSink]:
        """A `RowSink` for this backward, or ``None`` where the whole gradient must be given."""
        p, b = self.pipeline, self.b
        bucket = p.buckets[b]
        if (not p.by_rows[b] or p.kind is None or p.row_uses[b] != 1 or bucket.arrived[self.i] or b != p.next_launch
                or has_grad_hooks(bucket.params[self.i])):  # a hook (register_hook) must see the gradient whole
            return None
        return RowSink(p, b)


__all__ = ["ATTR", "RowHandOver", "RowSink", "fits"]
