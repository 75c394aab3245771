"""What each candidate's backward holds besides saved activations, measured on the estimator's fake trace.

A layer's backward makes the gradients of its activations (temporaries: the gradient of an ``addmm``'s input,
a GELU's, a norm's) beside what the plan keeps up to that layer and brings back for it. The planner prices
saved activations only (`planner.estimate_peak`); the estimate puts each candidate's own temporaries beside
them (`trace_plan.plan_phases`), so the backward's worst point is that of one layer, not the most saved bytes
of one layer beside the most temporaries of another.

A candidate's backward starts when the gradient of its output is ready (a tensor hook, put on in forward)
and lasts until the next candidate outside it starts, or the phase ends. The traced run keeps every saved
tensor; its temporaries do not depend on the plan.
"""
from __future__ import annotations

from typing import Any

import torch

from xirang_ds.memory.categories import ACTIVATIONS, TEMPORARIES
from xirang_ds.memory.storages import tensors_in


def watch(modules: dict[str, torch.nn.Module], names: list[str], tracker: Any) -> tuple[list[Any], list]:
    """Forward hooks on ``names`` that mark, on ``tracker``'s clock, when each one's backward starts.

    Returns:
        ``(handles, marks)``: the hooks' handles, and the ``(clock, name)`` list the backward fills.
    """
    marks: list[tuple[int, str]] = []

    def hook(module: torch.nn.Module, args: Any, output: Any, name: str = "") -> None:
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(lambda grad, name=name: marks.append((tracker.clock, name)))

    handles = [modules[n].register_forward_hook(lambda m, a, o, n=n: hook(m, a, o, n)) for n in names]
    return handles, marks


def measure(tracker: Any, marks: list[tuple[int, str]]) -> dict[str, int]:
    """For each marked candidate, the most its backward holds above the saved activations alive as it starts: the
    temporaries made in backward, less what it has freed of its saved tensors by then (the planner counts them
    all until its backward ends)."""
    if not marks:
        return {}
    marks = sorted(marks)
    first = marks[0][0]
    records = [(r, r.resolved_category() == ACTIVATIONS) for r in tracker.records if not r.host and (
        r.resolved_category() == ACTIVATIONS or r.resolved_category() == TEMPORARIES and r.created >= first)]
    phase_changes = [clock for clock, _ in tracker.phase_log]
    last = tracker.clock + 1
    out: dict[str, int] = {}
    for i, (start, name) in enumerate(marks):
        ends = [clock for clock, other in marks[i + 1:] if other != name and not other.startswith(name + ".")][:1]
        ends += [clock for clock in phase_changes if clock > start][:1]
        out[name] = max(out.get(name, 0), _most_between(records, start, min(ends, default=last)))
    return out


def _most_between(records: list, start: int, end: int) -> int:
    """The most bytes of ``records`` alive at once in ``[start, end)`` less the saved activations alive at ``start``."""
    alive = [(r, saved) for r, saved in records if r.created <= start and (r.freed is None or r.freed > start)]
    live = sum(r.nbytes for r, _ in alive)
    saved_at_start = sum(r.nbytes for r, saved in alive if saved)
    events = sorted([(r.created, r.nbytes) for r, _ in records if start < r.created < end]
                    + [(r.freed, -r.nbytes) for r, _ in records if r.freed is not None and start < r.freed < end])
    most = live
    for _, delta in events:
        live += delta
        most = max(most, live)
    return most - saved_at_start


__all__ = ["measure", "watch"]
