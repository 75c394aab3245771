"""One backward pass through the buckets: gradients in, reductions launched in bucket order,
at most one in flight while backward goes on, then folded, held or applied.

Collectives must be issued in the same order on every rank. Buckets are therefore launched
strictly in their planned order (reverse registration order, the order autograd usually finishes
gradients); a bucket that completes early waits for the buckets before it. At the end of
backward every bucket not launched yet (a parameter that got no gradient) is launched with zeros
for the missing gradients, in order, on every rank.
"""
from __future__ import annotations

import enum
from collections import deque
from typing import Callable, Optional, Sequence

import torch

from xirang_ds.plugins.grad_release.bucket import Bucket, Coefficient


class Pass(enum.Enum):
    """What one backward does with each bucket."""

    ACCUMULATE = "accumulate"
    """Not the last micro-step: fold the reduced shard into the accumulator (stage 0: add locally)."""
    FUSED = "fused"
    """Last micro-step: apply each bucket as soon as it is reduced."""
    HOLD = "hold"
    """Last micro-step: keep each reduced shard (on the device, or stashed in host memory);
    `ReleasePipeline.apply_all` applies them after."""
    NORM = "norm"
    """First of two passes: the gradient's norm only; nothing is kept."""
    UPDATE = "update"
    """Second of two passes: apply each bucket with the coefficient the first pass allowed."""


Rule = Callable[[Bucket], Coefficient]
"""The multiplier of a bucket's gradient at its update (unscale and clip)."""


class ReleasePipeline:
    """The buckets of this rank and the state of the backward in progress.

    Args:
        buckets: in launch order.
        overlap: keep one reduction (and one all-gather) in flight while backward continues.
        on_grad_seen: called with each gradient before it is taken (the tracker marks it).
        by_rows: per bucket, whether its parameter's gradient may be handed over by rows (`rows.fits`).
        stash_held: in a HOLD pass, keep each reduced shard in host memory (`Bucket.stash`) rather than
            on the device, and bring it back bucket by bucket in `apply_all`.

    Attributes:
        kind: the pass in progress (None between backwards).
        bucket_sumsq: per bucket, the squared norm of its gradient shard in this pass (or None).
    """

    def __init__(self, buckets: Sequence[Bucket], overlap: bool = True,
                 on_grad_seen: Optional[Callable[[torch.Tensor], None]] = None, stash_held: bool = False,
                 by_rows: Optional[Sequence[bool]] = None):
        self.buckets = list(buckets)
        self.by_rows = list(by_rows) if by_rows is not None else [False] * len(self.buckets)
        self.row_uses = [0] * len(self.buckets)
        self.stash_held = stash_held
        self.max_in_flight = 1 if overlap else 0
        self.on_grad_seen = on_grad_seen
        self.slots: dict[torch.Tensor, tuple[int, int]] = {}
        for b, bucket in enumerate(self.buckets):
            for i, param in enumerate(bucket.params):
                self.slots[param] = (b, i)
        self.kind: Optional[Pass] = None
        self.rule: Optional[Rule] = None
        self._reset()

    def _reset(self) -> None:
        self.next_launch = 0
        self.in_flight: deque[int] = deque()
        self.gathering: deque[int] = deque()
        self.bucket_sumsq: list[Optional[torch.Tensor]] = [None] * len(self.buckets)

    # one backward -------------------------------------------------------------------------------
    def begin(self, kind: Pass, rule: Optional[Rule] = None) -> None:
        """A backward of this kind starts; ``rule`` gives each bucket's multiplier (FUSED, UPDATE)."""
        self._reset()
        self.kind, self.rule = kind, rule
        for bucket in self.buckets:
            bucket.begin_backward()

    def on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: take the gradient, drop ``param.grad``, launch what is ready."""
        grad = param.grad
        if grad is None or self.kind is None:
            return
        b, i = self.slots[param]
        bucket = self.buckets[b]
        if grad.is_sparse:
            raise RuntimeError(f"xirang.grad_release: {bucket.names[i]} got a sparse gradient; grad_release "
                               "reduces dense buckets. Use dense embeddings or disable xirang.grad_release")
        if b < self.next_launch and bucket.by_rows_done:
            # a use of the weight the rows did not see (read outside its module): its gradient is added to
            # the rows' reduced shard while that is still in flight, else the step would miss it
            if b not in self.in_flight:
                raise RuntimeError(
                    f"xirang.grad_release: {bucket.names[i]} received a gradient in this backward after its "
                    "gradient had been reduced by rows and applied (the weight is used outside its module, e.g. "
                    "read by another layer). Fix: use the weight through its module only, or disable "
                    "xirang.grad_release")
            if self.on_grad_seen is not None:
                self.on_grad_seen(grad)
            bucket.add_late(i, grad)
            param.grad = None
            return
        if b < self.next_launch:
            raise RuntimeError(
                f"xirang.grad_release: {bucket.names[i]} received a second gradient in one backward after its "
                "bucket was reduced (a parameter shared across a reentrant activation-checkpoint boundary?). "
                "grad_release needs each parameter's gradient once per backward; use non-reentrant "
                "checkpointing (torch.utils.checkpoint with use_reentrant=False) or disable xirang.grad_release")
        if self.on_grad_seen is not None:
            self.on_grad_seen(grad)
        bucket.add(i, grad, local=self._local(bucket), peek=self.kind is Pass.NORM)
        param.grad = None
        del grad
        self._launch_ready()

    def forget_uses(self) -> None:
        """``engine.backward`` returned: the next forward's uses count afresh (`rows.RowHandOver`)."""
        self.row_uses = [0] * len(self.buckets)

    def delivered(self, b: int) -> None:
        """Bucket ``b``'s gradient was reduced by rows (`rows.RowSink`): it goes on as a launched bucket."""
        bucket = self.buckets[b]
        bucket.arrived = [True] * len(bucket.params)
        bucket.missing = 0
        bucket.by_rows_done = True
        self.next_launch = b + 1
        self.in_flight.append(b)
        while len(self.in_flight) > max(1, self.max_in_flight):  # it stays for a late use (`Bucket.add_late`)
            self._complete(self.in_flight.popleft())
        self._launch_ready()

    def finish(self) -> Optional[torch.Tensor]:
        """End of backward: launch what is left (zeros for missing gradients) and complete everything.

        Returns:
            The sum of this rank's squared gradient norms over the buckets (float64 scalar), or
            None for a local accumulation pass.
        """
        while self.next_launch < len(self.buckets):
            self._launch(self.next_launch)
        while self.in_flight:
            self._complete(self.in_flight.popleft())
        self._finish_gathers(0)
        kind, self.kind = self.kind, None
        sums = [s for s in self.bucket_sumsq if s is not None]
        if kind is Pass.ACCUMULATE or not sums:
            return None
        return torch.stack(sums).sum()

    def apply_all(self, rule: Rule) -> None:
        """After a HOLD pass: apply every bucket in order, gathers overlapped with the next update; a stashed shard
        comes back while the bucket before it updates, where the stash's copies run ahead (`Bucket.prefetch_grad`)."""
        for b, bucket in enumerate(self.buckets):
            bucket.unstash()
            if b + 1 < len(self.buckets):
                self.buckets[b + 1].prefetch_grad()
            bucket.apply(rule(bucket))
            self._fetch_ahead(b + 1)
            self.gathering.append(b)
            self._finish_gathers(self.max_in_flight)
        self._finish_gathers(0)

    def discard_all(self) -> None:
        """Skip the step: drop every gradient and accumulator."""
        for bucket in self.buckets:
            bucket.discard()

    def abort(self) -> None:
        """A backward raised: forget its partial gradients so the next one starts clean."""
        for bucket in self.buckets:
            bucket.abort_backward()
        self.kind = None
        self._reset()

    # internals --------------------------------------------------------------------------------
    def _local(self, bucket: Bucket) -> bool:
        return self.kind is Pass.ACCUMULATE and not bucket.sharded

    def _launch_ready(self) -> None:
        """Launch, in order, every bucket whose gradients have all arrived."""
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].complete:
            self._launch(self.next_launch)

    def _launch(self, b: int) -> None:
        self.next_launch = b + 1
        bucket = self.buckets[b]
        if self._local(bucket):
            return  # stage 0, not the last micro-step: nothing to reduce yet
        bucket.launch(peek=self.kind is Pass.NORM)
        self.in_flight.append(b)
        while len(self.in_flight) > self.max_in_flight:
            self._complete(self.in_flight.popleft())

    def _complete(self, b: int) -> None:
        bucket = self.buckets[b]
        bucket.wait()
        kind = self.kind
        if kind is Pass.ACCUMULATE:
            bucket.fold()
        elif kind is Pass.NORM:
            self.bucket_sumsq[b] = bucket.peek_sumsq()
        else:
            bucket.finalize()
            self.bucket_sumsq[b] = bucket.sumsq()
            if kind is Pass.HOLD:
                if self.stash_held:
                    bucket.stash()
            else:
                bucket.apply(self.rule(bucket) if self.rule is not None else 1.0)
                self._fetch_ahead(b + 1)
                self.gathering.append(b)
                self._finish_gathers(self.max_in_flight)

    def _fetch_ahead(self, b: int) -> None:
        """Bucket ``b``'s optimizer states start for the device once the bucket before it has updated, where they
        are in host memory and the copies run ahead (`parked_states.ParkedStates.prefetch_states`): on the side
        stream after that bucket's copy back, so at most these two buckets' states are on the device at once."""
        if b < len(self.buckets):
            self.buckets[b].prefetch_states()

    def _finish_gathers(self, keep: int) -> None:
        while len(self.gathering) > keep:
            self.buckets[self.gathering.popleft()].finish_gather()


__all__ = ["Pass", "ReleasePipeline", "Rule"]
