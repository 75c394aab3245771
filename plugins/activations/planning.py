"""From profiles to a plan: ranks agree on the measurements, the tree of candidates and fixed
modules is priced, and the budget is resolved."""
from __future__ import annotations

from typing import Optional

import torch

from xirang_ds.config.schema import ActivationsConfig
from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.plugins.activations.planner import BudgetError, Choice, Node, option_costs, plan
from xirang_ds.plugins.activations.profile import ROOT, ModuleProfile

_FIELDS = ("calls", "saved_bytes", "small_bytes", "input_bytes", "time_s", "selective_bytes", "selective_time_s",
           "compress_bytes", "compress_time_s", "quantize_bytes", "quantize_time_s", "quantize_error",
           "sparsify_bytes", "sparsify_time_s", "sparsify_error")
PATH = "xirang.activations"


def agree(profiles: dict[str, ModuleProfile], extras: list[float], device: torch.device) -> list[float]:
    """Make every rank hold the same profiles: the maximum of every figure over ranks (one
    ``all_reduce``), so all ranks plan alike. ``extras`` are reduced with them and returned."""
    import deepspeed.comm as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return extras
    names = sorted(profiles)
    values = [float(getattr(profiles[n], f)) for n in names for f in _FIELDS] + [float(x) for x in extras]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = t.tolist()
    i = 0
    for n in names:
        for f in _FIELDS:
            value = out[i]
            setattr(profiles[n], f, int(value) if isinstance(getattr(profiles[n], f), int) else value)
            i += 1
    return out[i:]


def _inside(name: str, ancestor: str) -> bool:
    return name.startswith(ancestor + ".")


def build_tree(candidates: list[str], fixed: dict[str, str], profiles: dict[str, ModuleProfile],
               options: tuple[str, ...], tolerant: frozenset, bandwidth_bps: float, streams: bool
               ) -> tuple[list[Node], int]:
    """Planning nodes (candidates and fixed modules) and the saved bytes outside all of them.

    A fixed module is a node with its one option; candidates inside it are dropped (it covers
    them); a candidate with a fixed module inside it can only leave the choice to its children.
    """
    names = list(fixed)
    for name in candidates:
        if name not in fixed and not any(_inside(name, f) for f in fixed):
            names.append(name)
    empty = ModuleProfile("")
    nodes: dict[str, Node] = {}
    for name in names:
        p = profiles.get(name, empty)
        if name in fixed:
            choices = option_costs(p, (fixed[name],), True, bandwidth_bps, streams)
        elif any(_inside(f, name) for f in fixed):
            choices = []
        else:
            choices = option_costs(p, options, name in tolerant, bandwidth_bps, streams)
        nodes[name] = Node(name, choices, p.keep_bytes, fixed=name in fixed)
    roots = []
    for name in sorted(nodes, key=len):
        parents = [n for n in nodes if _inside(name, n)]
        if parents:
            nodes[max(parents, key=len)].children.append(nodes[name])
        else:
            roots.append(nodes[name])
    for node in nodes.values():
        node.children.sort(key=lambda c: names.index(c.name))
    roots.sort(key=lambda c: names.index(c.name))
    root = profiles.get(ROOT, empty)
    outside = max(0, root.keep_bytes - sum(r.keep_bytes for r in roots))
    return roots, outside


def resolve_budget(config: ActivationsConfig, memory_budget: object, device_total: int, profiles: dict,
                   other_peak: Optional[int]) -> int:
    """Device bytes the saved activations may take per rank.

    Raises:
        XirangConfigError: ``memory_budget`` is below what the rank needs besides activations.
    """
    if config.budget_fraction is not None:
        return int(config.budget_fraction * profiles.get(ROOT, ModuleProfile("")).keep_bytes)
    if config.budget != "auto":
        return int(config.budget)
    total = device_total if memory_budget == "auto" else int(memory_budget)
    other = other_peak or 0
    if total <= other:
        raise XirangConfigError([("xirang.memory_budget",
                                  f"{format_bytes(total)} is below what this rank needs besides saved activations "
                                  f"({format_bytes(other)} at the peak of the profiling passes: model states, "
                                  "gradients, communication buffers, temporaries); raise it, or set "
                                  f"{PATH}.budget to the bytes activations may take")])
    return total - other


def choose(roots: list[Node], budget_bytes: int, outside_bytes: int) -> dict[str, Choice]:
    """The plan; a budget no plan reaches is a configuration error naming the figures."""
    try:
        return plan(roots, budget_bytes - outside_bytes)
    except BudgetError as e:
        least = e.least_bytes + outside_bytes
        raise XirangConfigError([(f"{PATH}.budget",
                                  f"{format_bytes(budget_bytes)} of saved activations is below the least any plan "
                                  f"keeps ({format_bytes(least)}: inputs kept by recompute, small tensors, and "
                                  f"{format_bytes(outside_bytes)} saved outside the candidates); raise the budget "
                                  "(or budget_fraction / memory_budget), or add candidates and options")]) from None
