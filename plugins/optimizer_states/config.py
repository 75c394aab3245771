"""The ``optimizer_states`` section of the ``"xirang"`` block, kept beside its plugin.

One frozen dataclass with a docstring under every field (docs/config.md's reference is generated from
them: ``make reference``) and its cross-field rules in ``check()``; the plugin registers it as the key
``optimizer_states`` of the block (`xirang_ds.registry.register_plugin`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional, Union

from xirang_ds.config.section import Issues, Section
from xirang_ds.config.types import Glob, MultipleOf, NonNegativeInt, PositiveInt, Range

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
    error where it cannot; ``false`` is always eager. Where it compiles, fp32 states take torch's fused
    Adam kernel (bit-identical to ``torch.optim.AdamW(fused=True)``; one op for a tensor of any size or for
    the small ones together), and the compiled kernel under grad_release's in-place ``masters: none``, whose
    bf16 weights are rounded stochastically; elsewhere they are eager (bit-identical to
    ``torch.optim.AdamW``'s default)."""
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


__all__ = ["STATE_DTYPE_ORDER", "OptimizerStatesConfig", "ScheduleEntry", "StabilityConfig", "StateDtype"]
