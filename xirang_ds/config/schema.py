"""The typed schema of the ``"xirang"`` block: one frozen dataclass per section.

Every field carries a docstring right under it (torchtitan and Megatron-core style); docs/config.md's
config reference is generated from them (`xirang_ds.config.reference`). Sections are off by
default: a block that only says ``{"preset": "balanced"}`` turns on what the preset lists.

Cross-field rules live in each section's ``check()``, which returns ``[(field, message)]`` so the
validator can report them together with type and range problems; rules across sections are
`xirang_ds.config.rules`. The sections that change how model states are held (optimizer_states,
grad_release, precision) are in `xirang_ds.config.state_sections`; every name is importable from here.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional, Union

from xirang_ds.config.rules import check
from xirang_ds.config.section import Issues, Section
from xirang_ds.config.state_sections import (
    STATE_DTYPE_ORDER,
    GradReleaseConfig,
    OptimizerStatesConfig,
    PrecisionConfig,
    ScheduleEntry,
    StabilityConfig,
    StateDtype,
)
from xirang_ds.config.types import AutoBytes, AutoInt, Fraction, Glob, MultipleOf, NonNegativeInt, PositiveInt, Range

# --------------------------------------------------------------------------------------------
# activations
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# comm_buffers and memory_pool
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommBuffersConfig(Section):
    """Communication buckets sized from the model, the links and the budget, in one arena reused
    every step."""

    reduce_bucket_size: AutoInt = "auto"
    """ZeRO ``reduce_bucket_size`` in elements; ``auto`` applies the sizing rule (a value set in
    ``zero_optimization`` is kept)."""
    allgather_bucket_size: AutoInt = "auto"
    """ZeRO ``allgather_bucket_size`` in elements, likewise."""
    max_fraction_of_budget: Annotated[float, Range(0.0, 1.0, low_exclusive=True)] = 0.05
    """Upper bound of the reduction buffers (all of them) as a fraction of the memory budget."""
    collective_latency_us: Union[Literal["auto"], Annotated[float, Range(0.0, low_exclusive=True)]] = "auto"
    """Fixed cost of one collective in the sizing rule; ``auto``: by backend (NCCL 30, gloo 50)."""
    collective_bandwidth_gbps: Union[Literal["auto"], Annotated[float, Range(0.0, low_exclusive=True)]] = "auto"
    """Link bandwidth in GB/s in the sizing rule; ``auto``: by backend (NCCL 100, gloo 2)."""
    adapt: bool = True
    """Resize the reduction bucket between steps from memory headroom and the number of reductions."""
    adapt_every_steps: PositiveInt = 10
    """Consider a resize every N optimizer steps."""
    arena: bool = True
    """Serve ZeRO-1/2 reduction buckets from one allocation made once, instead of one per backward."""
    lend_to_activations: bool = False
    """Lend the arena to the activations plugin while no reduction uses it (forward): tensors of
    modules under ``compress`` / ``quantize`` / ``sparsify`` are stored there, encoded or as they
    are, instead of in memory of their own; a lease a gradient copy is about to overwrite moves to
    host memory first. Needs ``arena`` and ZeRO 1 or 2."""

    def check(self) -> Issues:
        if self.lend_to_activations and not self.arena:
            return [("lend_to_activations", "lends the arena, but arena is false; set arena to true or "
                                            "lend_to_activations to false")]
        return []


@dataclass(frozen=True)
class MemoryPoolConfig(Section):
    """One device reservation serving plugin tensors: int8/int4 optimizer states (packed, long-lived)
    and compressed activation payloads (reused every step), plain allocations when it is full."""

    size: AutoBytes = "auto"
    """Bytes reserved at attach; ``auto`` measures the first optimizer step run with every plan in
    force (plain allocations meanwhile) and then reserves the most activation payload bytes live at
    once plus what the optimizer states will hold. Must hold the largest single request."""
    use_torch_mempool: bool = True
    """On CUDA, make the reservation and the fallback allocations inside a ``torch.cuda.MemPool``
    where the installed torch has one (a private pool of the caching allocator)."""

    def check(self) -> Issues:
        if self.size != "auto" and int(self.size) == 0:
            return [("size", 'must be "auto" or a byte count above 0; got 0 (to run without a pool, set enabled '
                             "to false)")]
        return []


# --------------------------------------------------------------------------------------------
# monitor, profiler, autotune
# --------------------------------------------------------------------------------------------

MonitorAction = Literal["empty_cache", "checkpoint", "halve_micro_batch", "raise_compression",
                        "raise_recompute"]


@dataclass(frozen=True)
class MonitorConfig(Section):
    """Watch used memory against the budget every step; warn, then act before an OOM."""

    warn_at: Fraction = 0.85
    """Fraction of the memory budget at which a warning is logged."""
    act_at: Fraction = 0.95
    """Fraction of the memory budget at which the ``actions`` run."""
    actions: tuple[MonitorAction, ...] = ("empty_cache",)
    """What to do at ``act_at``, in order; all ranks agree through one collective. An *episode* starts
    when a check first reaches ``act_at`` and ends at the first check below ``warn_at`` (hysteresis):
    ``empty_cache`` and ``checkpoint`` run once per episode, ``halve_micro_batch``,
    ``raise_recompute`` and ``raise_compression`` at every check of it that is still at ``act_at``."""
    restore_after_steps: NonNegativeInt = 0
    """``halve_micro_batch``: after this many consecutive checks below ``warn_at`` the micro-batch
    doubles back one level (until it is whole again); 0 = keep it halved."""
    checkpoint_dir: Optional[str] = None
    """Where the ``checkpoint`` action saves; required when that action is listed."""
    on_oom: Literal["raise", "halve_micro_batch"] = "raise"
    """An out-of-memory error inside ``engine.forward`` or ``engine.backward``: ``raise`` it (as without
    xirang), or ``halve_micro_batch``: every rank drops the micro-step (a rank that did not fail learns it
    before its next collective), the micro-batch runs as twice as many pieces (accumulation doubled
    inside ``engine.forward``; the global batch, the step and sample counters and the LR schedule
    unchanged) and this step's micro-batches run again from the first; again on the next error, down to
    pieces of one sample. Needs a scalar loss from forward (or an output holding ``loss``) passed to
    ``engine.backward``; ZeRO 0-3, DeepSpeed only. An error in the optimizer step itself is raised."""
    enforce_budget: bool = False
    """Make ``memory_budget`` a hard cap on this process's device memory: on CPU the live-storage tracker
    raises ``torch.OutOfMemoryError`` when an op's new storage would exceed it; on CUDA
    ``torch.cuda.set_per_process_memory_fraction`` (the allocator raises). With ``memory_budget`` ``auto``
    the cap is the whole device."""
    every_steps: PositiveInt = 1
    """Check every N optimizer steps."""
    log_every_steps: NonNegativeInt = 0
    """Log a memory line every N steps on rank 0 (0 = only warnings and actions)."""
    to_deepspeed_monitor: bool = True
    """Send memory figures and events to DeepSpeed's monitor (tensorboard/csv/wandb) if enabled."""

    def check(self) -> Issues:
        issues: Issues = []
        if self.act_at <= self.warn_at:
            issues.append(("act_at", f"must be greater than warn_at ({self.warn_at}); got {self.act_at}"))
        if "checkpoint" in self.actions and not self.checkpoint_dir:
            issues.append(("checkpoint_dir", 'is required when actions lists "checkpoint"'))
        if len(set(self.actions)) != len(self.actions):
            issues.append(("actions", "lists an action twice"))
        return issues


TraceFormat = Literal["json", "pickle", "html", "png"]


@dataclass(frozen=True)
class ProfilerConfig(Section):
    """Record a per-tensor memory timeline of one step and print the breakdown at its peak."""

    step: PositiveInt = 2
    """Optimizer step to record (1 = the first)."""
    output_dir: str = "xirang_trace"
    """Folder for the trace files."""
    formats: tuple[TraceFormat, ...] = ("json", "html")
    """Files to write: ``json`` (our timeline), ``pickle`` (PyTorch memory_viz), ``html``, ``png``."""
    top_tensors: PositiveInt = 10
    """How many of the largest live tensors at the peak to name."""


@dataclass(frozen=True)
class AutotuneConfig(Section):
    """Search the block's options under the memory budget and write the winning ds_config."""

    objective: Literal["fastest", "largest_micro_batch"] = "fastest"
    """What to optimise under the budget."""
    time_limit_s: Annotated[float, Range(0.0, low_exclusive=True)] = 600.0
    """Wall-clock limit of the search."""
    measure_top: PositiveInt = 3
    """How many best candidates of the cost model are measured for real."""
    output: str = "ds_config.tuned.json"
    """Where the winning ds_config is written."""


# --------------------------------------------------------------------------------------------
# the block
# --------------------------------------------------------------------------------------------

PresetName = Literal["conservative", "balanced", "aggressive"]


@dataclass(frozen=True)
class XirangConfig:
    """The whole ``"xirang"`` block of a ds_config."""

    preset: Optional[PresetName] = None
    """Start from a preset; keys written next to it override the preset's key by key. ``"auto"``
    takes the least aggressive preset whose estimated model states fit ``memory_budget``, among those
    the block's ``"sensitivity"`` allows (``lossless``: conservative; ``normal``, the default: up to
    balanced; ``tolerant``: up to aggressive), and says which in the session summary."""
    memory_budget: AutoBytes = "auto"
    """Per-rank device memory the run may use; ``auto`` = the device's capacity."""
    host_memory_budget: AutoBytes = "auto"
    """Per-rank host bytes the activation offload buffers may hold (pinned on accelerators); a saved
    tensor that would not fit stays on the device (counted in the activations figures). ``auto`` = no
    cap: buffers are reused by size class and the cache never holds more than the most in use at
    once."""
    deepspeed_files: bool = True
    """Every checkpoint of a run whose grad_release (ZeRO 0-2) or optimizer_states (inside DeepSpeed's ZeRO
    1-3 optimizer) holds the optimizer state also gets plain DeepSpeed's files: at ZeRO 1-3 its ZeRO
    files (fp32 masters and Adam moments in DeepSpeed's layout, ``param_shapes``, ``zero_to_fp32.py``),
    each rank writing its own partition; at stage 0 (grad_release) the model-states file's optimizer
    entry of DeepSpeed's stage-0 optimizer; all before DeepSpeed writes ``latest``. Plain DeepSpeed,
    ``zero_to_fp32.py`` and ``ds_to_universal`` then read it. optimizer_states' int8/int4 codes move to
    the tag's ``xirang_optimizer_states/`` folder. Costs 12 bytes per parameter of disk (8 at stage 0 in
    fp32) and the time to write them (docs/checkpoints.md); ``false`` leaves them out (``xirang-ds
    checkpoint export`` writes them later). xirang's own files stay and a run with the same sections
    resumes from them."""
    optimizer_states: OptimizerStatesConfig = field(default_factory=OptimizerStatesConfig)
    """Dynamic-precision optimizer states."""
    grad_release: GradReleaseConfig = field(default_factory=GradReleaseConfig)
    """Per-layer gradient release (optimizer step in backward)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Mixed precision with editable op lists; fp32 masters with per-op 16-bit copies or DeepSpeed's layout."""
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    """Activation memory planner."""
    comm_buffers: CommBuffersConfig = field(default_factory=CommBuffersConfig)
    """Adaptive communication buffers."""
    memory_pool: MemoryPoolConfig = field(default_factory=MemoryPoolConfig)
    """Pooled allocation for plugin tensors."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Live memory monitor with thresholds and actions."""
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    """Per-tensor memory timeline of one step."""
    autotune: AutotuneConfig = field(default_factory=AutotuneConfig)
    """Auto-tuner."""
    extensions: dict = field(default_factory=dict, init=False, compare=False)
    """Sections of third-party plugins, by section name (filled by the loader, not written)."""

    def sections(self) -> dict[str, Section]:
        """Every section by its key, built-in and third-party."""
        out = {name: getattr(self, name) for name in SECTION_NAMES}
        out.update(self.extensions)
        return out

    def enabled_sections(self) -> dict[str, Section]:
        return {name: s for name, s in self.sections().items() if s.enabled}

    def check(self) -> Issues:
        """Rules across sections (`xirang_ds.config.rules`)."""
        return check(self)


SECTION_NAMES = ("optimizer_states", "grad_release", "precision", "activations", "comm_buffers",
                 "memory_pool", "monitor", "profiler", "autotune")
"""Built-in section keys in the order the block documents them."""


def glob_matches(pattern: str, name: str) -> bool:
    """Whole-name glob match: ``"layers.2"`` does not match ``"layers.20"``."""
    return fnmatch.fnmatchcase(name, pattern)


__all__ = [
    "ACTIVATION_OPTIONS", "ActivationOption", "ActivationsConfig", "AutotuneConfig", "CommBuffersConfig",
    "GradReleaseConfig", "Issues", "LOSSY_ACTIVATION_OPTIONS", "MemoryPoolConfig", "MonitorAction",
    "MonitorConfig", "OptimizerStatesConfig", "PrecisionConfig", "PresetName", "ProfilerConfig",
    "SECTION_NAMES", "STATE_DTYPE_ORDER", "ScheduleEntry", "Section", "StabilityConfig", "StateDtype",
    "TraceFormat", "XirangConfig", "glob_matches",
]
