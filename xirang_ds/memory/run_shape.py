"""What the estimate reads from a ds_config, and how ZeRO 1/2 splits the parameters over the ranks.

A module of its own because both halves of the estimate read it: the fake trace
(`xirang_ds.memory.trace`) emulates ZeRO 2's gradient partition of the fullest rank, and the analytic
model states (`xirang_ds.memory.model_states`) size the flat buffers and partitions by it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DEFAULT_REDUCE_BUCKET = int(5e8)
DEFAULT_ALLGATHER_BUCKET = int(5e8)
DEFAULT_PREFETCH_BUCKET = int(5e7)
DEFAULT_PERSISTENCE_THRESHOLD = int(1e5)
DEFAULT_MAX_REUSE_DISTANCE = int(1e9)
DEFAULT_MAX_LIVE_PARAMETERS = int(1e9)
DEFAULT_SUB_GROUP_SIZE = int(1e9)
DEFAULT_GRADIENT_CLIPPING = 1.0
"""DeepSpeed's ``GRADIENT_CLIPPING_DEFAULT`` (runtime/constants.py)."""
SUB_GROUPS = 8
"""Where the user set no ``zero_optimization.sub_group_size``, optimizer_states, when it parks masters,
makes ZeRO-3's sub-groups about 1/8 of this rank's partition (at least 2**16 elements; a parameter's
partition larger than that is a sub-group of its own): DeepSpeed's step upcasts a sub-group's
gradient to fp32 and runs the basic optimizer on it one sub-group at a time, so its transients (and
a parked master rebuilt for its update) are one sub-group's, not the partition's (DeepSpeed's 1e9
makes the whole partition of most models one sub-group). The split changes no number: Adam is
elementwise and the clipping norm is taken before the loop. Only a run whose optimizer state xirang
owns sets it: DeepSpeed's own load refuses a checkpoint cut into other sub-groups, and
optimizer_states takes such a checkpoint over where plain DeepSpeed cannot."""


def partition_numel(total: int, world_size: int) -> int:
    """One rank's share of ``total`` elements in ZeRO's flat buffers (padded to 2 x ranks)."""
    n = max(world_size, 1)
    return int(math.ceil(total / (2 * n)) * 2 * n) // n


def sub_group_size(trainable: int, world: int) -> int:
    """The ``sub_group_size`` set where the user set none (`SUB_GROUPS`)."""
    return max(-(-trainable // (SUB_GROUPS * max(world, 1))), 1 << 16)


def sub_group_numels(numels: list[int], groups: Optional[tuple], world: int, size: int) -> list[int]:
    """ZeRO-3's sub-groups as DeepSpeed makes them (stage3.py ``_create_fp16_sub_groups``): per param
    group, each parameter's partition (``ceil(numel / world)``) added until the sum reaches ``size``
    or the group ends."""
    sizes = []
    for group in groups or (tuple(range(len(numels))),):
        acc = 0
        for k, i in enumerate(group):
            acc += -(-numels[i] // max(world, 1))
            if acc >= size or k == len(group) - 1:
                sizes.append(acc)
                acc = 0
    return sizes


def _optimizer_offload(zero: dict) -> str:
    """`RunShape.optimizer_offload` from ``zero_optimization``."""
    section = zero.get("offload_optimizer") or {}
    device = str(section.get("device", "none"))
    ratio = _number(section.get("ratio", 1.0), 1.0)
    return "partial" if device != "none" and ratio < 1.0 else device


class EstimateError(ValueError):
    """The ds_config or model cannot be estimated (the message says why)."""


def _number(value: Any, default: float) -> float:
    """A ds_config number, or ``default`` where it is not one yet (HF's ``"auto"``)."""
    try:
        return float(value or 0.0)
    except (TypeError, ValueError):
        return default


@dataclass(frozen=True)
class RunShape:
    """What the estimate needs from a ds_config, with DeepSpeed's defaults applied."""

    micro_batch: int
    grad_accum: int
    world_size: int
    stage: int
    dtype: torch.dtype
    reduce_bucket: int
    allgather_bucket: int
    overlap_comm: bool
    contiguous_gradients: bool
    prefetch_bucket: int
    persistence_threshold: int
    max_reuse_distance: int
    sub_group_size: int
    offloaded: tuple[str, ...]  # the zero_optimization offload sections with a device other than none
    optimizer: str
    adam_impl: str  # "single_tensor" | "foreach" | "fused"
    device: str
    shared_masters: bool = False  # ZeRO 1/2's fp32 partition is a view of fp32 parameters, not a copy
    clipping: float = 0.0
    """``gradient_clipping`` (DeepSpeed's default 1.0); 0: no norm is taken."""
    optimizer_offload: str = "none"
    """``zero_optimization.offload_optimizer.device`` (``cpu``, ``nvme`` or ``none``), ``partial`` where its ``ratio``
    keeps part of the states on the device."""
    param_offload: str = "none"
    """``zero_optimization.offload_param.device`` (``cpu``, ``nvme`` or ``none``)."""
    max_live_parameters: int = DEFAULT_MAX_LIVE_PARAMETERS
    """``stage3_max_live_parameters``: ZeRO 3 prefetches while fewer elements than this are gathered."""
    groups: Optional[tuple[tuple[int, ...], ...]] = None
    """DeepSpeed's parameter groups as indices into the trainable parameters, when a plugin splits them
    (optimizer_states keeps fp32 states in groups of their own); ZeRO 1/2 flattens and partitions each
    group on its own. ``None``: one group."""

    @classmethod
    def from_ds_config(cls, ds: dict, world_size: int = 1, device: str = "cpu") -> "RunShape":
        gas = int(ds.get("gradient_accumulation_steps", 1) or 1)
        micro = ds.get("train_micro_batch_size_per_gpu")
        if micro in (None, "auto"):
            total = ds.get("train_batch_size")
            if total in (None, "auto"):
                raise EstimateError("ds_config sets neither train_micro_batch_size_per_gpu nor train_batch_size")
            micro = int(total) // (gas * world_size)
        zero = ds.get("zero_optimization", {}) or {}
        stage = int(zero.get("stage", 0))
        if ds.get("bf16", {}).get("enabled") in (True, "true"):
            dtype = torch.bfloat16
        elif ds.get("fp16", {}).get("enabled") in (True, "true"):
            dtype = torch.float16
        else:
            dtype = torch.float32
        opt = ds.get("optimizer", {}) or {}
        params = opt.get("params", {}) or {}
        name = str(opt.get("type", "AdamW"))
        if params.get("torch_adam"):
            impl = "foreach" if device == "cuda" else "single_tensor"
        else:
            impl = "fused"  # DeepSpeed's FusedAdam (GPU) / CPUAdam: no step temporaries
        return cls(micro_batch=int(micro), grad_accum=gas, world_size=world_size, stage=stage, dtype=dtype,
                   reduce_bucket=int(float(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET))),
                   allgather_bucket=int(float(zero.get("allgather_bucket_size", DEFAULT_ALLGATHER_BUCKET))),
                   overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
                   contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
                   prefetch_bucket=int(float(zero.get("stage3_prefetch_bucket_size", DEFAULT_PREFETCH_BUCKET))),
                   persistence_threshold=int(float(zero.get("stage3_param_persistence_threshold",
                                                            DEFAULT_PERSISTENCE_THRESHOLD))),
                   max_reuse_distance=int(float(zero.get("stage3_max_reuse_distance", DEFAULT_MAX_REUSE_DISTANCE))),
                   max_live_parameters=int(float(zero.get("stage3_max_live_parameters", DEFAULT_MAX_LIVE_PARAMETERS))),
                   sub_group_size=int(float(zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))),
                   offloaded=tuple(k for k in ("offload_optimizer", "offload_param")
                                   if str((zero.get(k) or {}).get("device", "none")) != "none"),
                   optimizer=name, adam_impl=impl, device=device, optimizer_offload=_optimizer_offload(zero),
                   param_offload=str((zero.get("offload_param") or {}).get("device", "none")),
                   clipping=_number(ds.get("gradient_clipping", DEFAULT_GRADIENT_CLIPPING), DEFAULT_GRADIENT_CLIPPING))

    @property
    def lp_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def host_optimizer(self) -> bool:
        """``offload_optimizer`` to the CPU, whole: the fp32 partition, its gradient and the optimizer states in host
        memory, the update on the host (stage_1_and_2.py ``cpu_offload``; stage3.py ``offload_optimizer``, where the
        parameters stay on the device); modelled by the estimate."""
        modelled_params = self.stage < 3 or "offload_param" not in self.offloaded or self.host_params
        return self.optimizer_offload == "cpu" and self.stage >= 1 and modelled_params

    @property
    def host_params(self) -> bool:
        """``offload_param`` to the CPU at ZeRO 3: every 16-bit partition, the persistent weights' too, in one flat
        host buffer per parameter group (stage3.py ``_create_param_groups_fp16_flat_cpu_memory``), each copied to the
        device as a fetch gathers it (partition_parameters.py ``_all_gather_dtype``; on one rank, where nothing is
        gathered, the whole weight is copied in as its module takes it, ``NoGatherCoalescedHandle``); modelled by the
        estimate."""
        return self.stage == 3 and self.param_offload == "cpu"

    @property
    def fetches_weights(self) -> bool:
        """ZeRO 3 brings weights onto the device as their modules run: gathered on several ranks, copied in from the
        host under ``offload_param`` on one (`xirang_ds.memory.zero3_fetch`)."""
        return self.stage == 3 and (self.world_size > 1 or self.host_params)

    @property
    def unmodelled_offloads(self) -> tuple[str, ...]:
        """The offload sections the estimate does not model (NVMe, a partial ``ratio``)."""
        return tuple(k for k in self.offloaded if not (k == "offload_optimizer" and self.host_optimizer)
                     and not (k == "offload_param" and self.host_params))


@dataclass(frozen=True)
class _Partition:
    numel: int
    params: tuple[int, ...]
    by_group: tuple[int, ...] = ()  # the numel it keeps whole in each group
    rank: int = 0


def partition_pieces(shape: RunShape, numels: list[int], rank: int) -> list[list[tuple[int, int]]]:
    """Per parameter group, ``(parameter, its elements in the partition)`` of each gradient piece in ``rank``'s
    ZeRO 1/2 partition: each group's flat 16-bit buffer split evenly in parameter order (``averaged_gradients``:
    a parameter that crosses the partition's edge is cut there)."""
    out = []
    for group in shape.groups or (tuple(range(len(numels))),):
        part = partition_numel(sum(numels[i] for i in group), shape.world_size)
        lo, hi, start, mine = rank * part, (rank + 1) * part, 0, []
        for i in group:
            first, last = max(start, lo), min(start + numels[i], hi)
            if first < last:
                mine.append((i, last - first))
            start += numels[i]
        out.append(mine)
    return out


def fullest_rank(shape: RunShape, numels: list[int]) -> _Partition:
    """The rank whose ZeRO 1/2 gradient partition is largest: a rank keeps the gradients of every parameter that
    reaches into its range whole (stage_1_and_2.py ``params_in_partition``; ``grads_in_partition`` is their sum),
    in every group (`partition_pieces`); the first such rank."""
    best = _Partition(0, (), (0,) * len(shape.groups or ((),)))
    for r in range(max(shape.world_size, 1)):
        groups = partition_pieces(shape, numels, r)
        sizes = tuple(sum(numels[i] for i, _ in group) for group in groups)
        if sum(sizes) > best.numel:
            best = _Partition(sum(sizes), tuple(i for group in groups for i, _ in group), sizes, r)
    return best

