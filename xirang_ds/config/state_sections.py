"""The sections that change how model states are held: optimizer_states, grad_release, precision.

Part of the schema of the ``"xirang"`` block (`xirang_ds.config.schema`, which re-exports every name here):
one frozen dataclass per section, a docstring under every field (docs/config.md's config reference is
generated from them), cross-field rules in each section's ``check()``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional, Union

from xirang_ds.config.section import Issues, Section
from xirang_ds.config.types import AutoInt, Glob, MultipleOf, NonNegativeInt, PositiveInt, Range

# --------------------------------------------------------------------------------------------
# optimizer_states
# --------------------------------------------------------------------------------------------

StateDtype = Literal["fp32", "bf16", "int8", "int4"]
STATE_DTYPE_ORDER = ("fp32", "bf16", "int8", "int4")
"""From most to least precise; a schedule only moves down this list (stability may move up)."""


@dataclass(frozen=True)
class ScheduleEntry:
    """One stage of a by-step precision schedule."""

    dtype: StateDtype
    """Storage format of the optimizer states during this stage."""
    until_step: Optional[PositiveInt] = None
    """The stage holds while a tensor's step count is below this (exclusive); omit on the last."""


@dataclass(frozen=True)
class StabilityConfig:
    """Move a state tensor down in precision once its moments stop changing."""

    start: StateDtype = "fp32"
    """Format of every tensor's states before its first move."""
    window_steps: PositiveInt = 50
    """Steps between two measurements of a tensor's moments (and of its quantization error)."""
    threshold: Annotated[float, Range(0.0, 1.0, low_exclusive=True)] = 0.05
    """A tensor moves down one format when the relative change of its bias-corrected moment norms
    between two measurements is below this."""
    lowest: StateDtype = "int8"
    """The least precise format stability may reach."""
    max_quantization_error: Annotated[float, Range(0.0, 1.0, low_exclusive=True)] = 0.1
    """A tensor moves back up one format, and stays at or above it, when the relative error of its
    Adam update direction from the stored states exceeds this (int8 measures ~0.01, int4 ~0.2)."""


@dataclass(frozen=True)
class OptimizerStatesConfig(Section):
    """Dynamic-precision Adam/AdamW states: fp32 early, then bf16 / int8 / int4 as they settle."""

    policy: Literal["steps", "stability"] = "steps"
    """How a state tensor's precision is chosen: by the step ``schedule`` or by ``stability``."""
    schedule: tuple[ScheduleEntry, ...] = (
        ScheduleEntry(dtype="fp32", until_step=100),
        ScheduleEntry(dtype="int8"),
    )
    """By-step stages in order; each entry but the last has ``until_step``, increasing, and each
    dtype is at most as precise as the one before."""
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    """Settings of the ``stability`` policy."""
    int8_block_size: Annotated[int, Range(32, 4096), MultipleOf(32)] = 256
    """Elements per scale of int8 states (2 + 8/size bytes per parameter for both moments)."""
    int4_block_size: Annotated[int, Range(32, 4096), MultipleOf(32)] = 128
    """Elements per scale of int4 states (1 + 8/size bytes per parameter for both moments)."""
    chunk_numel: Annotated[int, Range(4096, 2**30), MultipleOf(4096)] = 131072
    """Elements updated at a time: the step's temporaries are at most 16 bytes per element of a
    chunk (8 for fp32), whatever the size of the tensor."""
    fused: Union[bool, Literal["auto"]] = "auto"
    """Run each chunk's decode, update and encode of bf16, int8 and int4 states as one
    ``torch.compile``'d kernel (Triton on GPUs, C++ on the CPU), within a code step of the eager
    update: ``"auto"`` compiles on GPUs and stays eager on the CPU (where each format's kernel takes
    seconds to build) or where compile is unavailable; ``true`` compiles on every device and is an
    error where it cannot; ``false`` is always eager. fp32 states are always eager (bit-identical to
    ``torch.optim.AdamW``)."""
    min_numel: NonNegativeInt = 4096
    """Parameters with fewer elements keep fp32 states."""
    keep_fp32: tuple[Glob, ...] = ()
    """Globs of parameter names whose states stay fp32, besides embeddings and norms; each must
    match at least one parameter."""
    keep_fp32_embeddings_and_norms: Union[bool, Literal["measured"]] = True
    """Keep states of embedding and normalisation parameters in fp32 (found by module type).
    ``"measured"``: norms stay fp32, and each embedding's states start in fp32 and move to the
    policy's int8/int4 format once the relative error of its Adam update direction from states in
    that format, measured after its first update and every ``measured_every_steps`` steps, is at
    most ``measured_max_error``; where int4's error is above it and int8's is not, to int8, which
    then stays that embedding's narrowest format."""
    measured_every_steps: PositiveInt = 25
    """With ``keep_fp32_embeddings_and_norms: "measured"``: steps between two measurements of an
    embedding's error in the policy's format (each costs one encode and decode of its states)."""
    measured_max_error: Annotated[float, Range(0.0, 1.0, low_exclusive=True)] = 0.05
    """With ``keep_fp32_embeddings_and_norms: "measured"``: the largest relative error of the Adam
    update direction at which an embedding's states leave fp32 (int8 measures ~0.01 on dense
    layers, int4 ~0.2; a 162M GPT's token embedding: int8 0.02, int4 0.31)."""
    stochastic_rounding: bool = False
    """Round quantized and bf16 states stochastically (unbiased) instead of to nearest."""
    refresh_every_steps: NonNegativeInt = 0
    """Every N steps encode the states with stochastic rounding even when ``stochastic_rounding``
    is off, so codes stuck by round-to-nearest move again (0 = never)."""
    seed: NonNegativeInt = 0
    """Seed of the stochastic-rounding draws (the same on every rank)."""
    masters: Literal["auto", "fp32", "remainders", "remainders_8bit", "none"] = "auto"
    """How DeepSpeed's ZeRO-3 optimizer keeps this rank's fp32 masters of bf16 parameters between
    updates: ``fp32`` (4 bytes per element of the partition), or ``remainders``: beside the bf16
    partition it already holds, the master's low 16 bits and one tie bit (2.125 bytes), from which
    each sub-group's update rebuilds its master bit for bit, so training is the one with fp32
    masters (exact; one sub-group's master is whole at a time, one extra pass over it before and
    after its update; where ``zero_optimization.sub_group_size`` is not set, sub-groups of 1/8 of
    the partition); ``remainders_8bit`` (the balanced preset at ZeRO-3; not exact): each park rounds
    the master stochastically to 16 significant bits and the bf16 partition to its nearest, and one
    byte an element rebuilds it (grad_release's ``remainders_8bit``; not under Megatron-core, whose
    step writes the parameters itself); ``none`` (lossy, the aggressive preset at ZeRO-3): no
    master, each sub-group's update starts from its bf16 weights widened to fp32 and is rounded back
    into them stochastically (grad_release's ``masters: none``, 0 bytes). ``auto`` = ``remainders``
    wherever DeepSpeed's ZeRO-3 optimizer holds bf16 weights and their masters on the device, else
    ``fp32``. At ZeRO 0-2 grad_release holds the masters (``grad_release.masters``). Under Megatron-core
    the same remainders keep the masters of the Float16 and distributed optimizers between steps
    (whole for the step)."""

    def check(self) -> Issues:
        issues: Issues = []
        last = 0
        for i, entry in enumerate(self.schedule):
            final = i == len(self.schedule) - 1
            if entry.until_step is None and not final:
                issues.append((f"schedule[{i}].until_step", "is required on every entry but the last"))
            if entry.until_step is not None:
                if entry.until_step <= last:
                    issues.append((f"schedule[{i}].until_step",
                                   f"must be greater than the previous entry's ({last}); got {entry.until_step}"))
                last = entry.until_step
            if i and STATE_DTYPE_ORDER.index(entry.dtype) < STATE_DTYPE_ORDER.index(self.schedule[i - 1].dtype):
                issues.append((f"schedule[{i}].dtype",
                               f"{entry.dtype!r} is more precise than the previous entry's "
                               f"{self.schedule[i - 1].dtype!r}; a schedule only lowers precision "
                               f"(fp32 -> bf16 -> int8 -> int4)"))
        if not self.schedule:
            issues.append(("schedule", "must have at least one entry"))
        elif self.schedule[-1].until_step is not None:
            issues.append((f"schedule[{len(self.schedule) - 1}].until_step",
                           "must be omitted on the last entry (it holds to the end of training)"))
        for key in ("int8_block_size", "int4_block_size"):
            size = getattr(self, key)
            if self.chunk_numel % size:
                issues.append(("chunk_numel", f"must be a multiple of {key} ({size}); got {self.chunk_numel}"))
        if STATE_DTYPE_ORDER.index(self.stability.lowest) < STATE_DTYPE_ORDER.index(self.stability.start):
            issues.append(("stability.lowest", f"{self.stability.lowest!r} is more precise than stability.start "
                                               f"({self.stability.start!r}); set lowest at or below start"))
        return issues


# --------------------------------------------------------------------------------------------
# grad_release
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# precision
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionConfig(Section):
    """Mixed precision with editable op lists, and weights kept once as fp32 masters with 16-bit
    copies made per op (or DeepSpeed's persistent 16-bit layout where that is not larger)."""

    dtype: Literal["auto", "bf16", "fp16"] = "auto"
    """Low-precision dtype; ``auto`` follows ds_config's ``bf16``/``fp16`` section, else bf16. fp16
    uses DeepSpeed's dynamic loss scaler with the ``fp16`` section's settings."""
    low_precision_ops: tuple[str, ...] = ("default",)
    """White list: ATen ops that run in the low-precision dtype, applied in order. ``"default"`` is
    the built-in list (PyTorch autocast's CUDA and CPU lists and Apex O1's: matmuls, linear,
    convolutions, attention); ``"name"`` adds an op (``"gelu"``, ``"aten::bmm"``, one overload as
    ``"pow.Scalar"``); ``"-name"`` removes one from the list built so far."""
    fp32_ops: tuple[str, ...] = ("default",)
    """Black list: ops that always run in fp32, same syntax (the default has softmax, log_softmax,
    layer_norm, cross_entropy, exp, log, pow, sum, norms and losses). An op may be in one list only;
    ops in neither run in the widest floating dtype of their inputs."""
    fp32_modules: tuple[Glob, ...] = ()
    """Globs of full module names that run entirely in fp32 (``"lm_head"``, ``"blocks.*.ln_*"``);
    ``"blocks.2"`` does not match ``"blocks.20"``; each glob must match a module."""
    weight_copies: Literal["auto", "on_demand", "persistent"] = "auto"
    """Where the 16-bit weights live. ``on_demand``: the weights are kept once, as fp32 masters
    (DeepSpeed trains in fp32), and each op's 16-bit copy of a weight is made just before it runs,
    freed after it, and made again in backward: 4 bytes per parameter. ``persistent``: DeepSpeed's
    bf16/fp16 mode (16-bit weights all the time plus its fp32 masters: 6 bytes per parameter at
    ZeRO 0, 2 + 4/N at ZeRO 1/2 over N ranks) with the lists applied on top. ``auto``: whichever
    keeps fewer weight bytes: ``persistent`` at ZeRO 1/2 with more than one rank (unless DeepSpeed's
    16-bit mode cannot start on the device, as fp16 on most CPUs), else ``on_demand``."""
    narrow_saved_upcasts: bool = True
    """An fp32-listed op that widens a 16-bit input saves that input for backward and widens it
    again there, instead of saving the fp32 copy (exact, half the bytes). Turn off only if the
    program modifies such inputs in place before backward (an error says so)."""

    def check(self) -> Issues:
        issues: Issues = []
        if self.low_precision_ops or self.fp32_ops:
            from xirang_ds.plugins.precision.op_lists import build_op_lists

            build_op_lists(self.low_precision_ops, self.fp32_ops, "", issues)
        seen: set[str] = set()
        for i, glob in enumerate(self.fp32_modules):
            if not glob.strip():
                issues.append((f"fp32_modules[{i}]", "is empty; write a module name or a glob like \"blocks.*.ln_1\""))
            elif glob in seen:
                issues.append((f"fp32_modules[{i}]", f"{glob!r} is listed twice; remove one"))
            seen.add(glob)
        return issues


__all__ = ["STATE_DTYPE_ORDER", "GradReleaseConfig", "OptimizerStatesConfig", "PrecisionConfig", "ScheduleEntry",
           "StabilityConfig", "StateDtype"]
