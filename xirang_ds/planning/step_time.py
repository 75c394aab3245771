"""A training step's time before the run, from counts a device profile prices (`xirang_ds.memory.device_profile`).

One optimizer step is, one part after the other (no overlap is assumed, so the figure is an upper bound
where DeepSpeed overlaps communication with backward):

* **forward and backward**, ``gradient_accumulation_steps`` times: the fake trace's own ops
  (`xirang_ds.memory.trace.Trace.ops`: every op that launches a kernel, its FLOPs and bytes moved), each priced
  ``max(FLOPs / rate, bytes / bandwidth) + launch``, and DeepSpeed's gradient handling in them (each gradient
  copied into its bucket, the buckets averaged and reduced, the partition's gradients kept: `deepspeed_ops`);
  the trace's backward once more for each backward a plugin's method adds (grad_release's ``two_pass``:
  `xirang_ds.roles.TimesGradients.extra_backwards`, ``counts["extra_backwards"]`` and
  ``counts["repeated_backward"]``);
* **communication**: the bytes ZeRO's collectives move per rank over the profile's interconnect, as a ring
  moves them (``(n - 1) / n`` of the buffer per reduce-scatter or all-gather, twice that per all-reduce):
  ZeRO 0 all-reduces the 16-bit gradients at the boundary, ZeRO 1 reduces them at the boundary and ZeRO 2 in
  every micro-step, both all-gather the updated 16-bit parameters; ZeRO 3 gathers the parameters in forward
  and in backward and reduce-scatters the gradients, every micro-step. Nothing on one rank;
* **the optimizer step**: DeepSpeed's ops at the boundary on the fullest rank's partition, op for op on fake
  tensors (`deepspeed_ops.engine_ops`: the overflow check, the norm in fp64, its checks read on the host, the
  flatten and upcast, the clipping, torch's AdamW or the update of the plugin that runs its own,
  `xirang_ds.roles.TimesUpdate`, the cast back, the all-gather); where that module does not write DeepSpeed's
  path (ZeRO 3, the offloads), one flat partition's (`optimizer_ops`), and the notes say so;
* **DeepSpeed's update on the host** (``offload_optimizer`` to the CPU, part ``host_optimizer``): the host's ops
  (the update, the clipping, at ZeRO 1/2 the cast into the 16-bit staging buffer: `deepspeed_ops.host_optimizer_ops`;
  at ZeRO 3 sub-group by sub-group beside the flat stand-in of the device's work) priced
  by the host's profile (`xirang_ds.memory.device_profile.host_profile`), and the gradients' and parameters' bytes
  over the host link each way (DeepSpeed copies on the device's stream: in the step's way, not beside it);
* **the parameters' copies** (``offload_param`` to the CPU at ZeRO 3, part ``param_copies``): each fetch's
  partitions copied in from the host before its all-gather, every micro-step, and the updated 16-bit partition
  back where the optimizer is on the device, over the host link, in the step's way (a blocking copy before each
  gather): `param_copies_bytes`, ``counts["param_copies_bytes"]``;
* **what the block adds**: each enabled plugin's own seconds per step (`xirang_ds.roles.TimesStep`); one
  that does not price itself is named in the notes as not modelled. A plugin that reduces and steps the
  gradients in place of DeepSpeed's path (`xirang_ds.roles.TimesGradients`: grad_release) counts its own ops
  there instead of DeepSpeed's, its update included unless another plugin prices that.

Work a plugin runs beside the compute stream (`xirang_ds.roles.CopiesBeside`: grad_release's states fetched
ahead and its stashed gradient shards, on a side stream) is not one of the parts: the step is the larger of the
parts' sum and the host link's time a step (``counts["beside_compute_s"]``: those copies, which run on the copy
engine while the compute stream works, and the compute stream's own, since the link carries one at a time).
``counts["kernels"]`` and ``counts["host_syncs"]`` are what the counted ops launch and read on the host per
step (forward and backward, DeepSpeed's, the update), comparable with ``xirang-ds bench``'s counts of plain
DeepSpeed; a plugin's own seconds (`xirang_ds.roles.TimesStep`) are not in them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from xirang_ds.compat.torch import fake_tensor_mode
from xirang_ds.memory.device_profile import DeviceProfile, OpTally, Tallying, host_profile, tallied
from xirang_ds.memory.run_shape import RunShape, fullest_rank, partition_numel
from xirang_ds.memory.zero3_fetch import replay, traced_calls
from xirang_ds.planning.deepspeed_ops import adamw_ops, engine_ops, host_optimizer_ops, not_written
from xirang_ds.roles import CopiesBeside, TimesGradients, TimesStep, TimesUpdate


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step, by part.

    Attributes:
        seconds: the whole step.
        parts: ``forward_backward`` (all micro-steps), ``communication``, ``optimizer`` and one entry per
            plugin that adds time on the compute stream (their sum is ``seconds`` unless work beside it is longer).
        counts: what was priced: launches, FLOPs and bytes of one micro-step's forward and backward and of
            the optimizer step, communication bytes per rank.
        profile: the device profile's name.
        notes: what the figure leaves out.
    """

    seconds: float
    parts: dict[str, float] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)
    profile: str = ""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "parts": dict(self.parts), "counts": dict(self.counts),
                "profile": self.profile, "notes": list(self.notes)}


def optimizer_ops(shape: RunShape, numels: list[int], update: bool = True) -> OpTally:
    """DeepSpeed's optimizer step as one flat partition's, where `deepspeed_ops` does not write its path op for op
    (ZeRO 3, the offloads, ZeRO 0 under DeepSpeed's fused optimizers), counted on fake tensors: the 16-bit gradient
    upcast, the norm and clipping, torch's AdamW, the cast back; one flat partition per parameter group at ZeRO 1-3,
    every parameter at ZeRO 0."""
    if shape.stage == 0:
        sizes = list(numels)
    else:
        rank = fullest_rank(shape, numels)
        groups = shape.groups or (tuple(range(len(numels))),)
        sizes = [partition_numel(sum(numels[i] for i in g), shape.world_size) for g in groups]
        sizes = [s for s in sizes if s] or [max(1, rank.numel)]
    tally = OpTally()
    sixteen = shape.dtype != torch.float32
    with fake_tensor_mode():
        masters = [torch.zeros(n) for n in sizes]
        low = [torch.zeros(n, dtype=shape.dtype) for n in sizes] if sixteen else masters
        with Tallying(tally):
            grads = [g16.float() if sixteen else torch.zeros_like(m) for m, g16 in zip(masters, low)]
            if shape.clipping:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                scale = torch.clamp(shape.clipping / (norm + 1e-6), max=1.0)
                for g in grads:
                    g.mul_(scale)
        if update:  # torch's AdamW, unless a plugin prices the update itself (`TimesUpdate`)
            adamw_ops(grads, shape, tally)
        if sixteen:
            with Tallying(tally):
                for m, p16 in zip(masters, low):
                    p16.copy_(m)
    return tally


def communication_bytes(shape: RunShape, total: int) -> int:
    """Bytes one rank sends per optimizer step in ZeRO's collectives (module docstring)."""
    n, lp, accum = shape.world_size, shape.lp_bytes, shape.grad_accum
    if n == 1:
        return 0
    ring = (n - 1) / n * lp * total  # one reduce-scatter or all-gather of the 16-bit model
    if shape.stage == 0:
        return int(2 * ring)
    if shape.stage == 1:
        return int(2 * ring)
    if shape.stage == 2:
        return int(accum * ring + ring)
    return int(3 * accum * ring)


def param_copies_bytes(shape: RunShape, trace: Any) -> Optional[int]:
    """``offload_param`` (`RunShape.host_params`): the bytes over the host link a step, ``None`` where it is not on or
    the trace recorded no module calls. Each micro-step every fetch copies this rank's partitions of the weights it
    gathers in from the host (`xirang_ds.memory.zero3_fetch.replay`, forward and backward, at a steady step); at the
    update the 16-bit partition comes back from the device where the optimizer is there (host to host where it is
    offloaded too)."""
    if not shape.host_params or not getattr(trace, "forward_calls", None):
        return None
    numels = trace.param_numels
    forward, backward = traced_calls(trace)
    steps = replay(shape, numels, [use for _, use in forward], [use for _, use in backward] or None)
    fetched = sum(f.fetched for f in steps.forward + steps.backward)
    back = 0 if shape.host_optimizer else shape.lp_bytes * partition_numel(sum(numels), shape.world_size)
    return shape.grad_accum * fetched + back


def step_time(shape: RunShape, trace: Any, profile: DeviceProfile, session: Any = None) -> Optional[StepTime]:
    """The predicted step (module docstring); ``None`` where the trace counted no ops."""
    ops = getattr(trace, "ops", None)
    if ops is None:
        return None
    numels = trace.param_numels
    total = sum(numels)
    plugins = list(session.plugins if session is not None else ())
    updates = [(p, p.update_ops(shape, numels, profile)) for p in plugins if isinstance(p, TimesUpdate)]
    update = next((ops for _, ops in updates if ops is not None), None)
    notes = []
    priced = {p.section for p, ops in updates if ops is not None}
    handler = next((p for p in plugins if isinstance(p, TimesGradients)), None)  # in place of DeepSpeed's path
    engine = handler.gradient_ops(shape, numels, profile) if handler is not None else None
    if engine is not None:
        update = None  # its own optimizer steps are in its ops
    elif handler is not None:
        notes.append(f"{handler.section}: its own gradient handling is priced as DeepSpeed's, which it replaces")
    engine = engine or engine_ops(shape, numels, update=update is None)
    offload = host_optimizer_ops(shape, numels, update=update is None) if handler is None else None
    if engine is None:  # one flat partition's ops stand in; the update is the host's where it is offloaded
        backward, opt = OpTally(), optimizer_ops(shape, numels, update=update is None and offload is None)
        notes.append(f"DeepSpeed's own work around the update ({not_written(shape)}) is priced as one flat "
                     "partition's, not op by op")
    else:
        backward, opt = engine
    again = handler.extra_backwards(shape) if handler is not None else 0  # the model's backward run once more
    repeated = getattr(trace, "backward_ops", None)
    if repeated is None:
        if again:
            notes.append(f"{handler.section}: its {again} more backward(s) a step are not priced")
        again, repeated = 0, OpTally()
    comm = communication_bytes(shape, total)
    parts = {"forward_backward": shape.grad_accum * ops.seconds(profile) + backward.seconds(profile)
             + again * repeated.seconds(profile),
             "communication": comm / profile.interconnect_bytes_per_s if comm else 0.0,
             "optimizer": opt.seconds(profile) + (update.seconds(profile) if update is not None else 0.0)}
    if offload is not None:  # offload_optimizer: the host's ops and the link's copies, on the step's way
        host = host_profile(profile)
        link = (offload.to_host_bytes + offload.to_device_bytes) / profile.host_link_bytes_per_s
        parts["host_optimizer"] = offload.host.seconds(host) + link
    unpriced = list(shape.unmodelled_offloads)
    copied = param_copies_bytes(shape, trace)
    if copied is not None:  # offload_param: each fetch's partitions copied in, then the updated ones back
        parts["param_copies"] = copied / profile.host_link_bytes_per_s
    elif shape.host_params:
        unpriced.append("offload_param")
    if unpriced:
        notes.append("DeepSpeed's host offload is not priced: " + ", ".join(unpriced))
    for plugin in plugins:
        seconds = plugin.step_seconds(shape, numels, profile) if isinstance(plugin, TimesStep) else None
        if seconds is None:
            if not getattr(plugin, "time_neutral", False) and plugin.section not in priced:
                notes.append(f"{plugin.section}: its time is not priced")
        elif seconds:
            parts[plugin.section] = seconds
    counted = [ops] * shape.grad_accum + [repeated] * again + [backward, opt] + ([update] if update is not None else [])
    counts = {"forward_backward": ops.as_dict(), "engine_backward": backward.as_dict(), "optimizer": opt.as_dict(),
              "communication_bytes": comm, "micro_steps": shape.grad_accum, "extra_backwards": again,
              "kernels": sum(t.launches for t in counted), "host_syncs": sum(t.host_syncs for t in counted)}
    if again:
        counts["repeated_backward"] = repeated.as_dict()  # priced ``extra_backwards`` times
    if update is not None:
        counts["optimizer_update"] = update.as_dict()  # beside DeepSpeed's ops around it, under "optimizer"
    if offload is not None:
        counts["host_optimizer"] = {**offload.host.as_dict(), "to_host_bytes": offload.to_host_bytes,
                                    "to_device_bytes": offload.to_device_bytes, "host_profile": host.name}
    if copied is not None:
        counts["param_copies_bytes"] = copied
    beside = sum(p.beside_seconds(shape, numels, profile) for p in plugins if isinstance(p, CopiesBeside))
    if beside:
        counts["beside_compute_s"] = beside
    return StepTime(max(sum(parts.values()), beside), parts, counts, profile.name, notes)


__all__ = ["StepTime", "communication_bytes", "optimizer_ops", "param_copies_bytes", "step_time", "tallied"]
