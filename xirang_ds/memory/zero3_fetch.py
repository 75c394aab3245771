"""ZeRO 3's weight fetches in forward, as DeepSpeed's parameter coordinator makes them at a steady step.

From the second step on, the coordinator knows the step's order of modules (its trace) and, at each module's
forward, fetches the module's weights that are not gathered, then prefetches the next weights of the trace, up
to ``stage3_prefetch_bucket_size`` elements, in one all-gather (``partitioned_param_coordinator.py``,
``_fetch_sub_module_impl``). A fetch of two or more weights gathers them into one flat buffer and copies each
weight out of it (``partition_parameters.py``, ``_all_gather_dtype`` and ``AllGatherCoalescedHandle.wait``,
``torch.cat``); the buffer lives until the module that uses the fetch's last weight takes it from the in-flight
registry. A fetch of one weight gathers into the weight itself. So at DeepSpeed's defaults (a 5e7-element bucket)
a model under 5e7 elements has every weight after its first module's in one buffer, alive from the first module
to the last weight's module, late in forward: 5,767,168 bytes on gpt-small, beside the weights copied out.

`forward_fetches` replays that over the modules the trace saw in forward (`xirang_ds.memory.trace`): the buffers
alive after each module's fetch, and the module's own coalesced fetch, alive only while its weights are copied
out. The estimate sets them beside forward's own bytes at each module (`xirang_ds.memory.sweep.most_beside`).
Left out: ``stage3_max_live_parameters`` (DeepSpeed's default 1e9 does not bind below 1e9 elements) and the
fetches of backward (weights released in forward and gathered again).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from xirang_ds.memory.run_shape import RunShape

NOT_AVAILABLE, IN_FLIGHT, AVAILABLE = "not_available", "in_flight", "available"


@dataclass(frozen=True)
class Fetch:
    """What one module's forward fetch leaves.

    Attributes:
        held: bytes of the flat buffers alive after it (prefetched weights not all taken yet).
        spike: bytes of its own coalesced fetch's buffer, alive while its weights are copied out (0 when the
            module fetched fewer than two weights).
    """

    held: int
    spike: int


def kept_in_forward(shape: RunShape, order: list[int], numels: list[int]) -> set[int]:
    """The partitioned weights (indices, in forward ``order``) that stay gathered from their forward to their
    backward: the coordinator keeps a weight whose next use comes within ``stage3_max_reuse_distance`` elements of
    fetches, about twice the weights after it in forward (`xirang_ds.memory.model_states.stage3_working_set`)."""
    kept, after = set(), 0
    for i in reversed(order):
        if 2 * after < shape.max_reuse_distance:
            kept.add(i)
        after += numels[i]
    return kept


def forward_fetches(shape: RunShape, numels: list[int], uses: list[list[int]]) -> list[Fetch]:
    """Per module in forward's order (``uses[k]``: the weights, as indices into ``numels``, that the ``k``-th
    module called owns), what its fetch leaves at a steady step; no buffers below ZeRO 3 or on one rank."""
    if shape.stage != 3 or shape.world_size == 1:
        return [Fetch(0, 0) for _ in uses]
    world, lp = shape.world_size, shape.lp_bytes

    def flat_bytes(batch: list[int]) -> int:  # each weight's partition, padded, from every rank
        return lp * world * sum(-(-numels[i] // world) for i in batch) if len(batch) > 1 else 0

    released = {i for u in uses for i in u if numels[i] > shape.persistence_threshold}
    order = list(dict.fromkeys(i for u in uses for i in u if i in released))
    kept = kept_in_forward(shape, order, numels)
    status = {i: NOT_AVAILABLE for i in released}  # the step before released them all at its end
    queue = collections.deque([i for u in uses for i in u] + [i for u in reversed(uses) for i in u])
    taken_from_queue: set[int] = set()
    batch_of: dict[int, int] = {}
    batches: dict[int, list[int]] = {}  # id: [bytes, weights not yet taken]
    out = []
    for k, use in enumerate(uses):
        use = list(dict.fromkeys(use))
        own = [i for i in use if status.get(i) == NOT_AVAILABLE]
        for i in own:
            status[i] = AVAILABLE
        for i in use:
            if i in batch_of:
                batch = batches[batch_of.pop(i)]
                batch[1] -= 1
            if status.get(i) == IN_FLIGHT:
                status[i] = AVAILABLE
        batches = {b: v for b, v in batches.items() if v[1] > 0}
        for _ in [i for i in use if i not in taken_from_queue]:  # the module's own entries leave the queue
            if queue:
                taken_from_queue.add(queue.popleft())
        prefetch, numel = [], 0
        while shape.prefetch_bucket > 0 and queue and numel < shape.prefetch_bucket:
            i = queue.popleft()
            taken_from_queue.add(i)
            if status.get(i) == NOT_AVAILABLE and i not in prefetch:
                prefetch.append(i)
                numel += numels[i]
        for i in prefetch:
            status[i] = IN_FLIGHT
        if len(prefetch) > 1:
            batches[k] = [flat_bytes(prefetch), len(prefetch)]
            batch_of.update((i, k) for i in prefetch)
        out.append(Fetch(held=sum(v[0] for v in batches.values()), spike=flat_bytes(own)))
        for i in use:  # the module's forward ends: what is not kept is released
            if i in released and i not in kept and status[i] == AVAILABLE:
                status[i] = NOT_AVAILABLE
    return out


__all__ = ["Fetch", "forward_fetches", "kept_in_forward"]
