"""The planner: per candidate module, the option that minimises added step time under a byte budget.

Costs per option come from the profile (`option_costs`): the device bytes the module keeps from its
forward until its backward, the bytes that come back while its backward runs (recomputed, decoded
or fetched: the *transient*), and the seconds added to a training step.

Memory model. Saved tensors live from their module's forward to its backward, and backward visits
modules in reverse. So while module ``m`` runs backward, the modules before it still hold what they
keep and ``m`` holds its kept bytes plus its transient; the modules after it are gone. With
``K(m)`` the bytes kept by ``m`` and everything before it (in forward order, starting with what
was saved before the first candidate), a plan fits the budget ``B`` when

* ``K(last) + after <= B`` (the end of forward, ``after`` = saved after the last candidate), and
* ``K(m) + transient(m) <= B`` for every module ``m`` (its backward).

A recomputed module's transient is all it saves beyond its kept inputs (the recomputation
rebuilds the module at once); decoded or fetched storages come back at the first unpack that needs
them and stay until the last of their views is unpacked, so their transient is the most the
profiled nodes hold back at once (`saved_nodes.restore_peak`);
on accelerators the copy stream fetches whole offloaded modules ahead, so an offloaded module's
transient is itself and the ``prefetch`` modules after it in backward.

Candidates form a tree (``blocks.3`` contains ``blocks.3.mlp``): a node either takes one option
for its whole subtree, or leaves the choice to its children and keeps its own remaining tensors.
In forward order the tree is a sequence of positions (each leaf, plus one position for each split
node's own tensors), and a node's option covers the interval of its subtree. The plan is then a
shortest path over positions with state ``K`` in bytes, rounded *up* to ``budget / resolution`` (a
plan found always fits): dynamic programming, exact for the model up to that rounding, and fast
(positions x options x resolution). A test checks it against brute force.

A lossy choice (``quantize``, ``sparsify``) carries a *reserve*: the cheapest lossless option of the same
priced options (offload, a recompute, keep, compress: each planned at bytes its values cannot change)
that keeps no more bytes and has no more back in backward, so every peak the plan predicts holds
whether or not the run switches to it (`reserve.py` switches where real data break a lossy bound). A
lossy option with no such reserve is not offered; a module fixed to one by hand keeps it without.

An output head (`head_loss`) profiled with its loss has two kinds of choice: ``keep``, whose
transient is the whole logits (in forward and their gradient in backward), and ``chunk`` at the
largest slice and its halvings, which keep the head's input and hold one slice in backward.

Offload is priced by a bandwidth model: each direction moves the module's bytes at the device-host
bandwidth. With a copy stream (accelerators) a direction costs only what its copy takes beyond the
compute it overlaps (the module's forward for the copy out, its backward, taken as twice the
forward, for the copy back); without one (CPU) both copies add in full.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from xirang_ds.config.types import format_bytes
from xirang_ds.plugins.activations.config import LOSSY_ACTIVATION_OPTIONS
from xirang_ds.plugins.activations.profile import ModuleProfile
from xirang_ds.plugins.activations.tiled import tile_count

RECOMPUTE_OVERHEAD_S = 50e-6
"""Fixed cost of one checkpointed call (saving RNG state, the checkpoint frame)."""
LOSSY_PENALTY_S = 1e-6
"""Added to lossy options so that a lossless option of the same cost wins."""


@dataclass(frozen=True)
class Choice:
    """One option for one module.

    Attributes:
        option: the option's name.
        device_bytes: bytes kept on the device from the module's forward to its backward.
        added_s: seconds added per pass.
        transient_bytes: bytes back on the device while the module's backward runs.
    """

    option: str
    device_bytes: int
    added_s: float
    transient_bytes: int = 0
    rows: int = 0
    """``chunk``: rows (tokens) per slice; ``recompute_tiled``: slices."""
    reserve: Optional["Choice"] = None
    """A lossy choice's lossless stand-in (`reserve_for`), taken at run time where real data break the bound."""

    def state(self) -> list:
        """The choice as checkpoints hold it (`from_state` reads it back)."""
        out = [self.option, self.device_bytes, self.added_s, self.transient_bytes, self.rows]
        return out + [self.reserve.state()] if self.reserve is not None else out

    @staticmethod
    def from_state(state: list) -> "Choice":
        """A `state` back; a checkpoint from before reserves (five fields) loads without one."""
        reserve = Choice.from_state(state[5]) if len(state) > 5 and state[5] else None
        return Choice(*state[:5], reserve=reserve)


@dataclass
class Node:
    """A candidate in the planning tree.

    Attributes:
        name: full module name.
        choices: what the module may do (one entry when fixed by hand; none: it must split).
        keep_bytes: its saved bytes when kept (its subtree's included).
        children: candidates inside it.
        fixed: True when the option was fixed by hand (the subtree is not split).
        order: position of its first call in forward.
    """

    name: str
    choices: list[Choice]
    keep_bytes: int
    children: list["Node"] = field(default_factory=list)
    fixed: bool = False
    order: int = 0


def transfer_s(nbytes: int, bandwidth_bps: float) -> float:
    return nbytes / bandwidth_bps if nbytes else 0.0


def option_costs(p: ModuleProfile, options: tuple[str, ...], tolerant: bool, bandwidth_bps: float,
                 streams: bool, prefetch: int = 1, token_wise: bool = False,
                 reserves_from: Optional[tuple[str, ...]] = None) -> list[Choice]:
    """The choices a module has, priced from its profile, each lossy one with its reserve (`reserve_for`).

    Args:
        p: the module's profile.
        options: the options allowed.
        tolerant: lossy options are allowed for this module.
        token_wise: ``recompute_tiled`` is allowed for this module (`tiled.py`).
        bandwidth_bps: device-host bytes per second.
        streams: copies overlap compute (a side stream exists).
        prefetch: offloaded modules fetched ahead in backward (with streams).
        reserves_from: a module fixed by hand: the options its lossy choice's reserve comes from, which it
            keeps without one where none fits (``None``: the reserve comes from ``options``, and a lossy
            choice with none is left out).
    """
    out = _priced(p, options, tolerant, bandwidth_bps, streams, prefetch, token_wise)
    pool = out if reserves_from is None else _priced(p, reserves_from, False, bandwidth_bps, streams, prefetch,
                                                     token_wise)
    with_reserves = []
    for c in out:
        if c.option in LOSSY_ACTIVATION_OPTIONS:
            reserve = reserve_for(c, pool)
            if reserve is None and reserves_from is None:
                continue
            c = replace(c, reserve=reserve)
        with_reserves.append(c)
    return with_reserves


def reserve_for(lossy: Choice, choices: list[Choice]) -> Optional[Choice]:
    """The cheapest lossless choice (by added time) among ``choices`` that keeps no more device bytes than
    ``lossy`` and has no more back in backward (kept plus transient), or ``None``: with it in place of
    ``lossy`` no point of the step holds more (`estimate_peak`), whichever modules switch."""
    fits = [c for c in choices if c.option not in LOSSY_ACTIVATION_OPTIONS and c.device_bytes <= lossy.device_bytes
            and c.device_bytes + c.transient_bytes <= lossy.device_bytes + lossy.transient_bytes]
    return min(fits, key=lambda c: (c.added_s, c.device_bytes + c.transient_bytes), default=None)


def _priced(p: ModuleProfile, options: tuple[str, ...], tolerant: bool, bandwidth_bps: float, streams: bool,
            prefetch: int, token_wise: bool) -> list[Choice]:
    """`option_costs` without reserves."""
    calls = max(p.calls, 1)
    out = []
    if p.chunk_calls:  # an output head: its profile holds the loss too, which only chunk changes
        options = tuple(o for o in options if o in ("keep", "chunk"))
    if p.compiled:  # nothing inside compiled code: no per-op choice, its one backward node unpacks all
        options = tuple(o for o in options if o not in ("selective_recompute", "chunk"))

    def offload_s(nbytes: int) -> float:
        t = transfer_s(nbytes, bandwidth_bps)
        if not streams:
            return 2 * t
        return max(0.0, t - p.time_s) + max(0.0, t - 2 * p.time_s)

    # Restored on demand, storage by storage, each held from the first node that needs it to the last
    # (`saved_nodes.restore_peak`); a profile without that figure (recorded before it was) takes about two
    # storages at a time. A copy stream instead fetches whole modules ahead (this one and the
    # ``prefetch`` next).
    on_demand = p.saved_bytes if p.compiled else \
        min(p.saved_bytes, p.restore_bytes or 2 * p.largest_bytes)
    fetched = p.saved_bytes * (1 + prefetch) if streams else on_demand
    for option in options:
        if option in ("quantize", "sparsify") and not tolerant:
            continue
        if option == "keep":
            out.append(Choice("keep", p.keep_bytes, 0.0, p.keep_transient_bytes))
        elif option == "recompute":
            out.append(Choice(option, p.input_bytes, p.time_s + calls * RECOMPUTE_OVERHEAD_S,
                              max(0, p.keep_bytes - p.input_bytes)))
        elif option == "selective_recompute":
            kept = p.input_bytes + p.selective_bytes
            out.append(Choice(option, kept, p.selective_time_s + calls * RECOMPUTE_OVERHEAD_S,
                              max(0, p.keep_bytes - kept)))
        elif option in ("recompute_tiled", "recompute_tiled_offload"):
            # a slice's intermediates at a time (`tiled.tile_count` slices, carried in ``rows``), token-wise
            # modules only; each slice costs a recomputation's overhead, so recompute wins where both fit;
            # with the inputs offloaded they come back for the module's backward, beside one slice
            if token_wise and not p.compiled:
                rebuilt = max(0, p.keep_bytes - p.input_bytes)
                tiles = tile_count(rebuilt, p.input_bytes)
                added = p.time_s + calls * (tiles + 1) * RECOMPUTE_OVERHEAD_S
                if option == "recompute_tiled":
                    out.append(Choice(option, p.input_bytes, added, -(-rebuilt // tiles), tiles))
                else:
                    out.append(Choice(option, 0, added + offload_s(p.input_bytes),
                                      p.input_bytes + -(-rebuilt // tiles), tiles))
        elif option == "recompute_offload":
            out.append(Choice(option, 0, p.time_s + calls * RECOMPUTE_OVERHEAD_S + offload_s(p.input_bytes),
                              p.keep_bytes))
        elif option == "chunk":
            # the logits made again slice by slice in backward (the head's forward again); smaller
            # slices hold less while their forward and backward run and cost a slice's overhead more each
            for rows in chunk_rows(p) if p.chunk_calls else ():
                slices = calls * math.ceil(p.chunk_tokens / rows)
                out.append(Choice(option, p.chunk_bytes, p.time_s + slices * RECOMPUTE_OVERHEAD_S,
                                  rows * max(p.chunk_row_bytes, p.chunk_forward_row_bytes), rows))
        elif option == "offload":
            out.append(Choice(option, p.small_bytes, offload_s(p.saved_bytes), fetched))
        else:  # compress, quantize, sparsify: decoded on demand, next to the payload
            nbytes = getattr(p, f"{option}_bytes")
            penalty = LOSSY_PENALTY_S if option != "compress" else 0.0
            out.append(Choice(option, p.small_bytes + nbytes, getattr(p, f"{option}_time_s") + penalty,
                              on_demand))
    return out


def chunk_rows(p: ModuleProfile, smallest: int = 16, count: int = 8) -> list[int]:
    """Slice sizes a chunked head may take: the largest (`ModuleProfile.chunk_rows`), then halved
    down to ``smallest`` rows, at most ``count`` of them; only the largest when fixed."""
    rows = [max(1, min(p.chunk_rows, p.chunk_tokens))]
    while not p.chunk_fixed and len(rows) < count and rows[-1] // 2 >= smallest:
        rows.append(rows[-1] // 2)
    return rows


# ------------------------------------------------------------------------------------------------
# dynamic programming over positions in forward order


@dataclass(frozen=True)
class _Move:
    """A transition from position ``start`` to ``end`` taking ``choice`` for ``node``."""

    start: int
    end: int
    node: Optional[Node]
    choice: Choice


def _moves(roots: list[Node]) -> tuple[list[_Move], int]:
    """Positions and transitions of the tree in forward order."""
    moves: list[_Move] = []
    count = 0

    def visit(node: Node) -> None:
        nonlocal count
        start = count
        if node.children and not node.fixed:
            own = max(0, node.keep_bytes - sum(c.keep_bytes for c in node.children))
            moves.append(_Move(start, start + 1, None, Choice("keep", own, 0.0, 0)))  # its own tensors, if split
            count += 1
            for child in sorted(node.children, key=lambda c: c.order):
                visit(child)
        else:
            count += 1
        moves.extend(_Move(start, count, node, c) for c in node.choices)

    for root in sorted(roots, key=lambda r: r.order):
        visit(root)
    return moves, count


def _units(nbytes: int, quantum: float) -> int:
    return int(math.ceil(nbytes / quantum - 1e-9)) if nbytes > 0 else 0


def _solve(roots: list[Node], budget_bytes: int, before: int, after: int, resolution: int
           ) -> Optional[tuple[float, dict[str, Choice]]]:
    """The cheapest plan under the model, or ``None`` when none fits."""
    moves, positions = _moves(roots)
    k = resolution
    quantum = max(budget_bytes, 1) / k
    start = _units(before, quantum)
    if start > k:
        return None
    cost = np.full((positions + 1, k + 1), np.inf)
    back_b = np.zeros((positions + 1, k + 1), dtype=np.int64)
    back_m = np.full((positions + 1, k + 1), -1, dtype=np.int64)
    cost[0, start] = 0.0
    by_start: dict[int, list[int]] = {}
    for i, m in enumerate(moves):
        by_start.setdefault(m.start, []).append(i)
    idx = np.arange(k + 1)
    for pos in range(positions):
        row = cost[pos]
        if not np.isfinite(row).any():
            continue
        for i in by_start.get(pos, ()):
            m = moves[i]
            d = _units(m.choice.device_bytes, quantum)
            t = _units(m.choice.transient_bytes, quantum)
            top = k - d - t  # highest K before this module that leaves room for its backward
            if top < 0:
                continue
            cand = row[:top + 1] + m.choice.added_s
            target = cost[m.end, d:d + top + 1]
            better = cand < target
            if better.any():
                cost[m.end, d:d + top + 1] = np.where(better, cand, target)
                back_b[m.end, d:d + top + 1] = np.where(better, idx[:top + 1], back_b[m.end, d:d + top + 1])
                back_m[m.end, d:d + top + 1] = np.where(better, i, back_m[m.end, d:d + top + 1])
    last = k - _units(after, quantum)
    if last < 0 or not np.isfinite(cost[positions, :last + 1]).any():
        return None
    b = int(np.argmin(cost[positions, :last + 1]))
    total = float(cost[positions, b])
    out: dict[str, Choice] = {}
    pos = positions
    while pos > 0:
        m = moves[int(back_m[pos, b])]
        if m.node is not None:
            out[m.node.name] = m.choice
        b, pos = int(back_b[pos, b]), m.start
    return total, out


def estimate_peak(roots: list[Node], choices: dict[str, Choice], before: int, after: int) -> tuple[int, int]:
    """``(end of forward, worst point of backward)`` device bytes of saved activations for a plan,
    under the module docstring's model."""
    kept, worst = before, 0

    def visit(node: Node) -> None:
        nonlocal kept, worst
        choice = choices.get(node.name)
        if choice is not None:
            kept += choice.device_bytes
            worst = max(worst, kept + choice.transient_bytes)
        elif node.children and not node.fixed:
            kept += max(0, node.keep_bytes - sum(c.keep_bytes for c in node.children))
            for child in sorted(node.children, key=lambda c: c.order):
                visit(child)
        else:
            kept += node.keep_bytes
        worst = max(worst, kept)

    for root in sorted(roots, key=lambda r: r.order):
        visit(root)
    return kept + after, max(worst, kept + after)


class BudgetError(ValueError):
    """The budget is below what any plan reaches.

    Attributes:
        least_bytes: the smallest budget any plan fits (within the planner's rounding).
    """

    def __init__(self, least_bytes: int, budget_bytes: int):
        self.least_bytes, self.budget_bytes = least_bytes, budget_bytes
        super().__init__(f"budget {format_bytes(budget_bytes)} is below the least any plan needs "
                         f"({format_bytes(least_bytes)})")


def least_budget(roots: list[Node], before: int, after: int, resolution: int = 256) -> int:
    """The smallest budget some plan fits (bisection over the model's feasibility)."""
    high = before + after + sum(max([c.device_bytes + c.transient_bytes for c in _all_choices(r)] + [r.keep_bytes])
                                for r in roots) + 1
    low = 0
    while high - low > max(1, high // 1000):
        mid = (low + high) // 2
        if _solve(roots, mid, before, after, resolution) is None:
            low = mid
        else:
            high = mid
    return high


def _all_choices(node: Node) -> list[Choice]:
    out = list(node.choices)
    for c in node.children:
        out.extend(_all_choices(c))
    return out


def plan(roots: list[Node], budget_bytes: int, before: int = 0, after: int = 0,
         resolution: int = 1024) -> dict[str, Choice]:
    """The cheapest choices (by added time) that fit ``budget_bytes`` at every point of the step.

    Args:
        roots: top-level candidates (each with its subtree).
        budget_bytes: device bytes of saved activations allowed.
        before, after: bytes saved before the first and after the last candidate (always kept).
        resolution: byte quanta of the budget (bytes are rounded up, so the plan always fits).

    Returns:
        ``{module name: Choice}`` for the modules that take an option (covered children omitted).

    Raises:
        BudgetError: no plan fits.
    """
    for r in (resolution, 4 * resolution):
        found = _solve(roots, budget_bytes, before, after, r)
        if found is not None:
            return found[1]
    raise BudgetError(least_budget(roots, before, after), budget_bytes)


def format_plan(choices: dict[str, Choice], profiles: dict[str, ModuleProfile], budget_bytes: Optional[int],
                outside_bytes: int, peaks: Optional[tuple[int, int]] = None) -> str:
    """The plan as a table: module, option, bytes saved, kept, back during backward, added time."""
    rows = [("module", "option", "saved", "kept", "in backward", "added (est.)")]
    total_keep = total_kept = 0
    total_s = 0.0
    for name in sorted(choices, key=_natural):
        c = choices[name]
        p = profiles.get(name)
        keep = p.keep_bytes if p is not None else 0
        unit = "slices" if c.option.startswith("recompute_tiled") else "rows"
        option = f"{c.option} ({c.rows} {unit})" if c.rows else c.option
        option += f", reserve {c.reserve.option}" if c.reserve is not None else ""
        rows.append((name, option, format_bytes(keep), format_bytes(c.device_bytes),
                     format_bytes(c.device_bytes + c.transient_bytes), f"{c.added_s * 1e3:.2f} ms"))
        total_keep += keep
        total_kept += c.device_bytes
        total_s += c.added_s
    rows.append(("(outside the candidates)", "keep", format_bytes(outside_bytes), format_bytes(outside_bytes), "",
                 "0.00 ms"))
    rows.append(("total", "", format_bytes(total_keep + outside_bytes), format_bytes(total_kept + outside_bytes), "",
                 f"{total_s * 1e3:.2f} ms"))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = ["  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1])] + [c.rjust(w) for c, w in zip(r[2:], widths[2:])])
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if peaks is not None:
        lines.append(f"planned saved activations: {format_bytes(peaks[0])} at the end of forward, "
                     f"{format_bytes(peaks[1])} at the worst point of backward")
    if budget_bytes is not None:
        lines.append(f"budget {format_bytes(budget_bytes)} of saved activations per rank")
    if any(c.reserve is not None for c in choices.values()):
        lines.append(f"with every reserve taken: adds {reserve_added_s(choices) * 1e3:.2f} ms, planned bytes as above "
                     "or fewer")
    return "\n".join(lines)


def reserve_added_s(choices: dict[str, Choice]) -> float:
    """Seconds the plan adds per pass were every lossy module switched to its reserve."""
    return sum((c.reserve or c).added_s for c in choices.values())


def plan_table(plan_: dict[str, str], choices: dict[str, Choice], profiles: dict[str, ModuleProfile],
               budget_bytes: Optional[int], outside_bytes: int, peaks: Optional[tuple[int, int]],
               errors_measured: bool = True) -> str:
    """What the plugin logs: the planner's table (`format_plan`), or the fixed plan one module per line; then
    each lossy option with the worst error profiling measured, as a fraction of its stated bound (a plan made
    before the run on a fake trace measured none: ``errors_measured`` false says so)."""
    if choices:
        text = format_plan(choices, profiles, budget_bytes, outside_bytes, peaks)
    else:
        text = "\n".join(f"{n}: {o}" for n, o in plan_.items()) or "(no module)"
    lossy = [(n, o, getattr(profiles[n], f"{o}_error")) for n, o in plan_.items()
             if o in LOSSY_ACTIVATION_OPTIONS and n in profiles]
    bare = [n for n, o in plan_.items() if o in LOSSY_ACTIVATION_OPTIONS and (n not in choices or
                                                                           choices[n].reserve is None)]
    if bare:
        why = ("fixed by hand, and no lossless option among the options holds its bytes" if choices
               else "a fixed plan without the planner prices none")
        text += (f"\nno lossless reserve for {', '.join(bare)} ({why}): a tensor there that breaks its bound stays "
                 "unencoded, above the plan")
    if lossy and not errors_measured:
        text += ("\nlossy (" + ", ".join(f"{n} {o}" for n, o, _ in lossy) + "): planned before the run, no error "
                 "measured; each value is within its stated bound by construction (docs/activations.md)")
    elif lossy:
        text += "\nlossy, worst error measured in profiling as a fraction of the stated bound: " + \
            ", ".join(f"{n} ({o}) {e:.2f}" for n, o, e in lossy)
    return text


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]
