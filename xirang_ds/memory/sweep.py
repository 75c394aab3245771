"""A traced backward step by step, besides the engine: where a plugin that holds gradients its own way peaks.

The fake trace (`xirang_ds.memory.trace`) emulates DeepSpeed's gradient handling, so its backward peak is where
the model's own bytes and DeepSpeed's buckets are the most together. A plugin that replaces that handling (its
gradients held its own way as backward goes on) peaks elsewhere: where the model's own bytes and *its* holding
are the most together. A `Sweep` keeps the model's own bytes of one backward (activations and temporaries: not
the parameters, the batch, nor the emulated engine's gradients and buffers) as events on the tracker's clock, so
that point can be found for any holding given by the gradients taken so far (`most_beside`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from xirang_ds.memory.categories import COMM_BUFFERS, GRADIENTS, PARAMETERS

ENGINE = (PARAMETERS, GRADIENTS, COMM_BUFFERS)
"""Categories a sweep leaves out: the resident parameters and what the emulated engine holds."""


@dataclass
class Sweep:
    """One backward's own bytes.

    Attributes:
        start: by category, the bytes alive as it starts.
        events: ``(clock, bytes, category)`` of each allocation (positive) and free (negative) in it, in order.
    """

    start: dict[str, int] = field(default_factory=dict)
    events: list[tuple[int, int, str]] = field(default_factory=list)


def record_sweep(tracker: Any, start: int, end: int, after: int) -> Sweep:
    """The `Sweep` of the backward from clock ``start`` to ``end`` on ``tracker``, storages made before clock
    ``after`` (the seeded parameters and batch) left out."""
    out = Sweep()
    for r in tracker.records:
        category = r.resolved_category()
        if r.host or category in ENGINE or r.created <= after:
            continue
        if r.created <= start and (r.freed is None or r.freed > start):
            out.start[category] = out.start.get(category, 0) + r.nbytes
        elif start < r.created <= end:
            out.events.append((r.created, r.nbytes, category))
        if r.freed is not None and start < r.freed <= end and r.created <= end:
            out.events.append((r.freed, -r.nbytes, category))
    out.events.sort()
    return out


def most_beside(sweep: Sweep, arrivals: list[tuple[int, int]], held: Callable[[list[int]], int],
                at_arrival: Optional[Callable[[list[int]], dict[str, int]]] = None) -> tuple[int, dict, int]:
    """The point of ``sweep``'s backward where its own bytes and ``held(arrived)`` (the gradients taken so far, by
    the ``(clock, index)`` ``arrivals``, each after the events of its clock) are the most together.

    Args:
        at_arrival: bytes by category that exist only as a gradient is taken (the work it sets off at once, an
            optimizer update, gone before the next event), given the gradients taken by then.

    Returns:
        ``(total, own bytes by category, held)`` there; ``at_arrival``'s bytes there are among the own bytes.
    """
    return most_beside_point(sweep, arrivals, held, at_arrival)[:3]


def most_beside_point(sweep: Sweep, arrivals: list[tuple[int, int]], held: Callable[[list[int]], int],
                      at_arrival: Optional[Callable[[list[int]], dict[str, int]]] = None) -> tuple[int, dict, int, int]:
    """`most_beside`, and how many of ``arrivals`` were taken at that point."""
    live = dict(sweep.start)
    taken: list[int] = []
    now = held(taken)
    best = (sum(live.values()) + now, dict(live), now, 0)
    steps = sorted([(clock, 0, n, c) for clock, n, c in sweep.events] + [(clock, 1, i, "") for clock, i in arrivals])
    for _, kind, value, category in steps:
        spike: dict[str, int] = {}
        if kind:
            taken.append(value)
            now = held(taken)
            spike = at_arrival(taken) if at_arrival is not None else {}
        else:
            live[category] = live.get(category, 0) + value
        total = sum(live.values()) + now + sum(spike.values())
        if total > best[0]:
            own = dict(live)
            for c, n in spike.items():
                own[c] = own.get(c, 0) + n
            best = (total, own, now, len(taken))
    return best


__all__ = ["ENGINE", "Sweep", "most_beside", "most_beside_point", "record_sweep"]
