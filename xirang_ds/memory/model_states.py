"""The analytic half of the estimate: model states, the optimizer step and ZeRO 3's gathered working set.

By ZeRO stage and dtype, following DeepSpeed's buffers (flat 16-bit parameters, fp32 partitions, states
over the partition, fp32 gradient partitions at the step) and the optimizer implementation's temporaries
(torch's single-tensor Adam on CPU, foreach on CUDA, none for fused kernels). Each term is a dict of bytes
by category (`category_bytes`, `add_categories`), the form the phases of `xirang_ds.planning.estimator` are summed in.
"""
from __future__ import annotations

from typing import Optional

import torch

from xirang_ds.memory.categories import CATEGORIES
from xirang_ds.memory.run_shape import RunShape, fullest_rank, partition_numel, sub_group_numels


STEP_PREPARE = "step_prepare"
"""The part of ``engine.step()`` before the basic optimizer's update, a phase of its own while
plugins adjust the estimate (`xirang_ds.roles.Estimates`), then merged into ``optimizer_step``."""
BACKWARD_START = "backward_start"
"""Backward until its first gradient is ready (`Trace.backward_start_by_category`), a phase of its
own while plugins adjust the estimate, then merged into ``backward``: the larger is backward's peak."""
BACKWARD_END = "backward_end"
"""The end of backward, after the activations are freed, where a plugin that steps during backward
(grad_release) holds its buckets and the update's temporaries: a phase of its own while plugins adjust
the estimate, so a later plugin (the activation planner) sees it apart from the mid-backward point that
still holds activations, then merged into ``backward``."""


def category_bytes(**parts: int) -> dict[str, int]:
    out = {c: 0 for c in CATEGORIES}
    for k, v in parts.items():
        out[k] += int(v)
    return out


def add_categories(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {c: a.get(c, 0) + b.get(c, 0) for c in CATEGORIES}


def model_states(shape: RunShape, numels: list[int]) -> dict[str, int]:
    """Resident bytes between steps: parameters (16-bit and fp32 master) and optimizer states.

    With ``offload_optimizer`` (`RunShape.host_optimizer`) ZeRO 1/2 (stage_1_and_2.py ``cpu_offload``) keeps on the
    device the 16-bit parameters and a staging buffer of the largest parameter's 16-bit gradient
    (``temp_grad_buffer_for_gpu_offload``), ZeRO 3 its 16-bit partition; the rest is in host memory
    (`offloaded_optimizer_host`)."""
    total = sum(numels)
    lp = shape.lp_bytes
    part = partition_numel(total, shape.world_size)
    padded = part * shape.world_size
    groups = 1
    on_device = 0 if shape.host_params else lp * part  # offload_param: the 16-bit partition in host memory
    if shape.host_optimizer and shape.stage == 3:
        return category_bytes(parameters=on_device)
    if shape.host_optimizer:
        return category_bytes(parameters=lp * padded, gradients=lp * max(numels))
    if shape.stage == 0:
        master = 4 * total if shape.dtype != torch.float32 else 0
        return category_bytes(parameters=lp * total + master, optimizer_states=8 * total + 4 * len(numels))
    if shape.stage in (1, 2):
        master = 0 if shape.shared_masters else 4 * part
        return category_bytes(parameters=lp * padded + master, optimizer_states=8 * part + 4 * groups)
    # ZeRO 3: 16-bit partition, fp32 partition, states over the partition
    return category_bytes(parameters=on_device + 4 * part, optimizer_states=8 * part + 4 * groups)


def offloaded_optimizer_host(shape: RunShape, numels: list[int]) -> tuple[int, int]:
    """``(between updates, at the update)``: the host memory DeepSpeed's ``offload_optimizer`` holds
    (`RunShape.host_optimizer`; ``(0, 0)`` otherwise): the fp32 partition, its fp32 gradient and the states; at ZeRO
    1/2 besides, the 16-bit partition staged for the copy back, a host staging buffer of the largest gradient and,
    under accumulation, the 16-bit gradients of the partition's parameters carried between micro-steps (whole); at
    the update, its temporaries. Not a host tier of the block's: ``host_memory_budget`` does not cap it."""
    if not shape.host_optimizer:
        return 0, 0
    lp, part = shape.lp_bytes, partition_numel(sum(numels), shape.world_size)
    if shape.stage == 3:  # stage3.py: each sub-group's fp32 partition and gradient, the states
        sub = max(sub_group_numels(numels, shape.groups, shape.world_size, shape.sub_group_size))
        return 16 * part + 4, 16 * part + 4 + adam_temporaries(shape, [sub])
    carried = lp * sum(numels[i] for i in fullest_rank(shape, numels).params) if shape.grad_accum > 1 else 0
    resident = (4 + 4 + 8 + lp) * part + 4 + lp * max(numels) + carried
    return resident, resident + adam_temporaries(shape, [part])


def offloaded_params_host(shape: RunShape, numels: list[int]) -> int:
    """The host memory DeepSpeed's ``offload_param`` holds (`RunShape.host_params`; 0 otherwise): the 16-bit
    partition, every parameter's, in flat host buffers (stage3.py ``param_groups_fp16_flat_cpu_memory``). Not a host
    tier of the block's: ``host_memory_budget`` does not cap it."""
    return shape.lp_bytes * partition_numel(sum(numels), shape.world_size) if shape.host_params else 0


def adam_temporaries(shape: RunShape, tensors: list[int]) -> int:
    """Peak temporaries of one Adam step over tensors of these numels (fp32)."""
    if shape.adam_impl == "fused" or not tensors:
        return 0
    if shape.adam_impl == "foreach":
        return 4 * sum(tensors)  # _foreach_sqrt of every exp_avg_sq, then in-place ops
    return 2 * 4 * max(tensors)  # sqrt() and its quotient, one tensor at a time


def optimizer_step(shape: RunShape, states: dict, numels: list[int]) -> tuple[dict, Optional[dict]]:
    """``engine.step()`` at the boundary: the wrapper's preparation of the gradients (``None`` where
    it allocates nothing), then the basic optimizer's update.

    ZeRO 1-3 (stage_1_and_2.py / stage3.py ``step``): the reduced 16-bit gradient partition is
    flattened into a copy, the copy upcast to the fp32 gradient of the master partition, then the
    16-bit gradients are freed before the update; ZeRO 3 does this one sub-group at a time
    (``_prepare_sub_group``, then the update, then ``_release_sub_group`` drops the fp32 gradient),
    keeping the 16-bit partition. With ``offload_optimizer`` at ZeRO 1/2 nothing of it is on the device, at ZeRO 3
    the 16-bit gradient partition and the bucket.
    ZeRO 0 in 16 bits with DeepSpeed's fused Adam
    (``FP16_Optimizer``): every gradient upcast one by one, then flattened into one fp32 gradient.
    ZeRO 0 with torch's Adam (``FP16_UnfusedOptimizer``) upcasts into each master's ``.grad``.
    """
    total = sum(numels)
    lp = shape.lp_bytes
    part = partition_numel(total, shape.world_size)
    sixteen = shape.dtype != torch.float32
    if shape.host_optimizer and shape.stage == 3:
        # the 16-bit gradient partition and the bucket stay; on a GPU each sub-group's update comes back to its 16-bit
        # partition through an fp32 copy on the device (a copy across devices that casts makes one)
        resident = add_categories(states, category_bytes(gradients=lp * part, comm_buffers=lp * shape.reduce_bucket))
        sub = max(sub_group_numels(numels, shape.groups, shape.world_size, shape.sub_group_size))
        cast = 4 * sub if shape.device != "cpu" and not shape.host_params else 0  # offload_param: host to host
        return add_categories(resident, category_bytes(temporaries=cast)), None
    if shape.host_optimizer:  # the gradients are on the host already, the update runs there
        return states, None
    if shape.stage == 0:
        grads = lp * total + (4 * total if sixteen else 0)
        update = add_categories(states, category_bytes(gradients=grads, temporaries=adam_temporaries(shape, numels)))
        prepare = None
        if sixteen and shape.adam_impl == "fused":
            prepare = add_categories(states, category_bytes(gradients=lp * total + 4 * total, temporaries=4 * total))
        return update, prepare
    if shape.stage == 3:  # the 16-bit gradient partition and the reduction bucket stay allocated
        sub = max(sub_group_numels(numels, shape.groups, shape.world_size, shape.sub_group_size))
        resident = add_categories(states, category_bytes(gradients=lp * part, comm_buffers=lp * shape.reduce_bucket))
        prepare = add_categories(resident, category_bytes(gradients=4 * sub if sixteen else 0, temporaries=lp * sub))
        return add_categories(resident, category_bytes(gradients=4 * sub, temporaries=adam_temporaries(shape, [sub]))), prepare
    # group by group: its 16-bit gradients flattened and upcast, then freed before the next group's
    rank = fullest_rank(shape, numels)
    parts = [partition_numel(sum(numels[i] for i in g), shape.world_size)
             for g in (shape.groups or (tuple(range(len(numels))),))]
    points = [category_bytes(gradients=lp * sum(rank.by_group[g:]) + (4 * sum(parts[:g + 1]) if sixteen else 0),
                   temporaries=lp * parts[g]) for g in range(len(parts))]
    prepare = add_categories(states, max(points, key=lambda c: sum(c.values())))
    update = add_categories(states, category_bytes(gradients=4 * part, temporaries=adam_temporaries(shape, [part])))
    return update, prepare


def stage3_fetch_buffer(shape: RunShape, numels: list[int]) -> int:
    """ZeRO 3 on several ranks: the most bytes one coalesced fetch's flat all-gather buffer holds, the weights of one
    fetch (``stage3_prefetch_bucket_size``'s and the module's in use, at most every partitioned weight). DeepSpeed
    copies each weight out of it (partition_parameters.py ``AllGatherCoalescedHandle.wait``, ``torch.cat``) and the
    buffer lives beside the copies until the fetch's last weight is taken, late in forward where the bucket covers
    the model (gpt-small at DeepSpeed's defaults: 5,767,168 bytes, measured). The phases count the buffers where the
    trace recorded forward's modules (`xirang_ds.memory.zero3_fetch`); where it did not (a model that does not run
    on fake tensors), the estimate names this bound instead (0 on one rank or below ZeRO 3)."""
    if shape.stage != 3 or shape.world_size == 1:
        return 0
    released = [x for x in numels if x > shape.persistence_threshold]
    if not released:
        return 0
    return shape.lp_bytes * min(sum(released), max(shape.prefetch_bucket, max(released)) + max(released))


def stage3_working_set(shape: RunShape, numels: list[int], fwd: dict, bwd: dict,
                       replayed: bool = False) -> tuple[dict, dict]:
    """ZeRO 3: parameters live as partitions; the trace counted them whole, gathered. Replace the
    whole 16-bit parameters by the gathered working set and add the persistent reduction buffers.

    The working set at the end of forward, where activations peak, is what the parameter coordinator
    keeps (partitioned_param_coordinator.py ``__params_to_release``, once the trace is complete, from
    the second step): a parameter released after its forward is kept gathered when its next use (in
    backward) comes within ``stage3_max_reuse_distance`` elements of fetches, about twice the
    parameters after it in forward; with DeepSpeed's default (1e9) every model under 5e8
    parameters stays gathered from forward to backward. Beside them: the prefetch bucket and the
    module in use, and the persistent small parameters (``stage3_param_persistence_threshold``).
    On one rank the partition is the whole parameter and nothing is gathered. ``replayed``: the phases hold the
    partitioned weights gathered where the fetches were replayed over the trace (`xirang_ds.memory.zero3_fetch`);
    only the persistent ones are added."""
    lp = shape.lp_bytes
    total = sum(numels)
    persistent = sum(x for x in numels if x <= shape.persistence_threshold)
    released = [x for x in numels if x > shape.persistence_threshold]
    kept, after = 0, 0
    for x in reversed(released):  # parameters in forward order: the last ones are reused soonest
        if 2 * after < shape.max_reuse_distance:
            kept += x
        after += x
    largest = max(numels)
    gathered = min(sum(released), kept + max(shape.prefetch_bucket, largest) + largest) + persistent
    if replayed:
        gathered = persistent
    if shape.world_size == 1 and not (shape.host_params and shape.device != "cpu"):
        gathered = 0  # one rank's partition is the whole parameter: gathering allocates nothing (offload_param on a
        # GPU copies it in: the persistent weights stay there, the others are the replay's)
    extra = category_bytes(parameters=lp * gathered,
                 comm_buffers=lp * shape.reduce_bucket,
                 gradients=lp * partition_numel(total, shape.world_size))
    return add_categories(fwd, extra), add_categories(bwd, extra)
