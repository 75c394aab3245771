"""The ``monitor`` section of the ``"xirang"`` block, kept beside its plugin.

One frozen dataclass with a docstring under every field (docs/config.md's reference is generated from
them: ``make reference``) and its cross-field rules in ``check()``; the plugin registers it as the key
``monitor`` of the block (`xirang_ds.registry.register_plugin`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from xirang_ds.config.section import Issues, Section
from xirang_ds.config.types import Fraction, NonNegativeInt, PositiveInt

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


__all__ = ["MonitorAction", "MonitorConfig"]
