"""The planner: per candidate module, the option that minimises added step time under a byte budget.

Costs per option come from the profile (`option_costs`): device bytes the module keeps at the end
of forward, and seconds added to a training step. Candidates form a tree (``blocks.3`` contains
``blocks.3.mlp``): a node either takes one option for its whole subtree or leaves the choice to its
children and keeps its own remaining tensors. The choice is a multiple-choice knapsack over that
tree, solved exactly by dynamic programming over bytes rounded up to ``budget / resolution`` (so a
plan found never exceeds the budget): each node's table gives the least added time for every byte
allowance, children's tables combine by min-plus convolution.

Offload is priced by a bandwidth model: each direction moves the module's bytes at the measured
device-host bandwidth. With a copy stream (accelerators) a direction costs only what its copy
takes beyond the compute it overlaps (the module's forward for the copy out, its backward, taken
as twice the forward, for the copy back); without one (CPU) both copies add in full.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from xirang_ds.config.types import format_bytes
from xirang_ds.plugins.activations.profile import ModuleProfile

RECOMPUTE_OVERHEAD_S = 50e-6
"""Fixed cost of one checkpointed call (saving RNG state, the checkpoint frame)."""
LOSSY_PENALTY_S = 1e-6
"""Added to lossy options so that a lossless option of the same cost wins."""


@dataclass(frozen=True)
class Choice:
    """One option for one module: device bytes kept at the end of forward, seconds added per pass."""

    option: str
    device_bytes: int
    added_s: float


@dataclass
class Node:
    """A candidate in the planning tree.

    Attributes:
        name: full module name.
        choices: what the module may do (one entry when fixed by hand).
        keep_bytes: its saved bytes when kept (its subtree's included).
        children: candidates inside it.
        fixed: True when the option was fixed by hand (the subtree is not split).
    """

    name: str
    choices: list[Choice]
    keep_bytes: int
    children: list["Node"] = field(default_factory=list)
    fixed: bool = False


def transfer_s(nbytes: int, bandwidth_bps: float) -> float:
    return nbytes / bandwidth_bps if nbytes else 0.0


def option_costs(p: ModuleProfile, options: tuple[str, ...], tolerant: bool, bandwidth_bps: float,
                 streams: bool) -> list[Choice]:
    """The choices a module has, priced from its profile.

    Args:
        p: the module's profile.
        options: the options allowed.
        tolerant: lossy options are allowed for this module.
        bandwidth_bps: device-host bytes per second.
        streams: copies overlap compute (a side stream exists).
    """
    calls = max(p.calls, 1)
    out = []

    def offload_s(nbytes: int) -> float:
        t = transfer_s(nbytes, bandwidth_bps)
        if not streams:
            return 2 * t
        return max(0.0, t - p.time_s) + max(0.0, t - 2 * p.time_s)

    for option in options:
        if option in ("quantize", "sparsify") and not tolerant:
            continue
        if option == "keep":
            out.append(Choice("keep", p.keep_bytes, 0.0))
        elif option == "recompute":
            out.append(Choice(option, p.input_bytes, p.time_s + calls * RECOMPUTE_OVERHEAD_S))
        elif option == "selective_recompute":
            out.append(Choice(option, p.input_bytes + p.selective_bytes,
                              p.selective_time_s + calls * RECOMPUTE_OVERHEAD_S))
        elif option == "recompute_offload":
            out.append(Choice(option, 0, p.time_s + calls * RECOMPUTE_OVERHEAD_S + offload_s(p.input_bytes)))
        elif option == "offload":
            out.append(Choice(option, p.small_bytes, offload_s(p.saved_bytes)))
        else:  # compress, quantize, sparsify
            nbytes = getattr(p, f"{option}_bytes")
            penalty = LOSSY_PENALTY_S if option != "compress" else 0.0
            out.append(Choice(option, p.small_bytes + nbytes, getattr(p, f"{option}_time_s") + penalty))
    return out


# ------------------------------------------------------------------------------------------------
# dynamic programming over the tree


class _Table:
    """Least added time for each byte allowance ``0..K`` (in quanta), and how to get it."""

    def __init__(self, cost: np.ndarray, how: list):
        self.cost = cost  # [K+1], non-increasing
        self.how = how    # how[b]: ("option", Choice) | ("split", [(child table, b_child)...])


def _units(nbytes: int, quantum: float) -> int:
    return int(math.ceil(nbytes / quantum - 1e-9)) if nbytes > 0 else 0


def _minplus(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``c[k] = min_j a[j] + b[k - j]`` and the argmin ``j`` (O(K) memory, K vector steps)."""
    n = len(a)
    c = np.full(n, np.inf)
    arg = np.zeros(n, dtype=np.int64)
    for j in np.nonzero(np.isfinite(a))[0]:
        cand = a[j] + b[:n - j]
        better = cand < c[j:]
        c[j:] = np.where(better, cand, c[j:])
        arg[j:] = np.where(better, j, arg[j:])
    return c, arg


def _solve(node: Node, quantum: float, k: int) -> _Table:
    best = np.full(k + 1, np.inf)
    how: list = [None] * (k + 1)
    for choice in node.choices:
        u = _units(choice.device_bytes, quantum)
        if u > k:
            continue
        better = choice.added_s < best[u:]
        best[u:] = np.where(better, choice.added_s, best[u:])
        for b in np.nonzero(better)[0]:
            how[u + b] = ("option", choice)
    if node.children and not node.fixed:
        tables = [_solve(c, quantum, k) for c in node.children]
        own = max(0, node.keep_bytes - sum(c.keep_bytes for c in node.children))
        acc, splits = tables[0].cost, []
        for t in tables[1:]:
            acc, arg = _minplus(acc, t.cost)
            splits.append(arg)
        shift = _units(own, quantum)
        if shift <= k:
            split_cost = np.full(k + 1, np.inf)
            split_cost[shift:] = acc[:k + 1 - shift]
            better = split_cost < best
            for b in np.nonzero(better)[0]:
                how[b] = ("split", (tables, splits, b - shift))
            best = np.where(better, split_cost, best)
    return _Table(best, how)


def _collect(table: _Table, b: int, out: dict[str, Choice], node: Node) -> None:
    kind, detail = table.how[b]
    if kind == "option":
        out[node.name] = detail
        return
    tables, splits, rest = detail
    allowances = [0] * len(tables)
    for i in range(len(tables) - 1, 0, -1):
        j = int(splits[i - 1][rest])
        allowances[i] = rest - j
        rest = j
    allowances[0] = rest
    for child, t, a in zip(node.children, tables, allowances):
        _collect(t, a, out, child)


class BudgetError(ValueError):
    """The budget is below what any plan reaches.

    Attributes:
        least_bytes: the fewest bytes any plan of the candidates keeps.
    """

    def __init__(self, least_bytes: int, budget_bytes: int):
        self.least_bytes, self.budget_bytes = least_bytes, budget_bytes
        super().__init__(f"budget {format_bytes(budget_bytes)} is below the least any plan keeps "
                         f"({format_bytes(least_bytes)})")


def least_bytes(node: Node) -> int:
    """The fewest device bytes any plan of ``node``'s subtree keeps."""
    own = min(c.device_bytes for c in node.choices) if node.choices else math.inf
    if node.children and not node.fixed:
        rest = max(0, node.keep_bytes - sum(c.keep_bytes for c in node.children))
        own = min(own, rest + sum(least_bytes(c) for c in node.children))
    return int(own)


def plan(roots: list[Node], budget_bytes: int, resolution: int = 1024) -> dict[str, Choice]:
    """The cheapest choices (by added time) whose bytes fit ``budget_bytes``.

    Args:
        roots: top-level candidates (each with its subtree).
        budget_bytes: device bytes the candidates may keep in total.
        resolution: byte quanta of the budget (bytes are rounded up, so the plan always fits).

    Returns:
        ``{module name: Choice}`` for the modules that take an option (covered children omitted).

    Raises:
        BudgetError: no plan fits.
    """
    least = sum(least_bytes(r) for r in roots)
    if budget_bytes < least:
        raise BudgetError(least, budget_bytes)
    if not roots:
        return {}
    total_keep = sum(r.keep_bytes for r in roots)
    k = resolution
    quantum = max(budget_bytes, 1) / k
    top = Node("", [], total_keep, children=roots)
    table = _solve(top, quantum, k)
    if not np.isfinite(table.cost[k]):
        # rounding made the tightest plans infeasible at this resolution: retry finer
        if resolution < 4096:
            return plan(roots, budget_bytes, resolution * 4)
        raise BudgetError(least, budget_bytes)
    out: dict[str, Choice] = {}
    _collect(table, k, out, top)
    return out


def format_plan(choices: dict[str, Choice], profiles: dict[str, ModuleProfile], budget_bytes: Optional[int],
                outside_bytes: int) -> str:
    """The plan as a table: module, option, bytes kept of bytes saved, estimated added time."""
    rows = [("module", "option", "saved", "kept", "added (est.)")]
    total_keep = total_kept = 0
    total_s = 0.0
    for name in sorted(choices, key=_natural):
        c = choices[name]
        p = profiles.get(name)
        keep = p.keep_bytes if p is not None else 0
        rows.append((name, c.option, format_bytes(keep) if p else "-", format_bytes(c.device_bytes) if p else "-",
                     f"{c.added_s * 1e3:.2f} ms" if p else "-"))
        total_keep += keep
        total_kept += c.device_bytes
        total_s += c.added_s
    rows.append(("(outside the candidates)", "keep", format_bytes(outside_bytes), format_bytes(outside_bytes), "0.00 ms"))
    rows.append(("total", "", format_bytes(total_keep + outside_bytes), format_bytes(total_kept + outside_bytes),
                 f"{total_s * 1e3:.2f} ms"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1])] + [c.rjust(w) for c, w in zip(r[2:], widths[2:])])
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if budget_bytes is not None:
        lines.append(f"budget {format_bytes(budget_bytes)} of saved activations per rank")
    return "\n".join(lines)


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]
