"""Every rule that spans two sections of the block, in one table.

A rule names the key its problem is reported on, the sections it involves, when it applies and what it
says (the key, the value, what is allowed and the fix). `XirangConfig.check` runs the table;
``tests/config/test_units.py`` runs each row both ways. Rules between a section and the ds_config are each
plugin's `check_ds_config`; rules between a section and a framework are its `FrameworkPath.check`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


PACKING = ("compress", "quantize", "sparsify")
"""Activation options whose payloads can live in lent memory."""


@dataclass(frozen=True)
class Rule:
    """A clash between sections of one block."""

    key: str
    """The key the problem is reported on, relative to the block (``"monitor.actions"``)."""
    sections: tuple[str, ...]
    """The sections involved."""
    clashes: Callable[[Any], bool]
    """True when ``config`` breaks the rule."""
    message: str
    """What is wrong and the fix."""


def _acts_through_activations(action: str) -> Callable[[Any], bool]:
    return lambda c: c.monitor.enabled and action in c.monitor.actions and not c.activations.enabled


def _lends(c: Any) -> bool:
    return c.comm_buffers.enabled and c.comm_buffers.lend_to_activations


def _nothing_to_lend_to(c: Any) -> bool:
    a = c.activations
    return (_lends(c) and a.enabled and not any(getattr(a, o) for o in PACKING)
            and not (a.planner and set(a.options) & set(PACKING)))


RULES: tuple[Rule, ...] = (
    *(Rule("monitor.actions", ("monitor", "activations"), _acts_through_activations(action),
           f"{action!r} acts through the activations plugin; enable xirang.activations or remove the action")
      for action in ("raise_compression", "raise_recompute")),
    Rule("monitor.on_oom", ("monitor", "grad_release"),
         lambda c: (c.monitor.enabled and c.monitor.on_oom == "halve_micro_batch" and c.grad_release.enabled
                    and c.grad_release.exact_method == "two_pass"),
         "'halve_micro_batch' retries a failed backward, but grad_release's exact_method 'two_pass' applies "
         "updates during its second backward, where an error would leave a half-applied step; set "
         "grad_release.exact_method to \"host\" or \"hold\", or on_oom to \"raise\""),
    Rule("grad_release.exact_method", ("grad_release", "activations"),
         lambda c: (c.grad_release.enabled and c.grad_release.exact_method == "two_pass" and c.activations.enabled
                    and bool(c.activations.selective_recompute)),
         "\"two_pass\" runs each step's backward twice over one graph, and the modules fixed to "
         "activations.selective_recompute allow one backward (torch's selective checkpointing consumes its cached "
         "outputs); set exact_method to \"host\" or \"hold\", or move those modules to activations.recompute "
         "(full recompute, offload and compress run under two_pass)"),
    Rule("comm_buffers.lend_to_activations", ("comm_buffers", "grad_release"),
         lambda c: _lends(c) and c.grad_release.enabled,
         "lends DeepSpeed's ZeRO reduction arena, but grad_release is on and reduces in its own buckets (there "
         "is no arena); turn one of them off"),
    Rule("comm_buffers.lend_to_activations", ("comm_buffers", "activations"),
         lambda c: _lends(c) and not c.activations.enabled,
         "lends the arena to the activations plugin, which is off; enable xirang.activations or set it to false"),
    Rule("comm_buffers.lend_to_activations", ("comm_buffers", "activations"), _nothing_to_lend_to,
         "has nothing to hold: only modules under compress, quantize or sparsify store their tensors in lent "
         "memory, and xirang.activations uses none of them; add \"compress\" to activations.options (or a "
         "compress list), or set it to false"),
)
"""The cross-section rules, in the order their problems are reported."""


def check(config: Any) -> list[tuple[str, str]]:
    """``[(key, message)]`` for every rule ``config`` breaks."""
    return [(rule.key, rule.message) for rule in RULES if rule.clashes(config)]


__all__ = ["RULES", "Rule", "check"]
