"""The ``activations`` section of the ``"xirang"`` block, kept beside its plugin.

One frozen dataclass with a docstring under every field (docs/config.md's reference is generated from
them: ``make reference``) and its cross-field rules in ``check()``; the plugin registers it as the key
``activations`` of the block (`xirang_ds.registry.register_plugin`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union

from xirang_ds.config.section import Issues, Section
from xirang_ds.config.types import AutoBytes, AutoInt, Glob, MultipleOf, NonNegativeInt, PositiveInt, Range

ActivationOption = Literal["keep", "recompute", "selective_recompute", "recompute_offload", "compress",
                           "quantize", "sparsify", "offload", "chunk", "recompute_tiled", "recompute_tiled_offload"]
ACTIVATION_OPTIONS = ("keep", "recompute", "selective_recompute", "recompute_offload", "compress", "quantize",
                      "sparsify", "offload", "chunk", "recompute_tiled", "recompute_tiled_offload")
"""What can happen to the tensors a module saves for backward; each is also the key of a fixed plan."""
LOSSY_ACTIVATION_OPTIONS = ("quantize", "sparsify")
"""Options whose decoded tensors differ from the saved ones: only for modules listed in ``tolerant``."""


@dataclass(frozen=True)
class ActivationsConfig(Section):
    """Per-module choice of keep / recompute / compress / offload for the tensors saved for backward.

    Fixed plans name modules by glob (``"recompute": ["blocks.*.mlp"]``); the planner profiles the
    first passes and chooses for every other candidate under the budget. ds_config's own
    ``activation_checkpointing`` section is applied through the same mechanism.
    """

    budget: AutoBytes = "auto"
    """Device bytes of saved activations per rank the plan may keep at the end of forward; ``auto`` =
    what ``memory_budget`` leaves after everything else the profiling passes measured (model
    states, gradients, buffers)."""
    budget_fraction: Optional[Annotated[float, Range(0.0, 1.0, low_exclusive=True)]] = None
    """Instead of ``budget``: this fraction of the activation bytes measured with every module kept."""
    planner: bool = True
    """Profile the first passes, then choose an option for every candidate not fixed by hand."""
    candidates: Union[Literal["auto"], tuple[Glob, ...]] = "auto"
    """Modules the planner chooses for (globs on full module names); ``auto`` = the model's blocks and
    their direct children: the children of every ``nn.ModuleList``, else of every ``nn.Sequential``,
    else of the outermost module with several children (``torch.compile``'s wrapper passed through);
    with ``chunk`` among the options, also every ``nn.Linear`` outside the blocks at least as wide out
    as in (the output head: ``chunk`` applies where profiling sees its output reach ``cross_entropy``),
    and under Megatron-core a language model's ``output_layer``."""
    options: tuple[ActivationOption, ...] = ACTIVATION_OPTIONS
    """Options the planner may choose; ``quantize`` and ``sparsify`` only for modules in ``tolerant``."""
    keep: tuple[Glob, ...] = ()
    """Modules fixed to keep their saved tensors as they are."""
    recompute: tuple[Glob, ...] = ()
    """Modules fixed to full recompute: only their inputs are kept; forward runs again in backward."""
    selective_recompute: tuple[Glob, ...] = ()
    """Modules fixed to selective recompute: outputs of matmuls and attention that backward needs are
    kept, everything else (norms, activations functions, copies) is recomputed."""
    recompute_offload: tuple[Glob, ...] = ()
    """Modules fixed to full recompute with their inputs held in host memory (DeepSpeed's
    ``cpu_checkpointing``)."""
    compress: tuple[Glob, ...] = ()
    """Modules fixed to lossless compression: bit-exact narrower storage (fp32 values that are exactly
    bf16/fp16), bitmask encoding of exact zeros, 1 bit per bool."""
    quantize: tuple[Glob, ...] = ()
    """Modules fixed to lossy 8-bit block quantization; each must also match ``tolerant``."""
    sparsify: tuple[Glob, ...] = ()
    """Modules fixed to lossy sparse storage (values at or below ``sparsify_threshold`` dropped); each
    must also match ``tolerant``."""
    offload: tuple[Glob, ...] = ()
    """Modules fixed to offload their saved tensors to host memory (async copies, prefetched in backward)."""
    chunk: tuple[Glob, ...] = ()
    """Output heads (``nn.Linear`` modules whose output feeds ``cross_entropy``) fixed to the chunked
    head and loss: the logits are made and consumed ``chunk_tokens`` rows at a time in forward and
    again in backward, never held whole; only the head's input is kept (docs/activations.md)."""
    recompute_tiled: tuple[Glob, ...] = ()
    """Token-wise modules (``token_wise``) fixed to tiled recompute: only their inputs are kept, and their
    forward and its recomputation in backward run a slice of tokens at a time, so backward holds one
    slice's intermediates (gradients to rounding of ``recompute``'s, docs/activations.md)."""
    recompute_tiled_offload: tuple[Glob, ...] = ()
    """Token-wise modules fixed to tiled recompute with their inputs held in host memory (as
    ``recompute_offload`` holds them)."""
    token_wise: tuple[Glob, ...] = ("feed_forward",)
    """Modules whose output for a token depends on that token's input alone, which ``recompute_tiled``
    may slice: globs, or ``"feed_forward"`` for every repeated block's MLP child (a name containing mlp,
    ffn or feed_forward; none is not an error); ``[]`` offers the tiled options nowhere."""
    chunk_tokens: AutoInt = "auto"
    """Rows (tokens) per slice of a chunked head; ``auto`` = a slice whose fp32 logits are as large as
    the head's weight (hidden / 2 rows for a bf16 head)."""
    tolerant: tuple[Glob, ...] = ()
    """Modules whose saved tensors may be stored lossily (``quantize``, ``sparsify``): globs, or
    ``"feed_forward"`` for every repeated block's MLP child (a name containing mlp, ffn or
    feed_forward; none is not an error)."""
    quantize_block_size: Annotated[int, Range(32, 4096), MultipleOf(32)] = 64
    """Elements per fp32 scale of 8-bit storage; the error bound is max|block| / 254 per element."""
    sparsify_threshold: Annotated[float, Range(0.0, 1.0)] = 0.01
    """``sparsify`` drops values whose magnitude is at most this fraction of the tensor's largest."""
    min_tensor_bytes: NonNegativeInt = 4096
    """Saved tensors smaller than this stay as they are (except under recompute)."""
    profile_steps: PositiveInt = 2
    """Forward/backward passes profiled before planning; meanwhile every saved tensor is offloaded
    (memory-safe, results unchanged) and the fastest pass's op times are used."""
    offload_prefetch: PositiveInt = 1
    """How many offloaded modules ahead backward prefetches (on a side stream; CPU copies on demand)."""
    host_bandwidth_gbps: Union[Literal["auto"], Annotated[float, Range(0.0, low_exclusive=True)]] = "auto"
    """Device-host copy bandwidth that prices offload, in GB/s; ``auto`` takes the device profile's
    host link (`xirang_ds.memory.device_profile`: 64 GB/s on H100/H200, 32 on A100, 10 on a CPU)."""
    distribute_saved_inputs: bool = False
    """Megatron-core at tensor-parallel size > 1: a ``recompute`` module whose inputs are identical on
    every TP rank (a ``TransformerLayer`` and its ``self_attention``, ``mlp`` and norms) keeps 1/tp
    of them per rank and all-gathers them over the TP group when backward recomputes it (Megatron's
    ``distribute_saved_activations``). Not under DeepSpeed or with sequence parallelism."""
    honour_deepspeed_checkpointing: bool = True
    """Apply ds_config's ``activation_checkpointing`` section through this plugin (recompute of the
    repeated blocks; DeepSpeed alone ignores it unless model code calls its API)."""

    @property
    def follows_memory_budget(self) -> bool:
        """The saved activations' budget is what ``memory_budget`` leaves them (neither ``budget`` nor
        ``budget_fraction`` set): what lowers the rest raises it."""
        return self.budget == "auto" and self.budget_fraction is None

    def check(self) -> Issues:
        issues: Issues = []
        if self.budget_fraction is not None and self.budget != "auto":
            issues.append(("budget_fraction", f"cannot be set together with budget ({int(self.budget)} bytes); "
                                              "keep one of them"))
        if self.planner and not self.options:
            issues.append(("options", "must list at least one option while planner is true; "
                                      "add \"keep\" or set planner to false"))
        if len(set(self.options)) != len(self.options):
            issues.append(("options", "lists an option twice"))
        return issues


__all__ = ["ACTIVATION_OPTIONS", "ActivationOption", "ActivationsConfig", "LOSSY_ACTIVATION_OPTIONS"]
