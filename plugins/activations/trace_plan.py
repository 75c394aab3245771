"""The activation plan made before the run: profiled on the estimator's fake trace, planned by the same
functions as ever, so ``xirang-ds estimate`` and ``initialize`` hold one plan.

The estimator (`xirang_ds.planning.estimator`) traces one forward and backward of the model under
``FakeTensorMode`` (no memory, no data). While it does, `profile_trace` puts the plugin's own wrappers
on the candidates and runs one forward of its own, unmeasured, with a `Profiler` in force, exactly as a
profiling pass during training would, except that saved tensors stay as they are and no encoding runs: every encoding is priced at the size it has whatever the values
(`profile.planned_bytes`), every op by its counted FLOPs and bytes under the device profile. The
profiles of a fake pass and of a real one are the same figures.

`plan_phases` then plans under the budget, with what the rank needs besides saved activations taken
from the estimate's phases (model states, gradients, buffers, temporaries at their peak), and puts the
plan's saved-activation bytes into the phases in place of the keep-everything trace's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import ACTIVATIONS, COMM_BUFFERS, GRADIENTS, TEMPORARIES
from xirang_ds.memory.device_profile import DeviceProfile
from xirang_ds.memory.host_ledger import pins
from xirang_ds.plugins.activations import layer_temporaries
from xirang_ds.plugins.activations.head_loss import CHUNK
from xirang_ds.plugins.activations.planner import Choice, estimate_peak, least_budget, reserve_added_s
from xirang_ds.plugins.activations.pricing import build_tree, plan_within, reach
from xirang_ds.plugins.activations.profile import ROOT, ModuleProfile, Profiler
from xirang_ds.plugins.activations.storage import PayloadStorage
from xirang_ds.plugins.activations.wrapper import OFFLOADED_INPUTS, ModuleWrapper, Runtime

HOST = "host"
PLAN_ROUNDS = 4
"""Plans at most: each round adds to what the rest needs what the planned phases still peak above the budget."""


@dataclass
class TracePlan:
    """A plan made on the fake trace.

    Attributes:
        plan: ``{module: option}`` (keep included).
        choices: the planner's `Choice` per module.
        profiles: the fake pass's `ModuleProfile` per module.
        budget_bytes: the bytes saved activations may take.
        other_bytes: what the rank needs besides saved activations (the estimate's phases).
        planned_peaks: saved-activation bytes at the end of forward and at the worst point of backward.
        keep_bytes: saved-activation bytes with every tensor kept (the trace's own).
        least_bytes: the least saved-activation bytes any plan needs.
        added_s: the seconds the plan adds per forward and backward, under the device profile.
        device_profile: the profile that priced it.
        fits: whether a plan meets the budget.
        problems: the planner's refusal when none does.
        outside_bytes: saved bytes outside every candidate.
        reach: what the planner can reach on this model (`pricing.reach`).
        step_peak_bytes: the rank's whole predicted peak with this plan (the estimate's, set by the run that
            takes the plan: `run_plan`), which the monitor checks the run against.
        host_bytes: what the plan's offloads hold on the host (`offload_host_bytes`), its lossy modules' reserves
            taken.
        host_note: why the plan does without offload, where ``host_memory_budget`` made it (`plan_phases`).
        follows_memory_budget: the saved activations' budget is what ``memory_budget`` leaves them
            (`ActivationsConfig.follows_memory_budget`): a refusal then names what lowers the rest.
    """

    plan: dict[str, str] = field(default_factory=dict)
    choices: dict[str, Choice] = field(default_factory=dict)
    profiles: dict[str, ModuleProfile] = field(default_factory=dict)
    budget_bytes: Optional[int] = None
    other_bytes: int = 0
    planned_peaks: tuple[int, int] = (0, 0)
    keep_bytes: int = 0
    least_bytes: int = 0
    added_s: float = 0.0
    device_profile: Optional[DeviceProfile] = None
    fits: bool = True
    problems: list = field(default_factory=list)
    outside_bytes: int = 0
    reach: Optional[dict] = None
    step_peak_bytes: Optional[int] = None
    host_bytes: int = 0
    host_note: str = ""
    follows_memory_budget: bool = True

    @property
    def least_budget_bytes(self) -> int:
        """The least ``memory_budget`` some plan meets: what the rank needs besides saved activations and
        the least any plan saves."""
        return self.other_bytes + self.least_bytes

    def refusal(self, budget: Any, where: str, held: int = 0, fixes: str = "",
                least: Optional[int] = None) -> list[tuple[str, str]]:
        """The problems of a plan that does not fit, as the run (`run_plan`) and ``xirang-ds validate --model`` both
        say them: the planner's own, each with ``fixes`` (what the run's stepper can still lower, where the saved
        activations' budget follows ``memory_budget``: ``follows_memory_budget``), then the least budget
        (``least``: one an estimate at it confirmed, `xirang_ds.planning.suggest`; else the plan's own) and its
        parts; ``where`` names the batch, ``held`` what the user holds on the device (taken off ``budget`` before
        planning)."""
        held_text = f", {format_bytes(held)} of it held on the device besides the run" if held else ""
        stated = budget if budget == "auto" else format_bytes(int(budget))
        confirmed = f"{format_bytes(least + held)} ({least + held:,} bytes; an estimate at it fits)" if least else \
            format_bytes(self.least_budget_bytes + held)
        fixes = f"; or {fixes}" if fixes and self.follows_memory_budget else ""
        return [(key, f"{message}{fixes} ({where}; memory_budget {stated}"
                      f"{held_text}: the least budget that fits is {confirmed}; at this budget's settings "
                      f"{format_bytes(self.other_bytes)} besides saved activations, "
                      f"{format_bytes(self.least_bytes)} of them at least)")
                for key, message in self.problems]

    @property
    def reserves(self) -> dict[str, str]:
        """``{lossy module: its lossless reserve}`` (`planner.reserve_for`)."""
        return {n: c.reserve.option for n, c in sorted(self.choices.items()) if c.reserve is not None}

    def as_dict(self) -> dict:
        return {"plan": dict(sorted(self.plan.items())), "budget_bytes": self.budget_bytes,
                "other_bytes": self.other_bytes, "planned_peaks": list(self.planned_peaks),
                "keep_bytes": self.keep_bytes, "least_bytes": self.least_bytes,
                "least_budget_bytes": self.least_budget_bytes, "added_s": self.added_s, "fits": self.fits,
                "reserves": self.reserves, "reserve_added_s": reserve_added_s(self.choices), "host_bytes": self.host_bytes,
                "device_profile": self.device_profile.name if self.device_profile else None}


@contextlib.contextmanager
def profile_trace(plugin: Any, model: torch.nn.Module, tracker: Any, free: list[str], chunked: list[str],
                  profile: DeviceProfile) -> Iterator[None]:
    """The plugin's wrappers on the ``free`` candidates and the ``chunked`` heads (fixed to ``chunk``) of the
    fake ``model``, a profiling pass (saved tensors kept, nothing encoded) run before the first measured
    forward; ``plugin.trace_profiles`` holds the profiles afterwards."""
    c = plugin.config
    rt = Runtime(torch.device("cpu"), c.min_tensor_bytes, c.offload_prefetch, c.quantize_block_size,
                 c.sparsify_threshold, tracker.host_tier, lambda: tracker.scope(ACTIVATIONS))
    rt.eligible.fake = True
    rt.eligible.refresh(model)
    fixed = set(plugin._fixed.values())  # a lossy option fixed by hand is priced too, listed in options or not
    lossy = tuple(k for k in ("quantize", "sparsify") if k in plugin.options or k in fixed)
    rt.profiler = Profiler(rt.eligible, rt.keep_handler, PayloadStorage(), plugin.tolerant_names, lossy,
                           c.quantize_block_size, c.sparsify_threshold, profile)
    modules = dict(model.named_modules())
    wrappers = []
    for name in free + chunked:
        wrapper = ModuleWrapper(name, modules[name], rt)
        wrapper.head = plugin.path.defer if name in plugin.head_names or name in chunked else None
        wrapper.chunk_tokens = None if c.chunk_tokens == "auto" else int(c.chunk_tokens)
        if name in chunked:  # as the run has it: chunked while profiled and after
            wrapper.fixed_chunk = True
            wrapper.apply(CHUNK)
        wrappers.append(wrapper)
    passes = []

    def root(original: Any, *args: Any, **kwargs: Any) -> Any:
        if passes or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        passes.append(1)
        # a forward of its own, unmeasured: the pass's saved-tensor hooks would change when autograd frees
        # what it saved, and the trace measures the run as it will be, plain where modules keep
        with tracker.paused(), rt.profiler.run_pass():
            original(*args, **kwargs)
        return original(*args, **kwargs)

    heads = frozenset(n for n in free if n in plugin.head_names) | frozenset(chunked)
    watched, marks = layer_temporaries.watch(modules, [n for n in free if n not in heads], tracker, sorted(heads))
    entered: dict[str, int] = {}  # each head's forward start on the trace's clock

    def enter(name: str) -> None:
        if tracker.measuring:
            entered[name] = tracker.clock

    handles = [*plugin.path.head_hooks(model, heads), wrap_method(model, "forward", root), *watched,
               *(modules[n].register_forward_pre_hook(lambda m, a, n=n: enter(n)) for n in sorted(heads))]
    recording, tracker.record_backward_uses = tracker.record_backward_uses, True
    try:
        yield
    finally:
        tracker.record_backward_uses = recording
        for handle in handles:
            handle.remove()
        for wrapper in wrappers:
            wrapper.remove()
        plugin.trace_profiles = rt.profiler.combined()
        line = plugin.trace_layer_timeline = layer_temporaries.timeline(tracker, marks, c.min_tensor_bytes)
        plugin.trace_layer_temporaries = layer_temporaries.measure(line)
        plugin.trace_layer_temporaries_alone = layer_temporaries.measure(line, net_of_saved=False)
        plugin.trace_layer_returns = layer_temporaries.measure(line, restored=True)
        # the temporaries alive as each head's forward starts (the batch, a residual stream the model's forward
        # still holds), what the run saves for backward left out: a chunked head's slice stands beside them
        plugin.trace_head_entry = {name: sum(r.nbytes for r in tracker.live_records(at=clock)
                                             if not r.host and r.resolved_category() == TEMPORARIES)
                                   for name, clock in entered.items()}


def plan_phases(plugin: Any, phases: dict, free: list[str], fixed: dict[str, str], streams: bool,
                device_total: Optional[int], profile: DeviceProfile,
                made: Optional[TracePlan] = None) -> tuple[dict, TracePlan]:
    """Plan on the fake pass's profiles under the budget and put the plan's saved activations into
    ``phases`` (see the module docstring); ``device_total`` stands for ``memory_budget: auto``. With ``made`` (a plan
    of these profiles, made on other phases: the estimate's at the bound of what only the data decide), its choices
    are priced on ``phases`` instead of a plan made.

    With ``host_memory_budget`` in bytes, a plan whose offloads need more host than the other host tiers leave
    gives way to the plan without offloads where that one fits the device (said in `TracePlan.host_note`); else
    it stands, and the estimate and the run refuse it on the host's figure."""
    adjusted, out = _plan_phases(plugin, phases, free, fixed, streams, device_total, profile, plugin.options, made)
    if made is not None:
        return adjusted, out
    host_budget = plugin.session.config.host_memory_budget
    room = None if host_budget == "auto" else int(host_budget) - max(c.get(HOST, 0) for c in phases.values())
    kept_off = tuple(o for o in plugin.options if o != "offload" and o not in OFFLOADED_INPUTS)
    if room is not None and out.host_bytes > room and kept_off != tuple(plugin.options):
        adjusted_on_device, on_device = _plan_phases(plugin, phases, free, fixed, streams, device_total, profile,
                                                     kept_off)
        if on_device.fits and on_device.host_bytes <= room:
            on_device.host_note = (f"its offloads would take {out.host_bytes:,} bytes of host memory where "
                                   f"host_memory_budget leaves {max(room, 0):,}: planned without offload")
            return adjusted_on_device, on_device
    return adjusted, out


def _plan_phases(plugin: Any, phases: dict, free: list[str], fixed: dict[str, str], streams: bool,
                 device_total: Optional[int], profile: DeviceProfile, options: tuple,
                 made: Optional[TracePlan] = None) -> tuple[dict, TracePlan]:
    """`plan_phases` over the candidates' ``options`` (``made``'s choices where given)."""
    c = plugin.config
    profiles = plugin.trace_profiles
    tree = _tree(plugin, free, fixed, streams, profile, options)
    roots, before, after = tree
    keep = profiles.get(ROOT, ModuleProfile(ROOT)).keep_bytes
    # an output head's whole loss (logits, log-probabilities, their gradient) is the planner's to price
    # (the transient of its keep choice, or a slice's rows under chunk), as the run's measured peak
    # leaves it out (`pricing.OtherPeak.exclude`)
    transient = sum(profiles[n].keep_transient_bytes for n in free if n in plugin.head_names and n in profiles)
    other = max(_besides(cats, keep, transient) for cats in phases.values())
    out = TracePlan(profiles=profiles, other_bytes=other, keep_bytes=keep, device_profile=profile,
                    least_bytes=least_budget(roots, before, after), follows_memory_budget=c.follows_memory_budget)
    total = device_total if device_total is not None else other + keep  # unknown device: everything fits
    budget = plugin.session.config.memory_budget
    limit = total if budget == "auto" else int(budget)
    # the trace ran the free candidates kept (a head with its whole loss) and the fixed heads chunked: the plan
    # changes the phases' saved activations (and a head's transient) by what it saves against that
    traced = estimate_peak(roots, {**{n.name: k for n in roots if not n.fixed for k in n.choices if k.option == "keep"},
                                   **{n.name: n.choices[0] for n in _nodes(roots) if n.fixed and n.choices}},
                           before, after)
    # backward past its first gradient: a kept head's backward is over by then, its whole loss and what it and the
    # loss saved freed (that point is ``backward_start``'s), and each layer's backward holds the gradients of its
    # activations (the trace's `Trace.layer_temporaries`)
    heads = frozenset(plugin.head_names)
    most_temporaries = getattr(getattr(plugin.session, "trace", None), "layer_temporaries", 0)
    # each candidate's (`layer_temporaries`): net of the saved tensors its backward frees where the plan holds them
    # all until it ends, alone where they come back one by one (`on_demand`)
    own = getattr(plugin, "trace_layer_temporaries", None) or {}
    alone = getattr(plugin, "trace_layer_temporaries_alone", None) or {}
    # and beside its saved storages as they come back, one by one, where they do (`layer_temporaries.measure`)
    returns = getattr(plugin, "trace_layer_returns", None) or {}
    demand, packed = on_demand(streams), {name: p.saved_bytes for name, p in profiles.items()}
    inputs = getattr(getattr(plugin.session, "trace", None), "inputs", 0)
    # with the gradients held beside them, where a plugin holds them its way; else the engine's reduction buckets,
    # made by then
    held = _gradients_held(plugin)
    layer_held = _layer_gradients(plugin, held)
    # and where the plan chunks a head whose gradient then comes by rows (`estimate.head_rounds`)
    held_chunked = _gradients_held(plugin, "estimate_gradients_held_chunked")
    layer_held_chunked = _layer_gradients(plugin, held_chunked) if held_chunked is not None else layer_held
    buffers = 0 if held is not None else getattr(getattr(plugin.session, "trace", None), "layer_buffers", 0)
    rounds = getattr(plugin, "estimate_head_rounds", None) or {}  # `estimate.head_rounds`
    entry = getattr(plugin, "trace_head_entry", None) or {}  # `profile_trace`
    for _ in range(PLAN_ROUNDS):
        if made is not None:
            if not made.fits:
                return phases, made
            out.budget_bytes, out.choices = made.budget_bytes, made.choices
        else:
            try:
                out.budget_bytes, out.choices, _ = plan_within(c, budget, total, profiles, out.other_bytes, tree)
            except XirangConfigError as e:
                out.fits, out.problems, out.choices = False, list(e.problems), {}
                return phases, out
        out.planned_peaks = estimate_peak(roots, out.choices, before, after)
        # a head the plan chunks (the trace ran it whole) holds a slice in forward, after everything is saved, and
        # in backward a slice's, or a round of its weight's rows where the stepper takes them by rows
        chunked = {n: choice.rows for n, choice in out.choices.items()
                   if choice.option == CHUNK and n in heads and n in free}
        forward_slices = sum(rows * profiles[n].chunk_forward_row_bytes for n, rows in chunked.items())
        at_head = max((entry.get(n, 0) for n in chunked), default=0) + forward_slices  # beside all that is saved
        backward = {n: rounds[n](rows) for n, rows in chunked.items() if n in rounds}
        own_and_held, alone_and_held, returns_and_held = layer_held_chunked if backward else layer_held
        in_backward = estimate_peak(roots, {n: dataclasses.replace(choice, transient_bytes=backward[n])
                                            if n in backward else choice for n, choice in out.choices.items()},
                                    before, after)[1]
        saved_end, saved_worst = (max(0, t - p) for t, p in zip(traced, (out.planned_peaks[0], in_backward)))
        layers_worst = estimate_peak(roots, _past_heads(out.choices, heads, backward=backward), before, 0)[1]
        # the worst layer with its own temporaries (else the most any layer holds, beside the most saved)
        with_own = estimate_peak(roots, _past_heads(out.choices, heads, own, alone, demand, packed, returns, backward),
                                 before, 0)[1] if own else layers_worst + most_temporaries
        with_held = estimate_peak(roots, _past_heads(out.choices, heads, own_and_held, alone_and_held, demand, packed,
                                                     returns_and_held, backward),
                                  before, 0)[1] if own and own_and_held else None
        adjusted = {}
        for phase, cats in phases.items():
            cats = dict(cats)
            kept = cats.get(ACTIVATIONS, 0)
            if not kept:  # after backward freed the saved activations (grad_release's end, the step): unchanged
                adjusted[phase] = cats
                continue
            # forward peaks in the head's loss too (its whole logits beside what is saved): what the plan saves
            # at its worst point applies there as well
            saved, worst = (max(saved_end, saved_worst), out.planned_peaks[0]) if phase == "forward" else \
                (saved_worst, in_backward)
            if phase == "backward":  # what the plan saves there (a head's loss included), down to its worst layer
                worst = layers_worst
            # off the saved activations first, then off the temporaries, where the trace holds a head's whole loss
            at = {**cats, ACTIVATIONS: max(kept - saved, min(kept, worst))}
            at[TEMPORARIES] = max(0, cats.get(TEMPORARIES, 0) - (saved - (kept - at[ACTIVATIONS])))
            if phase == "forward":
                at[TEMPORARIES] = max(at[TEMPORARIES] + forward_slices, at_head)
            if phase == "backward" and saved:
                # the plan moves backward's worst point from the trace's into a layer: there, its gradient
                # temporaries beside what the plan keeps (and brings back) up to that layer
                # (and the batch, which the layers' temporaries leave out)
                layer = {**cats, ACTIVATIONS: worst, TEMPORARIES: max(0, with_own - worst) + inputs}
                if with_held is not None:  # its gradients at the worst layer in place of those at the trace's peak
                    layer[GRADIENTS] = max(0, with_held - with_own)
                # the engine's reduction buckets, which a trace that peaks before its first gradient has not
                layer[COMM_BUFFERS] = max(cats.get(COMM_BUFFERS, 0), buffers)
                at = max(at, layer, key=lambda c: sum(v for k, v in c.items() if k != HOST))
            adjusted[phase] = at
        # the rest was taken at its own peaks with the heads' whole loss left out: where the planned phases still
        # peak above the budget, what the rest needs is that much more, and the planner plans again
        over = max(sum(v for k, v in cats.items() if k != HOST) for cats in adjusted.values()) - limit
        if over <= 0 or c.budget != "auto" or made is not None:
            break
        # the next plan's saved activations at least ``over`` below this one's (the planner leaves slack)
        out.other_bytes = max(out.other_bytes + over, limit - (max(out.planned_peaks) - over))
    out.plan = {name: choice.option for name, choice in out.choices.items()}
    # a lossy module whose bound is exceeded switches to its reserve (`reserve_for`): the host covers that too
    out.host_bytes = offload_host_bytes({**out.plan, **out.reserves}, profiles, pins(streams, profile))
    for cats in adjusted.values():  # the offload pool's buffers, kept for the next step (`storage.HostPool`)
        cats[HOST] = cats.get(HOST, 0) + out.host_bytes
    out.outside_bytes = before + after
    out.reach = reach(roots, before, after, out.other_bytes, profiles, out.choices, plugin.head_names,
                      out.budget_bytes)
    out.added_s = sum(choice.added_s for choice in out.choices.values())
    return adjusted, out


def offload_host_bytes(plan: dict[str, str], profiles: dict[str, ModuleProfile], pinned: bool) -> int:
    """The host bytes ``plan``'s offloads hold at the end of forward, when every offloaded storage is on the host:
    each in its pool buffer (`ModuleProfile.host_bytes`; its block where ``pinned``), a module's saved storages for
    ``offload``, its inputs for the ``*_offload`` recomputes."""
    total = 0
    for name, option in plan.items():
        p = profiles.get(name)
        if p is None:
            continue
        if option == "offload":
            total += p.pinned_host_bytes if pinned else p.host_bytes
        elif option in OFFLOADED_INPUTS:
            total += p.input_pinned_host_bytes if pinned else p.input_host_bytes
    return total


def _gradients_held(plugin: Any, name: str = "estimate_gradients_held") -> Optional[Callable[[list[int]], int]]:
    """The ``estimate_gradients_held`` of the session's plugin that holds gradients its own way (the bytes once the
    trace's gradients so far are taken, `xirang_ds.memory.trace.Trace.arrived`), or None: the engine holds them;
    ``estimate_gradients_held_chunked``: the same where the plan chunks a head it then takes by rows."""
    return next((getattr(p, name) for p in plugin.session.plugins if getattr(p, name, None) is not None), None)


def _layer_gradients(plugin: Any, held: Optional[Callable[[list[int]], int]]) -> tuple[dict[str, int], ...]:
    """Each candidate's most bytes at once while its backward runs, its temporaries and the gradients ``held``
    (`_gradients_held`) beside them, net of the saved tensors it frees, not, and with its saved storages as they
    come back one by one (`layer_temporaries.measure`); empty where no plugin holds gradients its own way."""
    trace = getattr(plugin.session, "trace", None)
    line = getattr(plugin, "trace_layer_timeline", None)
    if held is None or trace is None or line is None or not getattr(trace, "grad_arrivals", None):
        return {}, {}, {}
    changes = [clock for arrivals in trace.grad_arrivals for clock, _ in arrivals]
    cache: dict[tuple, int] = {}

    def at(clock: int) -> int:
        arrived = tuple(trace.arrived(clock))
        if arrived not in cache:
            cache[arrived] = held(list(arrived))
        return cache[arrived]

    return (layer_temporaries.measure(line, at, changes),
            layer_temporaries.measure(line, at, changes, net_of_saved=False),
            layer_temporaries.measure(line, at, changes, restored=True))


def _past_heads(choices: dict, heads: frozenset, own: Optional[dict] = None, alone: Optional[dict] = None,
                demand: frozenset = frozenset(), saved: Optional[dict] = None, returns: Optional[dict] = None,
                backward: Optional[dict] = None) -> dict:
    """``choices`` past the first gradient: a kept head (last in forward, first in backward, its gradients made at
    the end of its backward) holds nothing there any more; with ``own``, each other candidate's backward holds
    its own temporaries beside what it brings back. Where its option is in ``demand`` (what comes back, one by
    one, is at most its transient and at most what it saved, ``saved``), the least of: ``alone``'s temporaries
    beside its transient at its most, ``own``'s beside everything it saved, and with ``returns`` the most of its
    temporaries and its storages as they come back together, each at its own moment (each an upper bound; the
    last is the figure where the trace reads every storage it brings back, and never below its transient, the
    most it brings back at once, which a storage no op of the trace read would leave out). ``backward``: a
    chunked head's own figure there, where it is not its choice's (a round of its weight's rows)."""
    own, alone, saved, returns, backward = own or {}, alone or {}, saved or {}, returns or {}, backward or {}

    def held(name: str, choice: Any) -> int:
        if choice.option not in demand:
            return backward.get(name, choice.transient_bytes) + own.get(name, 0)
        return min(choice.transient_bytes + alone.get(name, 0),
                   max(choice.transient_bytes, saved.get(name, 0)) + own.get(name, 0),
                   max(returns.get(name, math.inf), choice.transient_bytes))

    return {name: dataclasses.replace(choice, device_bytes=0, transient_bytes=0)
            if name in heads and choice.option == "keep" else
            dataclasses.replace(choice, transient_bytes=held(name, choice))
            for name, choice in choices.items()}


def on_demand(streams: bool) -> frozenset:
    """The options whose saved tensors come back one by one in backward, each as its nodes need it
    (`planner.option_costs` prices them at their most at once): the encodings, and offload without a copy
    stream (with one, a module's come back whole, ahead)."""
    return frozenset({"compress", "quantize", "sparsify"} | (set() if streams else {"offload"}))


def _nodes(roots: list) -> Iterator[Any]:
    for node in roots:
        yield node
        yield from _nodes(node.children)


def _tree(plugin: Any, free: list[str], fixed: dict[str, str], streams: bool, profile: DeviceProfile,
          options: Optional[tuple] = None) -> tuple:
    c = plugin.config
    bandwidth = c.host_bandwidth_gbps * 1e9 if c.host_bandwidth_gbps != "auto" else profile.host_link_bytes_per_s
    return build_tree(free, fixed, plugin.trace_profiles, tuple(plugin.options if options is None else options),
                      plugin.tolerant_names, bandwidth, streams, c.offload_prefetch, plugin.token_wise_names)


def least_saved(plugin: Any, free: list[str], fixed: dict[str, str], profile: DeviceProfile) -> tuple[int, int]:
    """``(keep-all, least)`` saved-activation bytes on the trace's profiles."""
    roots, before, after = _tree(plugin, free, fixed, False, profile)
    keep = plugin.trace_profiles.get(ROOT, ModuleProfile(ROOT)).keep_bytes
    return keep, least_budget(roots, before, after)


def _besides(cats: dict, keep: int, transient: int) -> int:
    """A phase's device bytes besides the saved activations it holds (at most ``keep``) and besides the
    heads' whole-loss ``transient`` (at most what it holds beyond them: activations and temporaries)."""
    device = sum(v for k, v in cats.items() if k != HOST)
    saved = min(keep, cats.get(ACTIVATIONS, 0))
    loose = cats.get(ACTIVATIONS, 0) - saved + cats.get(TEMPORARIES, 0)
    return device - saved - min(loose, transient)


def describe(result: TracePlan) -> str:
    """One line for the estimate's notes."""
    if not result.fits:
        return (f"no activation plan fits: the least memory_budget any plan meets is "
                f"{format_bytes(result.least_budget_bytes)} ({format_bytes(result.other_bytes)} besides saved "
                f"activations, {format_bytes(result.least_bytes)} of them at least)")
    counts: dict[str, int] = {}
    for option in result.plan.values():
        counts[option] = counts.get(option, 0) + 1
    end, worst = result.planned_peaks
    return (f"planned before the run ({result.device_profile.name} profile"
            + (f"; {result.host_note}" if result.host_note else "") + "): "
            + ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
            + f"; {format_bytes(max(end, worst))} of saved activations at most (keep-all "
              f"{format_bytes(result.keep_bytes)}, budget {format_bytes(result.budget_bytes or 0)}), "
              f"adds {result.added_s * 1e3:.1f} ms per micro-step"
            + (f" ({reserve_added_s(result.choices) * 1e3:.1f} ms with the lossy modules' lossless reserves: "
               + ", ".join(f"{n} {o}" for n, o in result.reserves.items()) + ")" if result.reserves else ""))


__all__ = ["TracePlan", "describe", "least_saved", "plan_phases", "profile_trace"]
