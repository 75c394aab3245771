"""The planner's inputs, priced from the profiles: ranks agree on the measurements, the tree of candidates
and fixed modules gets each option's cost, and the budget is resolved (`planner` then chooses)."""
from __future__ import annotations

import zlib
from typing import Any, Optional, Sequence

import torch

from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.memory.device_peak import device_peak
from xirang_ds.memory.engine_roles import model_state_bytes
from xirang_ds.memory.tracker import MemoryTracker
from xirang_ds.plugins.activations.config import LOSSY_ACTIVATION_OPTIONS, ActivationsConfig
from xirang_ds.plugins.activations.planner import BudgetError, Choice, Node, least_budget, option_costs, plan
from xirang_ds.plugins.activations.profile import ROOT, ModuleProfile

_FIELDS = ("calls", "before_bytes", "saved_bytes", "largest_bytes", "restore_bytes", "host_bytes", "pinned_host_bytes",
           "input_host_bytes", "input_pinned_host_bytes", "small_bytes", "input_bytes", "time_s", "selective_bytes", "selective_time_s",
           "compress_bytes", "compress_time_s", "quantize_bytes", "quantize_time_s", "quantize_error",
           "sparsify_bytes", "sparsify_time_s", "sparsify_error", "chunk_calls", "chunk_bytes", "chunk_tokens",
           "chunk_rows", "chunk_fixed", "chunk_row_bytes", "keep_transient_bytes", "compiled")
PATH = "xirang.activations"


def agree(profiles: dict[str, ModuleProfile], extras: list[float], device: torch.device,
          groups: Sequence[Any] = (None,)) -> list[float]:
    """Make every rank hold the same profiles: the maximum of every figure over ranks (one
    ``all_reduce`` per group in ``groups``; ``None`` is the default group), so all ranks plan alike.
    ``extras`` are reduced with them and returned.

    ``torch.distributed`` directly: under DeepSpeed ``deepspeed.comm`` runs on the same process group,
    and under Megatron it is not initialised at all."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return extras
    names = sorted(profiles)
    values = [float(getattr(profiles[n], f)) for n in names for f in _FIELDS] + [float(x) for x in extras]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    for group in groups:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    out = t.tolist()
    i = 0
    for n in names:
        for f in _FIELDS:
            value = out[i]
            setattr(profiles[n], f, int(value) if isinstance(getattr(profiles[n], f), int) else value)
            i += 1
    return out[i:]


def check_agreed(plan_: dict[str, str], device: torch.device,
                 groups: Sequence[Any] = (None,)) -> None:
    """Fail on every rank at once when the ranks of ``groups`` hold different plans.

    Recomputing a module re-issues its collectives (a row-parallel layer's all-reduce), so ranks
    with different plans would wait on each other forever in backward. The plans come from agreed
    profiles and are equal by construction; this check makes that a tested fact, not an assumption.

    Raises:
        RuntimeError: naming this rank's plan.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digest = float(zlib.crc32(repr(sorted(plan_.items())).encode()))
    spread = torch.tensor([digest, -digest], dtype=torch.float64, device=device)
    for group in groups:
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)
    if spread[0] != -spread[1]:  # the largest digest differs from the smallest
        raise RuntimeError(f"xirang activations: ranks planned differently (this rank: {plan_}); recomputation "
                           "would deadlock on the tensor-parallel collectives")


def _inside(name: str, ancestor: str) -> bool:
    return name.startswith(ancestor + ".")


def build_tree(candidates: list[str], fixed: dict[str, str], profiles: dict[str, ModuleProfile],
               options: tuple[str, ...], tolerant: frozenset, bandwidth_bps: float, streams: bool, prefetch: int = 1,
               token_wise: frozenset = frozenset()) -> tuple[list[Node], int, int]:
    """Planning nodes (candidates and fixed modules) and the saved bytes outside all of them, before
    the first candidate runs and after.

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
            reserves = tuple(o for o in options if name in token_wise or not o.startswith("recompute_tiled"))
            choices = option_costs(p, (fixed[name],), True, bandwidth_bps, streams, prefetch, True, reserves)
        elif any(_inside(f, name) for f in fixed):
            choices = []
        else:
            choices = option_costs(p, options, name in tolerant, bandwidth_bps, streams, prefetch, name in token_wise)
        nodes[name] = Node(name, choices, p.keep_bytes, fixed=name in fixed,
                           order=p.order if p.order >= 0 else len(profiles) + names.index(name))
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
    before = min(root.before_bytes, outside)
    return roots, before, outside - before


def resolve_budget(config: ActivationsConfig, memory_budget: object, device_total: int, profiles: dict,
                   other_peak: Optional[int], stepper: Any = None) -> int:
    """Device bytes the saved activations may take per rank.

    Args:
        stepper: the plugin that steps in backward (grad_release), whose ``budget_fixes()`` the error names.

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
        fix = stepper.budget_fixes() if stepper is not None else ""
        raise XirangConfigError([("xirang.memory_budget",
                                  f"{format_bytes(total)} is below what this rank needs besides saved activations "
                                  f"({format_bytes(other)} at its peak: model states, "
                                  "gradients, communication buffers, temporaries); raise it, or set "
                                  f"{PATH}.budget to the bytes activations may take{'; or ' + fix if fix else ''}")])
    return total - other


def choose(roots: list[Node], budget_bytes: int, before: int, after: int,
           region: Optional[str] = None, lossy: bool = False) -> dict[str, Choice]:
    """The plan; a budget no plan fits is a configuration error naming the figures.

    Args:
        region: how the whole model runs compiled (`compiled.compiled_region`), when it does: it is then
            one unit, whose saved tensors all come back at once in backward, and the error says so.
        lossy: lossy options are among the options (the error says when they are offered).
    """
    try:
        return plan(roots, budget_bytes, before, after)
    except BudgetError as e:
        fix = "raise the budget (or budget_fraction / memory_budget), or add candidates and options"
        if region is not None:
            fix = (f"{region}, so the model is one unit whose saved tensors all come back at once in its "
                   "backward; compile its repeated blocks instead of the whole model (torch.compile(block) "
                   "or block.compile() for each), which the planner then plans one by one, or " + fix)
        raise XirangConfigError([(f"{PATH}.budget",
                                  f"{format_bytes(budget_bytes)} of saved activations is below the least any plan "
                                  f"needs ({format_bytes(e.least_bytes)}: inputs kept by recompute, small tensors, "
                                  f"{format_bytes(before + after)} saved outside the candidates, and one module's "
                                  f"tensors back during its backward); {fix}"
                                  + ("; quantize and sparsify are offered only where a lossless option among the "
                                     "options (keep, offload, a recompute) holds no more bytes, their reserve"
                                     if lossy else ""))]) from None


def plan_within(config: ActivationsConfig, memory_budget: object, device_total: int, profiles: dict,
                other: Optional[int], tree: tuple[list[Node], int, int], region: Optional[str] = None,
                stepper: Any = None, parkable: int = 0) -> tuple[int, dict[str, Choice], Optional[int]]:
    """`resolve_budget`, then `choose` the plan under it: ``(budget bytes, plan, other)``.

    With a stepper whose optimizer states' tier is open (grad_release's ``states: auto``; ``parkable``: the
    device bytes they take beyond one bucket's), the plan with them on the device is tried first and, where
    none fits, the one with ``parkable`` bytes fewer besides activations; the stepper then keeps them where
    the plan taken assumed (`StatesTier.settle_tier`). ``other`` is measured with them in host memory where
    the stepper kept them there while profiling (``tier_pending``), and the figure returned is the plan's.
    """
    roots, before, after = tree
    pending = stepper is not None and stepper.tier_pending

    def attempt(rest: Optional[int]) -> tuple[int, dict[str, Choice], Optional[int]]:
        budget = resolve_budget(config, memory_budget, device_total, profiles, rest, stepper)
        lossy = any(o in LOSSY_ACTIVATION_OPTIONS for o in config.options)
        return budget, choose(roots, budget, before, after, region, lossy), rest

    open_tier = bool(parkable) and other is not None and config.follows_memory_budget
    on_device = other + parkable if open_tier and pending else other
    try:
        found = attempt(on_device)
    except XirangConfigError:
        if not open_tier:
            raise
        try:
            found = attempt(on_device - parkable)
        except XirangConfigError as e:  # said as it would be with the states off the device
            moved = (f"with grad_release's optimizer states in host memory ({format_bytes(parkable)} off the device; "
                     "states: auto)")
            raise XirangConfigError([(key, f"{moved}: {message}") for key, message in e.problems]) from None
        total = device_total if memory_budget == "auto" else int(memory_budget)
        stepper.settle_tier(True, f"no activation plan fits memory_budget {format_bytes(total)} with them on the "
                                  f"device, {format_bytes(parkable)} of them there; the plan's budget is "
                                  f"{format_bytes(found[0])}")
        return found
    if stepper is not None and pending:
        stepper.settle_tier(False)
    return found


def check_memory_budget(requested: object, engine: Any) -> None:
    """``memory_budget`` below the model states the rank already holds is an error at attach.

    Raises:
        XirangConfigError: with both figures.
    """
    if requested == "auto":
        return

    held = engine.model_state_bytes() if hasattr(engine, "model_state_bytes") else model_state_bytes(engine)
    if int(requested) < held:
        raise XirangConfigError([("xirang.memory_budget",
                                  f"{format_bytes(int(requested))} is below what this rank's model states already "
                                  f"take ({format_bytes(held)}: parameters, optimizer states, DeepSpeed's flat "
                                  "buffers); raise it or use \"auto\"")])


class OtherPeak:
    """The device peak of the profiling passes besides activations, when the budget is ``auto``: the
    session's tracker if it runs, else (CPU) a private tracker for the passes only, else (accelerators)
    a window on the allocator's ``max_memory_allocated`` opened now (`xirang_ds.memory.device_peak`).

    Args:
        session: the xirang session (its tracker).
        engine: the DeepSpeed engine or Megatron's ``MegatronRun`` (roles for a private tracker).
    """

    def __init__(self, session: Any, engine: Any):
        self._watch: Any = None
        self._window: Any = None
        self._peak = 0
        self._depth = 0
        tracker = session.tracker
        if torch.device(engine.device).type == "cpu":
            if not tracker.active:
                tracker = MemoryTracker()
                self._watch = (tracker, session.watch(tracker, engine))
                tracker.start()
            self._window = tracker.open_window()
        else:
            self._window = device_peak().open()

    def stop(self) -> int:
        """The peak since construction, less the stretches `exclude` left out; stops a private tracker."""
        peak = max(self._peak, self._window_peak()) if self._window is not None else self._peak
        self.close()
        return peak

    def _window_peak(self) -> int:
        """The window's peak besides activations where the tracker knows categories (CPU): saved tensors
        restored for backward during the passes are the planner's to price, not part of this peak;
        the allocator's peak of everything elsewhere."""
        return getattr(self._window, "besides_activations_peak", self._window.peak_bytes)

    def live_bytes(self) -> int:
        """Device bytes live now (0 once stopped)."""
        return self._window.live_bytes if self._window is not None else 0

    def exclude(self, begin: bool) -> None:
        """Begin or end a stretch the peak leaves out: an output head's whole loss, in forward and in
        backward, which the planner prices itself (the transient of the head's keep choice), so that
        a chunked head is not also charged the whole logits here; and the profiler's codec trials.
        Sound: what is live when the stretch begins is within the peak kept so far, and the peak
        restarts from what is live when it ends. Stretches nest (a trial inside the head's loss)."""
        if self._window is None:
            return
        self._depth += 1 if begin else -1
        if begin and self._depth == 1:
            self._peak = max(self._peak, self._window_peak())
        if self._depth == 0 or (begin and self._depth == 1):
            self._window.reset()

    def close(self) -> None:
        if self._window is not None:
            self._window.close()
            self._window = None
        if self._watch is not None:
            tracker, watch = self._watch
            self._watch = None
            tracker.stop()
            watch.remove()


def escalation(profiles: dict[str, ModuleProfile], plan_: dict[str, str], names: list[str],
               options: tuple[str, ...], tolerant: frozenset, bandwidth_bps: float, streams: bool
               ) -> Optional[tuple[str, Choice]]:
    """The kept module and option that free the most bytes per added second (monitor actions).

    Only modules that keep their tensors and contain no planned module qualify.
    """
    best: Optional[tuple[float, str, Choice]] = None
    for name in names:
        p = profiles.get(name)
        if p is None or plan_.get(name, "keep") != "keep":
            continue
        if any(_inside(name, other) and o != "keep" for other, o in plan_.items()):
            continue  # covered by a packing or recomputing module
        if any(_inside(other, name) for other in plan_ if other != name):
            continue  # its inside is planned module by module
        for c in option_costs(p, options, name in tolerant, bandwidth_bps, streams):
            freed = p.keep_bytes - c.device_bytes
            if freed > 0:
                score = freed / max(c.added_s, 1e-9)
                if best is None or score > best[0]:
                    best = (score, name, c)
    return None if best is None else (best[1], best[2])


def reach(roots: list[Node], before: int, after: int, other: Optional[int], profiles: dict[str, ModuleProfile],
          choices: dict[str, Choice], heads: frozenset, budget_bytes: Optional[int]) -> dict:
    """What the planner can reach on this model, per pass, for cost models (the tuner): the saved
    bytes with every candidate kept, the least any plan needs and the seconds that plan adds,
    the seconds the chosen plan adds, and the measured peak besides activations."""
    least = least_budget(roots, before, after)
    least_added = None
    for slack in (0, least // 100 + 1):  # the planner's coarser rounding may need a little more
        try:
            least_added = sum(c.added_s for c in plan(roots, least + slack, before, after).values())
            break
        except BudgetError:
            continue
    head_rows = {n: {"option": choices[n].option if n in choices else "keep",
                     "rows": choices[n].rows if n in choices else 0,
                     "keep_bytes": profiles[n].keep_bytes, "chunk_bytes": profiles[n].chunk_bytes}
                 for n in sorted(heads) if n in profiles and profiles[n].chunk_calls}
    return {"keep_bytes": profiles[ROOT].keep_bytes, "least_bytes": least, "least_added_s": least_added,
            "plan_added_s": sum(c.added_s for c in choices.values()), "budget_bytes": budget_bytes,
            "other_peak_bytes": other, "outside_bytes": before + after, "heads": head_rows}
