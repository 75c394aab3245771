"""monitor under Megatron-core: the actions that need DeepSpeed's engine are refused.

``checkpoint`` needs DeepSpeed's ``save_checkpoint`` (Megatron saves with ``--save-interval``), and
``on_oom = "halve_micro_batch"`` splits micro-batches inside ``engine.forward`` and ``engine.backward``,
which Megatron's schedule does not call.
"""
from __future__ import annotations

from xirang_ds.plugins.monitor.config import MonitorConfig
from xirang_ds.registry import FrameworkPath

MEGATRON_ACTIONS = ("empty_cache",)
"""Actions available under Megatron-core."""


class MegatronMonitor(FrameworkPath):
    """The same watch on Megatron's run, with the actions it can take there."""

    @classmethod
    def check(cls, config: MonitorConfig) -> list[tuple[str, str]]:
        issues = []
        if config.on_oom != "raise":
            issues.append(("on_oom", f"{config.on_oom!r} runs the step's micro-batches again inside "
                                     "engine.forward and engine.backward, which Megatron's schedule does not "
                                     "call; allowed there: 'raise'. Fix: set on_oom to \"raise\" for Megatron runs"))
        for action in config.actions:
            if action not in MEGATRON_ACTIONS:
                issues.append(("actions", f"{action!r} is not available with Megatron-core (allowed there: "
                                          f"{', '.join(map(repr, MEGATRON_ACTIONS))}); remove it for "
                                          "Megatron runs (Megatron saves checkpoints with --save-interval)"))
        return issues


__all__ = ["MEGATRON_ACTIONS", "MegatronMonitor"]
