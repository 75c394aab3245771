"""What each candidate's backward holds besides saved activations, measured on the estimator's fake trace.

A layer's backward makes the gradients of its activations (temporaries: the gradient of an ``addmm``'s input,
a GELU's, a norm's) beside what the plan keeps up to that layer and brings back for it. The planner prices
saved activations only (`planner.estimate_peak`); the estimate puts each candidate's own temporaries beside
them (`trace_plan.plan_phases`), so the backward's worst point is that of one layer, not the most saved bytes
of one layer beside the most temporaries of another.

A candidate's backward starts when the gradient of its output is ready (a tensor hook, put on in forward)
and lasts until the next candidate outside it starts, or the phase ends. The traced run keeps every saved
tensor; its temporaries do not depend on the plan.

Where a candidate's saved tensors come back one by one (`trace_plan.on_demand`: offloaded without a copy
stream, encoded), a storage comes back when the first autograd node of its backward that reads it starts (the
node unpacks its saved tensors as it starts) and goes when the trace frees it (its last node has run): the
trace records both (`MemoryTracker.record_backward_uses`), so `measure` with ``restored`` puts each storage
back at its own moment beside the temporaries alive then.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from xirang_ds.memory.categories import ACTIVATIONS, TEMPORARIES
from xirang_ds.memory.storages import tensors_in


HEAD_DONE = ""
"""The mark of an output head's backward ending (the gradient of its input is ready)."""


def watch(modules: dict[str, torch.nn.Module], names: list[str], tracker: Any,
          heads: Sequence[str] = ()) -> tuple[list[Any], list]:
    """Forward hooks on ``names`` that mark, on ``tracker``'s clock, when each one's backward starts, and on the
    output ``heads`` when theirs ends (`HEAD_DONE`).

    Returns:
        ``(handles, marks)``: the hooks' handles, and the ``(clock, name)`` list the backward fills.
    """
    marks: list[tuple[int, str]] = []

    def hook(tensors: Any, name: str) -> None:
        for t in tensors_in(tensors):
            if t.requires_grad:
                t.register_hook(lambda grad, name=name: marks.append((tracker.clock, name)))

    handles = [modules[n].register_forward_hook(lambda m, a, o, n=n: hook(o, n)) for n in names]
    handles += [modules[n].register_forward_pre_hook(lambda m, a: hook(a, HEAD_DONE)) for n in heads]
    return handles, marks


@dataclass
class Timeline:
    """What `measure` reads of a traced backward, kept past the trace.

    Attributes:
        records: ``(created, freed, nbytes, saved)`` of each saved activation, and of each temporary made in
            the backward the first candidate's is in (``freed`` None: alive at the end).
        spans: ``(start, end, name)`` of each marked candidate's backward: from the gradient of its output to
            the next candidate outside it starts, or the phase ends.
        lead: ``(start, end, names)``: from the end of the output heads' backward to the start of the first
            candidates' (``names``), where one comes before: what runs between (a final norm's backward, with
            the gradients held by then) beside everything the plan keeps, counted as theirs.
        returns: ``(uses, freed, nbytes)`` of each saved storage a handler may take (`Eligibility`'s
            ``min_bytes`` and up) that backward reads: the clocks at which the nodes reading it started.
    """

    records: list[tuple[int, Optional[int], int, bool]] = field(default_factory=list)
    spans: list[tuple[int, int, str]] = field(default_factory=list)
    returns: list[tuple[tuple[int, ...], Optional[int], int]] = field(default_factory=list)
    lead: Optional[tuple[int, int, tuple[str, ...]]] = None


def timeline(tracker: Any, marks: list[tuple[int, str]], smallest: int = 0) -> Timeline:
    """The `Timeline` of the traced backward on ``tracker``, with the ``marks`` `watch` filled; saved storages of
    ``smallest`` bytes and more come back on demand (smaller ones stay on the device)."""
    heads_done = sorted(clock for clock, name in marks if name == HEAD_DONE)
    marks = sorted(mark for mark in marks if mark[1] != HEAD_DONE)
    if not marks:
        return Timeline()
    # the temporaries of backward alive in a candidate's: the gradient passed down to it included, made before
    # the first candidate's backward (by a norm or head outside every candidate)
    first = max([clock for clock, phase in tracker.phase_log if phase == "backward" and clock <= marks[0][0]],
                default=marks[0][0])
    records = [(r.created, r.freed, r.nbytes, r.resolved_category() == ACTIVATIONS) for r in tracker.records
               if not r.host and (r.resolved_category() == ACTIVATIONS
                                  or r.resolved_category() == TEMPORARIES and r.created >= first)]
    phase_changes = [clock for clock, _ in tracker.phase_log]
    last = tracker.clock + 1
    spans = []
    for i, (start, name) in enumerate(marks):
        ends = [clock for clock, other in marks[i + 1:] if other != name and not other.startswith(name + ".")][:1]
        ends += [clock for clock in phase_changes if clock > start][:1]
        spans.append((start, min(ends, default=last), name))
    # what runs between the heads' end and the first candidates' backward (a block and those nested in it start
    # together), in the same backward (no phase change between)
    done = [clock for clock in heads_done if clock < marks[0][0]
            and not any(clock < change <= marks[0][0] for change in phase_changes)]
    lead = (done[-1], marks[0][0], tuple(name for clock, name in marks if clock == marks[0][0])) if done else None
    returns = [(tuple(r.backward_uses), r.freed, r.nbytes) for r in tracker.records
               if not r.host and r.backward_uses and r.nbytes >= smallest and r.resolved_category() == ACTIVATIONS]
    return Timeline(records, spans, returns, lead)


def measure(line: Timeline, held: Optional[Callable[[int], int]] = None, changes: Sequence[int] = (),
            net_of_saved: bool = True, restored: bool = False) -> dict[str, int]:
    """For each marked candidate, the most its backward holds above the saved activations alive as it starts: the
    temporaries made in backward, less what it has freed of its saved tensors by then (the planner counts them
    all until its backward ends: a kept or recomputed module's); with ``held``, the gradient bytes held at each
    clock beside them at the same moment (they change only at the ``changes`` clocks, after the event of that
    clock). Without ``net_of_saved``, the temporaries alone, nothing taken off for the saved tensors freed: for a
    module whose saved tensors come back one by one as its nodes need them (an offload without a copy stream, an
    encoding), which the planner counts at their most at once, not all until its backward ends. With
    ``restored``, those temporaries and the candidate's saved storages as they come back one by one, each from the
    start of the first node of the candidate's backward that reads it until it is freed (or the backward ends):
    what an on-demand candidate holds beside what the plan keeps before it, at the moment it is most."""
    out: dict[str, int] = {}
    records = line.records if net_of_saved and not restored else [r for r in line.records if not r[3]]
    for start, end, name in line.spans:
        returns = _returns_between(line.returns, start, end) if restored else []
        out[name] = max(out.get(name, 0), _most_between(records + returns, start, end, held, changes))
    if line.lead is not None:
        # above the saved activations still alive when the first candidates start (those the plan counts): the
        # temporaries and the saved tensors of what runs between, which it frees as it goes
        start, end, names = line.lead
        lead = _most_between(line.records, start, end, held, changes) + _saved_at(line.records, start) \
            - _saved_at(line.records, end)
        for name in names:
            out[name] = max(out.get(name, 0), lead)
    return out


def _saved_at(records: list, clock: int) -> int:
    """The saved activations of ``records`` alive at ``clock``."""
    return sum(n for created, freed, n, saved in records
               if saved and created <= clock and (freed is None or freed > clock))


def _returns_between(returns: list, start: int, end: int) -> list[tuple[int, Optional[int], int, bool]]:
    """The storages of ``returns`` a node in ``[start, end)`` reads, as records alive from the first such node's
    start until they are freed (None: past ``end``)."""
    out = []
    for uses, freed, nbytes in returns:
        inside = [u for u in uses if start <= u < end]
        if inside:
            out.append((min(inside), freed if freed is not None and freed < end else None, nbytes, False))
    return out


def _most_between(records: list, start: int, end: int, held: Optional[Callable[[int], int]] = None,
                  changes: Sequence[int] = ()) -> int:
    """The most bytes of ``records`` (and ``held``) alive at once in ``[start, end)`` less the saved activations
    alive at ``start``."""
    alive = [(n, saved) for created, freed, n, saved in records
             if created <= start and (freed is None or freed > start)]
    live = sum(n for n, _ in alive)
    saved_at_start = sum(n for n, saved in alive if saved)
    events = sorted([(created, 0, n) for created, _, n, _ in records if start < created < end]
                    + [(freed, 0, -n) for _, freed, n, _ in records if freed is not None and start < freed < end]
                    + ([(c, 1, held(c + 1) - held(c)) for c in changes if start <= c < end] if held else []))
    live += held(start) if held else 0
    most = live
    for _, _, delta in events:
        live += delta
        most = max(most, live)
    return most - saved_at_start


__all__ = ["Timeline", "measure", "timeline", "watch"]
