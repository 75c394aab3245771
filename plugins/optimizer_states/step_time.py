"""optimizer_states' update priced for the predicted step (`xirang_ds.planning.step_time`, the
`xirang_ds.roles.TimesUpdate` role): its ops counted, the profile prices them.

The tensors are the ones the run updates: one flat partition per parameter group at ZeRO 1-3 (kept fp32 parameters
in a group of their own), each parameter at ZeRO 0, and each parameter's shard of its bucket where an update runs in
backward (grad_release). Each tensor's states are in the format the policy starts from (the kept ones in fp32).
Compiled (``fused: true``, or ``auto`` on a GPU profile) a bf16, int8 or int4 tensor is one kernel reading and
writing the fp32 parameter, reading its gradient (fp32) and reading and writing both moments in their format, and
fp32 states take torch's fused Adam kernel, one op a large tensor and one for the small ones together, beside the
step's value made on the device (`fused.FusedStep.adam_`; priced with ``bias_correction`` on, which the estimate
does not read: off, the run takes the eager chunks); otherwise (the CPU's ``auto``) the eager update runs chunk by
chunk, and one chunk of it is run on fake tensors and counted (`update.adam_chunk_` between the format's decode and
encode, what `optimizer.DynamicAdamW` runs), every chunk priced as a whole one; kept fp32 shards of at most
``chunk_numel`` elements are stepped together on torch's multi-tensor ops, as the run steps them (`together`): one
batch's ops per ``chunk_numel`` elements of them (a multi-tensor op counted as one launch), except under in-place
``masters: none``, whose kept shards are updated one by one. Under grad_release each bucket's optimizer steps its
own shard: grad_release counts its buckets' updates one by one (`group_update_ops`, from its own step run on fake
tensors: `grad_release.step_ops`). Under grad_release's ``masters: none`` in place (bf16 weights, no master) the
compiled kernel also rounds the result stochastically into the weight (`fused.chunk_step`): it reads and writes the
bf16 weight instead of an fp32 parameter, still one kernel, for the kept fp32 shards too (`fused.fuses`), beside the
start index of its noise (an ``arange`` a tensor) and the gradient's scales (stacked once a step). What
grad_release's other masters add (rebuilding a master from remainders, rounding into the weights after the update)
is grad_release's own count (`grad_release.step_ops`).
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Optional

import torch

from xirang_ds.compat.torch import fake_tensor_mode
from xirang_ds.memory.device_profile import FUSED_ADAM_BYTES, OpTally, tallied
from xirang_ds.plugins.optimizer_states.formats import MOMENTS, make_format
from xirang_ds.plugins.optimizer_states.fused import fuses
from xirang_ds.plugins.optimizer_states.together import adam_foreach_, batches
from xirang_ds.plugins.optimizer_states.update import AdamHyper, adam_chunk_


@functools.lru_cache(maxsize=16)
def eager_chunk(name: str, numel: int, int8_block: int, int4_block: int) -> OpTally:
    """The ops of the eager update of one ``numel``-element chunk with states in format ``name``, counted on fake
    tensors."""
    fmt = make_format(name, int8_block, int4_block)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False,
                      bias_correction=True)
    with fake_tensor_mode():
        p32, g16 = torch.zeros(numel), torch.zeros(numel, dtype=torch.bfloat16)
        buffers = {k: v for m in MOMENTS for k, v in fmt.zeros(m, numel, torch.device("cpu")).items()}

        def chunk() -> None:
            g32 = g16.float()
            m, v = fmt.decode("exp_avg", buffers, 0, numel), fmt.decode("exp_avg_sq", buffers, 0, numel)
            adam_chunk_(p32, g32, m, v, 2.0, hyper)
            fmt.encode("exp_avg", m, buffers, 0, None)
            fmt.encode("exp_avg_sq", v, buffers, 0, None)

        with warnings.catch_warnings():  # fp32's encode compares data pointers (a view in place): fake ones are 0
            warnings.simplefilter("ignore", UserWarning)
            return tallied(chunk)


@functools.lru_cache(maxsize=64)
def together_batch(numel: int) -> OpTally:
    """The ops of one batch of small fp32 tensors stepped together (`together.adam_foreach_`), ``numel``
    elements in all, counted on fake tensors (as one tensor: a multi-tensor op counts one launch)."""
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False,
                      bias_correction=True)
    with fake_tensor_mode():
        p, g, m, v = (torch.zeros(numel) for _ in range(4))
        return tallied(lambda: adam_foreach_([p], [g], [m], [v], [2], hyper))


def update_ops(plugin: Any, shape: Any, numels: list, profile: Any) -> Optional[OpTally]:
    """The update's ops as they run on ``profile``'s device (module docstring); ``None`` without the model."""
    layout = plugin.estimate_layout()
    if layout is None:
        return None
    params, kept_ids, fmt = layout
    world = shape.world_size if shape.stage >= 1 else 1
    fp32 = make_format("fp32")
    kept = [p.numel() for p in params if id(p) in kept_ids]
    quant = [p.numel() for p in params if id(p) not in kept_ids]
    if plugin.session.stepper is not None or shape.stage == 0:  # each parameter's shard
        tensors = [(fp32, math.ceil(n / world)) for n in kept] + [(fmt, math.ceil(n / world)) for n in quant]
    else:  # one flat partition per group
        tensors = [(f, math.ceil(sum(ns) / world)) for f, ns in ((fp32, kept), (fmt, quant)) if ns]
    return _tensors_ops(plugin, shape, tensors, profile)


def group_update_ops(plugin: Any, shape: Any, pieces: list, profile: Any) -> Optional[OpTally]:
    """The ops of one optimizer step over ``pieces`` (``(parameter index, elements)``: one grad_release bucket's
    shard, which its own optimizer steps), as `update_ops` counts a step; ``None`` without the model."""
    layout = plugin.estimate_layout()
    if layout is None:
        return None
    params, kept_ids, fmt = layout
    fp32 = make_format("fp32")
    return _tensors_ops(plugin, shape, [(fp32 if id(params[i]) in kept_ids else fmt, n) for i, n in pieces], profile)


def _tensors_ops(plugin: Any, shape: Any, tensors: list, profile: Any) -> OpTally:
    """One step of ``tensors`` (``(state format, elements)``) as it runs on ``profile``'s device."""
    c = plugin.config
    fp32 = make_format("fp32")
    compiled = c.fused is True or (c.fused == "auto" and not profile.name.startswith("cpu"))
    stepper = plugin.session.stepper
    no_master = (stepper is not None and shape.dtype == torch.bfloat16
                 and getattr(getattr(stepper, "config", None), "masters", None) == "none")  # rounded in the kernel
    out = OpTally()
    if compiled and no_master and tensors:  # the weight's gradient scales stacked once a step (`FusedStep._extras`)
        out.add_counts(0, 12, False, times=2)
    fp32_kernel = compiled and not no_master  # fp32 states on torch's fused Adam kernel (`fused.FusedStep.adam_`)
    together = [n for f, n in tensors if f.name == fp32.name and n <= c.chunk_numel] if not no_master else []
    if fp32_kernel:
        if together:
            out.add_counts(0, FUSED_ADAM_BYTES * sum(together), False)
        if any(f.name == fp32.name for f, _ in tensors):  # the step's value, made on the device once
            out.add_counts(0, 4, False)
    for run in ([] if fp32_kernel else batches([torch.empty(n, device="meta") for n in together], c.chunk_numel)):
        out.ops_from(together_batch(sum(t.numel() for t in run)))
    for f, n in tensors:
        if f.name == fp32.name and n <= c.chunk_numel and not no_master:
            continue  # stepped together above
        if fp32_kernel and f.name == fp32.name:
            out.add_counts(0, FUSED_ADAM_BYTES * n, False)
        elif compiled and fuses(f.name, no_master):  # one kernel: the parameter, its gradient, both moments
            out.add_counts(0, (4 if no_master else 8) * n + 4 * n + 2 * f.state_bytes(n), False)
            if no_master:  # and the start index of the weight's noise, made on the device (an ``arange``)
                out.add_counts(0, 8, False)
        else:
            chunk = min(c.chunk_numel, n)
            out.ops_from(eager_chunk(f.name, chunk, c.int8_block_size, c.int4_block_size), math.ceil(n / chunk))
    return out


__all__ = ["eager_chunk", "group_update_ops", "together_batch", "update_ops"]
