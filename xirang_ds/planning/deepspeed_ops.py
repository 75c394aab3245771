"""DeepSpeed's own ops in one optimizer step, on fake tensors: what the engine launches around the model's
forward and backward and the optimizer's update, for the predicted step (`xirang_ds.planning.step_time`).

Plain DeepSpeed's step is mostly its own small ops: at gpt-small (ZeRO-2 bf16, 2 ranks, clipping 1.0) 528 of
the 680 kernels of rank 0's step as a GPU runs it (``benchmarks/results/step_counts_presets.json``, "as_gpu"),
a dozen per gradient piece, most of them launch-bound on a GPU, a few of them passes over every gradient
(its ``amax`` and ``amin``, its norm in fp64). Each path below is written after DeepSpeed 0.19's code, op for
op, and counted against the real engine on this CPU (``tests/memory/test_deepspeed_ops.py``):

* **ZeRO 1/2** (``runtime/zero/stage_1_and_2.py``). Every micro-step: the loss divided by the accumulation steps
  and scaled (``engine.backward``, ``scale_loss``); each gradient copied into the reduction bucket as it
  arrives (``reduce_independent_p_g_buckets_and_remove_grads``); each bucket averaged (``average_tensor``),
  flattened, all-reduced and this rank's runs of it copied back (``allreduce_and_copy_with_multiple_ranks``);
  each gradient of this rank's partition copied into the partition (``copy_grads_in_partition``) and, after
  the first micro-step, added to what the ones before kept (``independent_gradient_partition_epilogue``).
  At the boundary: in 16-bit, the overflow check (``has_inf_or_nan`` of every gradient piece of the
  partition, summed, all-reduced and read: a host sync); the norm, one per piece in fp64
  (``get_grad_norm_direct``), combined and checked (``combine_grad_norm_groups``; ``is_invalid_grad_norm``
  reads it, a host sync, twice where clipping); the partition flattened (and upcast), unscaled and clipped
  (``unscale_and_clip_grads``); the update; the cast back into the 16-bit partition; the all-gather.
* **ZeRO 0 in 16-bit under torch's optimizer** (``runtime/fp16/unfused_optimizer.py``, DeepSpeed's
  ``DDP_BFLOAT16``). The engine's all-reduce of the gradients by buckets, copied back one by one; per
  parameter the overflow check read on the host (``has_overflow_serial``: a host sync each), its norm
  (``get_weight_norm``), its upcast, unscaling and cast back.
* **ZeRO 0 in fp32**: the engine's all-reduce, then ``clip_grad_norm_`` where clipping (a norm and a scaling
  per parameter), then torch's optimizer.

* **ZeRO 1/2 under ``offload_optimizer``** (``cpu_offload`` there): the same reduction, then each gradient of the
  partition to the host instead of into a device partition, its norm and overflow check (read on the host, per
  parameter), under accumulation carried on the host between micro-steps; at the boundary the norm's pieces read
  one by one, the update on the host, the 16-bit partition back (`HostOptimizer`: the host's ops and the link's
  bytes, `host_optimizer_ops`).

A collective counts one launch (its bytes are the step's ``communication``), a host read (``.item()``) one
launch and one host sync, as `xirang_ds.step_counts` counts them; a copy between host and device one launch, its
bytes priced over the host link. Not written here: ZeRO 3, ZeRO 0 under DeepSpeed's fused optimizers, NVMe and
parameter offload (`not_written`): there `step_time.optimizer_ops` prices DeepSpeed's work around the update as
one flat partition's (the upcast, the norm and clipping, the cast back) and the notes say so.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from xirang_ds.compat.torch import fake_tensor_mode
from xirang_ds.memory.device_profile import FUSED_ADAM_BYTES, OpTally, Tallying
from xirang_ds.memory.run_shape import RunShape, fullest_rank, partition_numel, partition_pieces, sub_group_numels

ZERO0_ALLREDUCE_NUMEL = 500_000_000
"""The engine's all-reduce bucket at ZeRO 0 (``engine.py`` ``MEMORY_OPT_ALLREDUCE_SIZE``; no config key sets it)."""
NORM_DTYPE = torch.float64
"""DeepSpeed's ``get_norm_dtype()`` on a device with fp64 (CUDA, the CPU): gradient norms accumulate in it."""


def not_written(shape: RunShape) -> Optional[str]:
    """Why DeepSpeed's own work of this run is not written op for op here (module docstring); ``None`` where it is."""
    if shape.unmodelled_offloads:
        return "its host offload" if shape.stage != 3 else "ZeRO 3 and its host offload"
    if shape.stage == 3:
        return "ZeRO 3"
    if shape.stage == 0 and shape.dtype != torch.float32 and shape.adam_impl == "fused":
        return "ZeRO 0 under its fused optimizer"
    return None


def emulated(shape: RunShape) -> bool:
    """DeepSpeed's own work of this run is written op for op here (`not_written`)."""
    return not_written(shape) is None


def _groups(shape: RunShape, numels: list[int]) -> tuple[tuple[int, ...], ...]:
    return shape.groups or (tuple(range(len(numels))),)


def _slices(shape: RunShape, numels: list[int], param: int) -> list[tuple[int, int]]:
    """``(rank, elements)`` of each slice of a parameter's gradient, in order (``average_tensor``'s
    ``partition_ids_w_offsets``)."""
    group = next(g for g in _groups(shape, numels) if param in g)
    part = partition_numel(sum(numels[i] for i in group), shape.world_size)
    start = sum(numels[i] for i in group[:group.index(param)])
    end, out = start + numels[param], []
    while start < end:
        stop = min(end, (start // part + 1) * part)
        out.append((start // part, stop - start))
        start = stop
    return out


def _buckets(numels: list[int], size: int) -> list[list[int]]:
    """Parameters in the order their gradients arrive (the last first), cut into reduction buckets of ``size``."""
    buckets, fill = [[]], 0
    for i in reversed(range(len(numels))):
        if fill + numels[i] > size and fill:
            buckets.append([])
            fill = 0
        buckets[-1].append(i)
        fill += numels[i]
    return [b for b in buckets if b]


def _has_inf_or_nan(g: torch.Tensor) -> torch.Tensor:
    """``runtime/utils.py``'s ``has_inf_or_nan``: the finiteness of the largest and smallest element."""
    return torch.isfinite(g.amax()).logical_and(torch.isfinite(g.amin())).logical_not()


def _invalid(norm: torch.Tensor, tally: OpTally) -> None:
    """``is_invalid_grad_norm``: checked on the device, read on the host."""
    (~torch.isfinite(norm) | (norm < 0)).any()
    tally.host_read()


@dataclasses.dataclass
class HostOptimizer:
    """What ZeRO under ``offload_optimizer`` does beside the device's ops: the host's ops a step (at ZeRO 1/2 the
    norm combined, the clipping, the update, the cast into the 16-bit staging buffer; at ZeRO 3 the clipping and
    the update) and the bytes each way over the host link (the reduced gradients to the host, in fp32 at the
    boundary and at ZeRO 1/2 in 16 bits between micro-steps under accumulation, and back; the updated partition to
    the device, in 16 bits at ZeRO 1/2, in fp32 at ZeRO 3)."""

    host: OpTally = dataclasses.field(default_factory=OpTally)
    to_host_bytes: int = 0
    to_device_bytes: int = 0

    def to_host(self, tally: OpTally, nbytes: int) -> None:
        """One copy from the device to the host: a launch on the device's stream, its bytes over the link."""
        tally.add_counts(0, 0, True)
        self.to_host_bytes += nbytes

    def to_device(self, tally: OpTally, nbytes: int) -> None:
        tally.add_counts(0, 0, True)
        self.to_device_bytes += nbytes


def _offloaded_gradient(shape: RunShape, n: int, piece: int, micro: int, offload: HostOptimizer,
                        tally: OpTally) -> None:
    """``copy_grads_in_partition`` under ``offload_optimizer`` for a parameter of ``n`` elements, ``piece`` of them in
    this rank's partition: under accumulation its whole gradient carried on the host between micro-steps
    (``async_accumulate_grad_in_cpu_via_gpu``); at the boundary its piece's norm in fp64 and its overflow check read on
    the host (``update_offload_overflow_tracker``: a host sync per parameter), the piece upcast and copied to the
    fp32 partition's gradient on the host (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``)."""
    lp = shape.dtype
    grad = torch.empty(n, dtype=lp)
    if shape.grad_accum > 1:
        if micro:
            staged = torch.empty(n, dtype=lp)
            offload.to_device(tally, shape.lp_bytes * n)
            grad.add_(staged)
        offload.to_host(tally, shape.lp_bytes * n)
    if micro == shape.grad_accum - 1:
        torch.linalg.vector_norm(grad[:piece].to(NORM_DTYPE))
        _has_inf_or_nan(grad)
        tally.host_read()
        if lp != torch.float32:
            grad[:piece].float()
        offload.to_host(tally, 4 * piece)


def _combined_norm(group_norms: list[torch.Tensor], tally: OpTally) -> torch.Tensor:
    """``combine_grad_norm_groups`` and ``step()``'s check of its result, read on the host (inside ``Tallying``)."""
    stacked = torch.stack(group_norms)
    invalid = (~torch.isfinite(stacked) | (stacked < 0)).any()
    combined = torch.linalg.vector_norm(stacked)
    norm = torch.where(invalid, torch.full_like(combined, float("inf")), combined)
    _invalid(norm, tally)
    norm / 1.0  # the norm kept for logging, unscaled
    return norm


def _unscale_and_clip(master: torch.Tensor, norm: torch.Tensor, shape: RunShape, tally: OpTally) -> None:
    """``unscale_and_clip_grads`` of one flat fp32 gradient where clipping (inside ``Tallying``)."""
    if shape.clipping:
        _invalid(norm, tally)
        clip = torch.clamp(((norm / 1.0) + 1e-6) / shape.clipping, min=1.0) * 1.0
        master.mul_(1.0 / clip)


def _zero12_backward(shape: RunShape, numels: list[int], rank: int,
                     offload: Optional[HostOptimizer] = None) -> OpTally:
    """Every micro-step's backward at ZeRO 1/2 (module docstring); with ``offload`` (``offload_optimizer``) each
    gradient of the partition goes to the host instead (`_offloaded_gradient`)."""
    lp = shape.dtype
    pieces = {i: n for group in partition_pieces(shape, numels, rank) for i, n in group}
    inside = set(pieces)
    backward = OpTally()
    with Tallying(backward):
        for micro in range(shape.grad_accum):
            (torch.empty(()) / shape.grad_accum) * 1.0  # engine.backward's division, the loss scaler's product
            for bucket in _buckets(numels, shape.reduce_bucket):
                flat = torch.empty(sum(numels[i] for i in bucket), dtype=lp)
                for i in bucket:  # each gradient copied in as it arrives
                    flat[:numels[i]].copy_(torch.empty(numels[i], dtype=lp))
                flat.div_(shape.world_size)  # average_tensor
                runs: list[tuple[int, int]] = []  # the bucket's slices, consecutive ones of one rank merged
                for r, n in (s for i in bucket for s in _slices(shape, numels, i)):
                    if runs and runs[-1][0] == r:
                        runs[-1] = (r, runs[-1][1] + n)
                    else:
                        runs.append((r, n))
                # allreduce_bucket's flatten of the runs (one run is its own flat view), all-reduced
                reduced = torch.cat([flat[:n] for _, n in runs]) if len(runs) > 1 else flat
                backward.collective()
                for r, n in runs:  # this rank's runs of the bucket copied back
                    if r == rank:
                        flat[:n].copy_(reduced[:n])
                for i in bucket:
                    if i in inside and offload is not None:
                        _offloaded_gradient(shape, numels[i], pieces[i], micro, offload, backward)
                    elif i in inside:  # copy_grads_in_partition: the parameter's whole gradient
                        torch.empty(numels[i], dtype=lp).copy_(torch.empty(numels[i], dtype=lp))
            if micro and offload is None:  # the epilogue adds this micro-step's partition gradients to the kept ones
                for i in inside:
                    torch.empty(numels[i], dtype=lp).add_(torch.empty(numels[i], dtype=lp))
    return backward


def _zero12_before(shape: RunShape, numels: list[int], rank: int, tally: OpTally) -> list[torch.Tensor]:
    """The boundary at ZeRO 1/2 up to the update: each group's flat fp32 gradient partition (module docstring)."""
    lp, sixteen = shape.dtype, shape.dtype != torch.float32
    with Tallying(tally):
        groups = [[torch.empty(n, dtype=lp) for _, n in group] for group in partition_pieces(shape, numels, rank)]
        if sixteen:  # check_overflow
            count = torch.zeros(1)
            for g in (g for group in groups for g in group):
                count += _has_inf_or_nan(g)
            count.bool().to(torch.uint8)
            tally.collective()
            tally.host_read()
        group_norms = []
        for grads in groups:  # get_grad_norm_direct
            norms = [torch.linalg.vector_norm(g.to(NORM_DTYPE)) for g in grads]
            total = torch.stack(norms).pow(2).sum().float() if norms else torch.zeros(())
            tally.collective()
            total = total.pow(0.5)
            # mask_nan_or_inf_with_val_inplace
            total.masked_fill_(total.isnan().logical_or(total.isinf()), torch.empty(()))
            group_norms.append(total)
        norm = _combined_norm(group_norms, tally)
        masters = []
        for grads in groups:
            flat = torch.cat(grads) if len(grads) > 1 else grads[0] if grads else torch.empty(0, dtype=lp)  # flattened
            master = flat.float() if sixteen else flat
            _unscale_and_clip(master, norm, shape, tally)
            masters.append(master)
    return masters


def _host_update(shape: RunShape, masters: list[torch.Tensor], host: OpTally) -> None:
    """The offloaded update of ``masters`` on the host: ``DeepSpeedCPUAdam`` one pass each, or with ``torch_adam``
    torch's AdamW, whose host tensors take its single-tensor path."""
    if shape.adam_impl != "fused":
        adamw_ops(masters, dataclasses.replace(shape, adam_impl="single_tensor"), host)
        return
    for master in masters:
        host.add_counts(0, FUSED_ADAM_BYTES * master.numel(), False)


def _offloaded_step(shape: RunShape, numels: list[int], rank: int, update: bool, tally: OpTally,
                    offload: HostOptimizer) -> None:
    """The boundary at ZeRO 1/2 under ``offload_optimizer`` (stage_1_and_2.py ``step`` with ``cpu_offload``): on the
    device, the host's wait for the gradients' copies (a host sync), in 16-bit the overflow flag made a device
    tensor, all-reduced and read (``has_overflow``), every piece's norm read on the host one by one, their sum
    made a device tensor, all-reduced and read (``complete_grad_norm_calculation_for_cpu_offload``), each group's
    16-bit partition copied in from the host, the all-gather; on the host, the norm combined and checked, the
    clipping, the update (``DeepSpeedCPUAdam``, one pass, or torch's AdamW with ``torch_adam``), the cast into
    the 16-bit staging buffer."""
    groups = partition_pieces(shape, numels, rank)
    with Tallying(tally):
        tally.host_syncs += 1  # _wait_for_offload_copies: an event waited on, no launch
        if shape.dtype != torch.float32:
            offload.to_device(tally, 1)
            tally.collective()
            tally.host_read()
        for group in groups:
            for _ in group:
                tally.host_read()
            offload.to_device(tally, 4)
            tally.collective()
            tally.host_read()
    host = offload.host
    with Tallying(host):  # the norm combined on host tensors, the fp32 gradients clipped there
        norm = _combined_norm([torch.empty(()) for _ in groups], host)
        masters = [torch.empty(sum(n for _, n in group)) for group in groups]
        for master in masters:
            _unscale_and_clip(master, norm, shape, host)
    if update:
        _host_update(shape, masters, host)
    with Tallying(host):
        for master in masters:
            torch.empty(master.numel(), dtype=shape.dtype).copy_(master)
    with Tallying(tally):
        for master in masters:
            offload.to_device(tally, shape.lp_bytes * master.numel())
        tally.collective()


def _zero12_after(shape: RunShape, numels: list[int], rank: int, tally: OpTally) -> None:
    """Each group's update cast back into its 16-bit partition, and the all-gather."""
    with Tallying(tally):
        for group in partition_pieces(shape, numels, rank):
            n = sum(n for _, n in group)
            torch.empty(n, dtype=shape.dtype).copy_(torch.empty(n))
        tally.collective()


def _zero0_backward(shape: RunShape, numels: list[int]) -> OpTally:
    """The engine's division of the loss each micro-step and its all-reduce of the gradients at the boundary
    (``buffered_allreduce_fallback``: a bucket flattened, divided, all-reduced and copied back one by one)."""
    backward = OpTally()
    with Tallying(backward):
        for _ in range(shape.grad_accum):
            torch.empty(()) / shape.grad_accum  # engine.backward's division
        for bucket in _buckets(numels, ZERO0_ALLREDUCE_NUMEL):
            flat = torch.cat([torch.empty(numels[i], dtype=shape.dtype) for i in bucket])
            flat.mul_(1.0 / shape.world_size)
            backward.collective()
            for i in bucket:
                torch.empty(numels[i], dtype=shape.dtype).copy_(flat[:numels[i]])
    return backward


def _zero0_before(shape: RunShape, numels: list[int], tally: OpTally) -> list[torch.Tensor]:
    """ZeRO 0 up to the update: the fp32 gradients the optimizer steps with (module docstring)."""
    with Tallying(tally):
        grads = [torch.empty(n, dtype=shape.dtype) for n in numels]
        if shape.dtype != torch.float32:  # FP16_UnfusedOptimizer.step
            for g in grads:  # has_overflow_serial: each parameter's check read on the host
                _has_inf_or_nan(g)
                tally.host_read()
            tally.host_read()  # has_overflow's flag
            total = None
            for g in grads:  # get_weight_norm
                term = g.float().norm().pow(2)
                total = term + 0.0 if total is None else total.add_(term)
            tally.host_read()
            tally.host_read()
            masters = [g.float() for g in grads]
            for m in masters:  # unscale_and_clip_grads, by a scale the host computed
                m.mul_(1.0)
            return masters
        if shape.clipping:  # clip_grad_norm_
            norms = [g.detach().float().norm() for g in grads]
            total = torch.stack(norms).pow(2).sum().float().pow(0.5)
            scaled = total * 1.0 / shape.world_size
            tally.collective()
            coef = torch.min(torch.empty(1), torch.empty(1) / (scaled + 1e-6))  # both made by host copies
            for g in grads:
                g.mul_(coef)
        return grads


def _zero0_after(shape: RunShape, numels: list[int], tally: OpTally) -> None:
    if shape.dtype != torch.float32:
        with Tallying(tally):
            for n in numels:  # the fp32 masters cast back into the 16-bit parameters
                torch.empty(n, dtype=shape.dtype).copy_(torch.empty(n))


def adamw_ops(masters: list[torch.Tensor], shape: RunShape, tally: OpTally) -> None:
    """torch's AdamW over fake fp32 tensors with the gradients ``masters`` (inside the caller's fake mode), counted
    into ``tally``: one step per tensor where DeepSpeed steps each group's flat partition apart (ZeRO 1-3,
    ``_optimizer_step``), one over all at ZeRO 0; a step taken first so that its states exist, as they do in a
    run's counted step. DeepSpeed's fused Adam (one multi-tensor kernel per chunk of tensors) is counted as torch's
    ``foreach``."""
    params = [torch.nn.Parameter(torch.zeros(m.numel())) for m in masters]
    foreach = shape.adam_impl != "single_tensor"
    optimizers = [torch.optim.AdamW(ps, foreach=foreach) for ps in ([[p] for p in params] if shape.stage else [params])]
    for p, m in zip(params, masters):
        p.grad = m.detach()
    for opt in optimizers:
        opt.step()
    with Tallying(tally):
        for opt in optimizers:
            opt.step()


def engine_ops(shape: RunShape, numels: list[int], update: bool = True,
               rank: Optional[int] = None) -> Optional[tuple[OpTally, OpTally]]:
    """``(backward, step)``: DeepSpeed's ops in every micro-step's backward together, and at the boundary with
    torch's AdamW as the update where ``update`` (else a plugin prices the update: `xirang_ds.roles.TimesUpdate`);
    ``rank``'s at ZeRO 1/2 (default: the fullest rank's). ``None`` where the path is not written here
    (`emulated`). The same tallies for the same shape but its micro-batch, which changes no op here (the tuner
    asks for many micro-batches): treat them as read-only."""
    if not emulated(shape):
        return None
    rank = fullest_rank(shape, numels).rank if rank is None else rank
    return _engine_ops(dataclasses.replace(shape, micro_batch=0), tuple(numels), update, rank)[:2]


def host_optimizer_ops(shape: RunShape, numels: list[int], update: bool = True,
                       rank: Optional[int] = None) -> Optional[HostOptimizer]:
    """Under ``offload_optimizer`` (`RunShape.host_optimizer`), the host's ops and the host link's bytes of one
    optimizer step beside the device's ops (`engine_ops` at ZeRO 1/2, the flat stand-in at ZeRO 3); ``None`` for any
    other run. Read-only."""
    if not shape.host_optimizer:
        return None
    if shape.stage == 3:
        return _zero3_host_optimizer(dataclasses.replace(shape, micro_batch=0), tuple(numels), update)
    rank = fullest_rank(shape, numels).rank if rank is None else rank
    return _engine_ops(dataclasses.replace(shape, micro_batch=0), tuple(numels), update, rank)[2]


@functools.lru_cache(maxsize=16)
def _zero3_host_optimizer(shape: RunShape, numels: tuple[int, ...], update: bool) -> HostOptimizer:
    """ZeRO 3's update on the host (stage3.py with ``offload_optimizer``), sub-group by sub-group, beside the flat
    stand-in of its device work (`step_time.optimizer_ops`): each sub-group's gradient in fp32 to the host, clipped
    and stepped there, its fp32 weights back to the device, where they are cast into the 16-bit partition."""
    out = HostOptimizer()
    subs = sub_group_numels(list(numels), shape.groups, shape.world_size, shape.sub_group_size)
    with fake_tensor_mode():
        masters = [torch.empty(n) for n in subs]
        with Tallying(out.host):
            for master in masters:
                if shape.clipping:
                    master.mul_(1.0)
        if update:
            _host_update(shape, masters, out.host)
    out.to_host_bytes = out.to_device_bytes = 4 * sum(subs)
    return out


@functools.lru_cache(maxsize=64)
def _engine_ops(shape: RunShape, numels: tuple[int, ...], update: bool,
                rank: int) -> tuple[OpTally, OpTally, Optional[HostOptimizer]]:
    numels = list(numels)
    step = OpTally()
    with fake_tensor_mode():
        if shape.host_optimizer:
            offload = HostOptimizer()
            backward = _zero12_backward(shape, numels, rank, offload)
            _offloaded_step(shape, numels, rank, update, step, offload)
            return backward, step, offload
        if shape.stage in (1, 2):
            backward = _zero12_backward(shape, numels, rank)
            masters = _zero12_before(shape, numels, rank, step)
        else:
            backward = _zero0_backward(shape, numels)
            masters = _zero0_before(shape, numels, step)
        if update:
            adamw_ops(masters, shape, step)
        if shape.stage in (1, 2):
            _zero12_after(shape, numels, rank, step)
        else:
            _zero0_after(shape, numels, step)
    return backward, step, None


__all__ = ["HostOptimizer", "NORM_DTYPE", "ZERO0_ALLREDUCE_NUMEL", "adamw_ops", "emulated",
           "engine_ops", "host_optimizer_ops", "not_written"]
