"""ZeRO 3's weight fetches over one step, as DeepSpeed's parameter coordinator makes them at a steady step.

From the second step on, the coordinator knows the step's order of module calls, forward and backward (its
trace) and, at each call, fetches the module's weights that are not gathered, then prefetches the next weights of
the trace, up to ``stage3_prefetch_bucket_size`` elements and while fewer than ``stage3_max_live_parameters`` are
gathered, in one all-gather (``partitioned_param_coordinator.py``, ``_fetch_sub_module_impl``). A fetch of two or
more weights gathers them into one flat buffer and copies each weight out of it (``partition_parameters.py``,
``_all_gather_dtype`` and ``AllGatherCoalescedHandle.wait``, ``torch.cat``); the buffer lives until the call that
uses the fetch's last weight takes it from the in-flight registry. A fetch of one weight gathers into the weight
itself. After its call a weight is released, unless its next use comes within ``stage3_max_reuse_distance``
elements of fetches or a prefetch already walked past that use (``__params_to_release``). So at DeepSpeed's
defaults (a 5e7-element bucket) a model under 5e7 elements has every weight after its first module's in one
buffer, alive from the first module to the last weight's module, late in forward: 5,767,168 bytes on gpt-small,
beside the weights copied out, all of them kept gathered to backward.

The first optimizer step differs where it accumulates. Its first micro-batch has no trace yet: each module
fetches its own weights and releases them after it, the persistent ones too (``release_sub_module``), except
those of a module whose inputs need no gradient (its post-backward function, applied to the inputs, never runs).
From its second micro-batch on the trace is complete, so the persistent weights still released are fetched and
prefetched with the others, and kept (never in ``__params_to_release``), until the step gathers them for good
(``stage3.py``, ``_post_step``). So their fetch joins the flat buffers and a buffer lives until the call that takes
its last persistent weight: on gpt-small, one 6,450,176-byte buffer to forward's end instead of 5,767,168 bytes to
its last block. `replay` with ``persistent_kept`` replays that micro-batch.

With ``offload_param`` (`RunShape.host_params`) the partitions live in host memory: on a GPU each fetch first
copies this rank's partitions of its weights in (``ds_tensor.to(device)``), then gathers. On one rank nothing is
gathered and no buffer is made: each weight is copied in whole as its module takes it (``NoGatherCoalescedHandle``;
a prefetched one reaches the device only then) and held while it is gathered. On a CPU the copy is the host
partition itself.

`replay` runs that over the module calls the trace recorded (`xirang_ds.memory.trace`: each module as its forward
starts and as its backward starts): per call, the buffers alive after its fetch, its own coalesced fetch's buffer
(alive only while its weights are copied out) and the weights gathered. The estimate sets them beside the step's
own bytes at each call (`xirang_ds.planning.estimator.stage3_fetches`).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from xirang_ds.memory.run_shape import RunShape

NOT_AVAILABLE, IN_FLIGHT, AVAILABLE = "not_available", "in_flight", "available"


@dataclass(frozen=True)
class Fetch:
    """What one module's fetch leaves.

    Attributes:
        held: bytes of the flat buffers alive after it (prefetched weights not all taken yet).
        spike: bytes of its own coalesced fetch's buffer, alive while its weights are copied out (0 when the
            module fetched fewer than two weights); with ``offload_param`` on a GPU, beside it the partitions copied
            in from the host before the gather (``ds_tensor.to(device)``), or its prefetch's, the larger.
        gathered: bytes of the partitioned weights gathered whole after it (copied out of a buffer, or gathered
            into themselves), the persistent ones left out.
        fetched: bytes of this rank's partitions of the weights its fetch and its prefetch gather (what
            ``offload_param`` copies in from the host).
    """

    held: int
    spike: int
    gathered: int = 0
    fetched: int = 0


@dataclass(frozen=True)
class Replay:
    """A steady step's fetches: per module call in forward, per module call in backward, and what forward's
    end leaves before backward's first call."""

    forward: list[Fetch]
    backward: list[Fetch]
    forward_end: Fetch


def replay(shape: RunShape, numels: list[int], forward: list[list[int]],
           backward: Optional[list[list[int]]] = None, persistent_kept: Optional[Iterable[int]] = None) -> Replay:
    """What each module's fetch leaves at a steady step, in forward and in backward: ``forward[k]`` and
    ``backward[k]`` are the weights (indices into ``numels``) that the ``k``-th module called owns, in the order
    the modules' forwards and backwards start. Without ``backward``, the modules' backwards are taken as their
    forwards in reverse. On one rank the partition is the weight: nothing is gathered, and only ``offload_param``
    copies weights in (module docstring). With ``persistent_kept``:
    the first step's second micro-batch, where the persistent weights start released but those given, and are
    fetched like the others and kept (module docstring).

    A module's weights are released after it (its forward or its backward) unless the coordinator keeps them
    (``partitioned_param_coordinator.py``, ``__params_to_release``): a weight used again within
    ``stage3_max_reuse_distance`` elements of the fetches that follow, or one a prefetch already walked past
    (the prefetch skips a gathered weight's later use, so the coordinator keeps it to that use)."""
    backward = [list(reversed(u)) for u in reversed(forward)] if backward is None else backward
    calls = [list(dict.fromkeys(u)) for u in forward + backward]
    if not shape.fetches_weights:
        return Replay([Fetch(0, 0) for _ in forward], [Fetch(0, 0) for _ in backward], Fetch(0, 0))
    world, lp = shape.world_size, shape.lp_bytes
    # offload_param on one rank: no gather and no flat buffer; a weight is copied in whole as its module takes it
    # (an in-flight one is not on the device yet), and on a CPU that copy is the host partition itself
    copies_whole = world == 1
    on_device = not copies_whole or shape.device != "cpu"

    def partitions(batch: list[int]) -> int:  # this rank's partition of each weight, padded
        return lp * sum(-(-numels[i] // world) for i in batch)

    def flat_bytes(batch: list[int]) -> int:  # a coalesced gather's buffer: the partitions from every rank
        return world * partitions(batch) if len(batch) > 1 and not copies_whole else 0

    def copied(batch: list[int]) -> int:  # offload_param on a GPU: the partitions copied in before the gather
        return partitions(batch) if shape.host_params and shape.device != "cpu" and not copies_whole else 0

    released = {i for u in calls for i in u if numels[i] > shape.persistence_threshold}
    uses_at = collections.defaultdict(list)  # a weight: the calls that use it, in order
    reach = [0]  # elements fetched before each call
    for k, use in enumerate(calls):
        for i in use:
            uses_at[i].append(k)
        reach.append(reach[-1] + sum(numels[i] for i in use))

    def reused(i: int, start: int) -> bool:  # used again by a call from ``start`` within the reuse distance
        ahead = [k for k in uses_at[i] if k >= start]
        return bool(ahead) and reach[ahead[0]] - reach[start] < shape.max_reuse_distance

    status = {i: NOT_AVAILABLE for i in released}  # the step before released them all at its end
    if persistent_kept is not None:  # the first micro-batch released the persistent weights but these
        kept = set(persistent_kept)
        status.update((i, NOT_AVAILABLE) for u in calls for i in u if i not in released and i not in kept)
    # the coordinator's trace of the step: each use of a weight with the call it is used at
    queue = collections.deque((k, i) for k, u in enumerate(calls) for i in u)
    fetched_for: dict[int, int] = {}  # a weight: the latest call a popped entry of it was for
    live = 0  # elements the coordinator counts gathered (``__n_available_params``, 0 as a step starts)
    batch_of: dict[int, int] = {}
    batches: dict[int, list] = {}  # id: [bytes, weights not yet taken, copied out yet]
    out: list[Fetch] = []

    def gathered() -> int:
        whole = [i for i, s in status.items() if i in released and (s == AVAILABLE or (s == IN_FLIGHT and (
            i not in batch_of or batches[batch_of[i]][2]) and not copies_whole))]
        return lp * sum(numels[i] for i in whole) if on_device else 0

    for k, use in enumerate(calls):
        own = [i for i in use if status.get(i) == NOT_AVAILABLE]
        for i in own:
            status[i] = AVAILABLE
        live += sum(numels[i] for i in own)
        for i in use:
            if i in batch_of:
                batch = batches[batch_of.pop(i)]
                batch[1] -= 1
                batch[2] = True  # the first wait copies every weight of the fetch out
            if status.get(i) == IN_FLIGHT:
                status[i] = AVAILABLE
        batches = {b: v for b, v in batches.items() if v[1] > 0}
        for _ in [i for i in use if fetched_for.get(i, -1) < k]:  # the call's own entries leave the queue
            if queue:
                at, i = queue.popleft()
                fetched_for[i] = max(fetched_for.get(i, -1), at)
        prefetch, numel = [], 0
        most = min(shape.max_live_parameters - live, shape.prefetch_bucket)
        while shape.prefetch_bucket > 0 and queue and numel < most:
            at, i = queue.popleft()
            fetched_for[i] = max(fetched_for.get(i, -1), at)
            if status.get(i) == NOT_AVAILABLE and i not in prefetch:
                prefetch.append(i)
                numel += numels[i]
        for i in prefetch:
            status[i] = IN_FLIGHT
        live += numel
        if len(prefetch) > 1:
            batches[k] = [flat_bytes(prefetch), len(prefetch), False]
            batch_of.update((i, k) for i in prefetch)
        spike = max(flat_bytes(own) + copied(own), copied(prefetch))
        out.append(Fetch(held=sum(v[0] for v in batches.values()), spike=spike, gathered=gathered(),
                         fetched=partitions(own) + partitions(prefetch)))
        for i in use:  # the call ends: its weights are released unless kept
            if (i in released and status[i] == AVAILABLE and fetched_for.get(i, -1) <= k + 1
                    and not reused(i, k + 1)):
                status[i] = NOT_AVAILABLE
                live -= numels[i]
        if k == len(forward) - 1:
            end = Fetch(held=sum(v[0] for v in batches.values()), spike=0, gathered=gathered())
    if not forward:
        end = Fetch(0, 0)
    return Replay(out[:len(forward)], out[len(forward):], end)


def traced_calls(trace: Any) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]]:
    """The module calls a fake trace recorded (`xirang_ds.memory.trace.Trace`: ``forward_calls``, ``backward_calls``,
    each ``(clock, weights)``), as `replay` takes them: a weight whose module's backward the trace did not see start
    (a head that runs again in backward, one chunk at a time) is taken as used where backward's first module starts,
    so kept gathered to there."""
    backward = trace.backward_calls
    seen = {i for _, use in backward for i in use}
    unseen = list(dict.fromkeys(i for _, use in trace.forward_calls for i in use if i not in seen))
    if backward and unseen:
        backward = [(backward[0][0], unseen), *backward]
    return trace.forward_calls, backward


__all__ = ["Fetch", "Replay", "replay", "traced_calls"]
