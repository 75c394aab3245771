"""The ``grad_release`` section of the ``"xirang"`` block, kept beside its plugin.

One frozen dataclass with a docstring under every field (docs/config.md's reference is generated from
them: ``make reference``) and its cross-field rules in ``check()``; the plugin registers it as the key
``grad_release`` of the block (`xirang_ds.registry.register_plugin`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from xirang_ds.config.section import Issues, Section
from xirang_ds.config.types import AutoInt

@dataclass(frozen=True)
class GradReleaseConfig(Section):
    """Optimizer step fused into backward: each bucket is reduced, applied and freed at once."""

    bucket_size_numel: AutoInt = "auto"
    """Gradient elements per reduction bucket; ``auto`` = 1/16 of the trainable elements, raised toward
    the size at which one collective runs at >= 90% of the link's bandwidth (``9 * ranks * latency *
    bandwidth`` bytes, ranks capped at 8, the backend's figures as in comm_buffers: gloo 450,000 fp32
    elements at 2 ranks, NCCL 13.5M) but not above 1/8 of them, kept between 2**16 and 2**25. A
    parameter larger than the bucket gets a bucket of its own."""
    clipping: Literal["exact", "previous_step", "per_layer"] = "exact"
    """How ds_config's ``gradient_clipping`` (Megatron: ``OptimizerConfig.clip_grad``) is honoured:
    ``exact`` (this step's global norm, known before any update through ``exact_method``),
    ``previous_step`` (the coefficient of the previous step's global norm; the first step is exact)
    or ``per_layer`` (each parameter tensor clipped to its share of the limit, ``gradient_clipping *
    sqrt(numel / total numel)``; not under tensor parallelism)."""
    exact_method: Literal["auto", "host", "hold", "two_pass"] = "auto"
    """How the global norm (exact clipping) and a non-finite gradient (fp16 overflow) are known
    before any update: ``hold`` keeps the reduced shards on the device until backward ends (this
    rank's shard of all gradients, as plain ZeRO-2 holds), ``host`` keeps each bucket's reduced
    gradient shard in (pinned) host memory until backward ends and copies it back one bucket at a time
    for its update (the device holds a few buckets, as without clipping; this rank's gradient shard
    crosses the host link twice per step), ``two_pass`` runs backward twice, the first pass for the
    norm only (about one bucket of gradients; one more backward of time; not under Megatron, whose
    schedule runs backward). ``auto``: ``hold`` (a norm needs no host), and ``host`` where memory asks:
    the estimate with the shard held exceeds ``memory_budget``, the activation planner decides under a
    byte budget, or the optimizer states are in host memory (``states``)."""
    nonfinite: Literal["auto", "raise", "skip_step"] = "auto"
    """A non-finite gradient: ``skip_step`` skips the step on every rank with no parameter updated
    (a global pass every step, see ``exact_method``); ``raise`` stops every rank with an error
    naming the bucket; ``auto`` = ``skip_step`` under fp16 (dynamic loss scaling), else ``raise``."""
    overlap_comm: bool = True
    """Reduce the next bucket while the previous one is applied and backward continues (one
    reduction in flight); ``false`` reduces and applies each bucket synchronously."""
    masters: Literal["auto", "fp32", "remainders", "remainders_8bit", "none"] = "auto"
    """How the fp32 masters of 16-bit parameters are kept between updates: ``fp32`` (4 bytes per
    element of this rank's shard); ``remainders``: the bf16 weight the model holds plus the
    master's low 16 bits and one tie bit (2.125 bytes), from which each update rebuilds the master
    bit for bit, so training is the one with fp32 masters (exact); ``remainders_8bit`` (the
    balanced preset; not exact): each update rounds the master stochastically to 16 significant
    bits and the weight to nearest (ties away from zero), and one byte beside the weight rebuilds
    the master (1 byte; the rounding's step is 2**-16 of the weight, against 2**-8 with ``none``);
    ``none`` (lossy, the aggressive preset): no master, each update steps the bf16 weights widened
    to fp32 and rounds the result back stochastically (0 bytes; under optimizer_states a chunk at a
    time, with no fp32 copy of the shard even during the update; convergence measured in
    docs/grad_release.md). ``remainders``, ``remainders_8bit`` and ``none`` need bf16 parameters (an
    fp16 weight is not the top half of an fp32 number). ``auto`` = ``remainders`` with bf16
    parameters, else ``fp32``."""
    states: Literal["auto", "device", "host"] = "auto"
    """Where the buckets' optimizer states (Adam's moments over this rank's shard) live between
    updates: ``device``, or ``host``: (pinned) host memory, each bucket's states copied to the device
    just before its update and back right after it, on the current stream (lossless: the same update
    of the same values, bit for bit). The device then holds one bucket's states, during its update,
    instead of all of them (fp32 Adam: 8 bytes per shard element); the states cross the host link
    twice per optimizer step. ``auto``: on the device, unless the estimated model states, gradients and
    optimizer step with them there exceed ``memory_budget`` (then on the host from the start), or the
    activation planner finds no plan within it with them there and one with them on the host (then
    moved there, once); the session summary says which and why. ``host`` is not for Megatron-core
    (``auto`` stays on the device there)."""
    prefetch_states: Union[bool, Literal["auto"]] = "auto"
    """With the optimizer states in host memory (``states``): copy them on a side stream, each bucket's back
    after its update and the next bucket's to the device right behind it, so the host link works beside the
    compute stream (in a pass that updates in backward, while backward runs) instead of stalling it. The device
    then holds up to two buckets' states at once, not one, and in such a backward the next bucket's between
    updates (the estimate counts them). ``auto``: where the device has streams (GPUs); ``true``: on the CPU too,
    where there is no side stream and the copies are only made early (nothing overlaps; for tests); ``false``:
    each bucket's copied on the current stream just before and after its update. The same for exact clipping's
    stash (``exact_method: host``), with the states on the device too: each reduced gradient shard copied to the
    host on the side stream in backward, and back while the bucket before it updates (the device then holds two
    buckets' shards at the updates, not one)."""

    def check(self) -> Issues:
        if self.prefetch_states is True and self.states == "device":
            return [("prefetch_states", "copies the optimizer states from host memory ahead of the updates, but "
                                        "states is \"device\": nothing is in host memory. Set states to \"auto\" or "
                                        "\"host\", or prefetch_states to \"auto\"")]
        return []


__all__ = ["GradReleaseConfig"]
