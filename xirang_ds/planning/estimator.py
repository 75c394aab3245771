"""Predict a rank's peak device memory before anything runs, with its breakdown by category.

Two parts:

* The model's own activations, temporaries and gradients come from a *fake trace*
  (`xirang_ds.memory.trace`): one forward and backward of the real model under ``FakeTensorMode``,
  measured by the same live-storage tracker that measures real runs, with DeepSpeed's gradient handling
  emulated. So the activation term is exact for any architecture, and the Korthikanti et al. formula is
  reported beside it for reference.
* Model states and the optimizer step are analytic, by ZeRO stage and dtype
  (`xirang_ds.memory.model_states`), following DeepSpeed's buffers and the optimizer implementation's
  temporaries.

What both read from the ds_config is a `RunShape` (`xirang_ds.memory.run_shape`). This module puts the
parts together into phases and lets the session's plugins adjust them. The peak is the largest of the
phases: forward, backward, optimizer step. ``recalibrate`` compares a measured `PeakReport` with the
estimate and returns per-category correction factors (`xirang_ds.planning.estimate_text`, with the table).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch

from xirang_ds.compat.torch import fake_tensor_mode
from xirang_ds.config.loader import BLOCK_KEY
from xirang_ds.config.types import format_bytes
from xirang_ds.memory.categories import CATEGORIES, COMM_BUFFERS, OPTIMIZER_STATES
from xirang_ds.memory.model_states import (
    BACKWARD_END,
    BACKWARD_START,
    STEP_PREPARE,
    adam_temporaries,
    add_categories,
    category_bytes,
    model_states,
    offloaded_optimizer_host,
    offloaded_params_host,
    optimizer_step,
    stage3_fetch_buffer,
    stage3_working_set,
)
from xirang_ds.memory.run_shape import (
    DEFAULT_ALLGATHER_BUCKET,
    DEFAULT_MAX_REUSE_DISTANCE,
    DEFAULT_PERSISTENCE_THRESHOLD,
    DEFAULT_PREFETCH_BUCKET,
    DEFAULT_REDUCE_BUCKET,
    DTYPE_BYTES,
    EstimateError,
    RunShape,
    fullest_rank,
    partition_numel,
)
from xirang_ds.memory.sweep import ENGINE, Sweep, most_beside, most_beside_point
from xirang_ds.memory.trace import Inputs, Trace, loss_of, trace_model
from xirang_ds.memory.zero3_fetch import Fetch, replay, traced_calls
from xirang_ds.memory.device_profile import PROFILES
from xirang_ds.planning.estimate_text import format_estimate, recalibrate
from xirang_ds.planning.fit import fit_block
from xirang_ds.planning.step_time import StepTime, step_time
from xirang_ds.planning.trace_cache import traced
from xirang_ds.roles import Estimates, PricesAtBound, ReshapesRun
from xirang_ds.session import Session


@dataclass
class Estimate:
    """A predicted per-rank peak and its breakdown.

    Attributes:
        predicted_peak_bytes: the largest phase, with every size only the data decide (a measured embedding's
            optimizer states) at what the data give where their check passes.
        bound_peak_bytes: the largest phase with those sizes at their bound, where it is above the predicted peak
            (else ``None``): the plans, ``fits`` and ``least_budget_bytes`` are made on it, so a run whose data keep
            them at their bound fits too (`xirang_ds.roles.PricesAtBound`).
        fits: whether the run fits ``memory_budget`` (or the device's memory where it is known; ``None``
            where neither is): a planner that finds no plan says no.
        least_budget_bytes: the least ``memory_budget`` the block as written meets (the activation
            planner's least plan beside the rest; without it, the predicted peak).
        plans: what plugins planned for this estimate, by section (the activation plan: `TracePlan`).
        by_category: bytes per category at the predicted peak.
        peak_phase: ``forward``, ``backward`` or ``optimizer_step``.
        phases: each phase's total and breakdown.
        notes: what the estimate assumed.
        korthikanti_activations: the paper's formula for a standard transformer, for reference.
        points: the points inside a phase that plugins adjusted on their own before the larger was taken
            (``backward_end``: grad_release's end of backward), with their breakdown and total.
        host_peak_bytes: what the host tiers hold at most over the phases (their ``host`` bytes, as the host
            ledger counts them: grad_release's states and stash, the activation plan's offloads), which
            ``host_memory_budget`` in bytes caps.
        host_refusal: why the host tiers do not fit ``host_memory_budget`` (`host_over_budget`), or ``None``; the
            estimate's notes say it, ``validate --model`` and the run refuse with it.
        device_fits: ``fits`` on the device alone (the plan and ``memory_budget``; ``None``: neither a budget nor
            a device total to check), whatever the host holds.
        deepspeed_host_bytes: the host memory DeepSpeed's own ``offload_optimizer`` and ``offload_param`` hold at
            most (`xirang_ds.memory.model_states.offloaded_optimizer_host`, ``offloaded_params_host``), beside the
            host tiers; 0 without them.
    """

    predicted_peak_bytes: int
    by_category: dict[str, int]
    peak_phase: str
    phases: dict[str, dict[str, int]]
    notes: list[str]
    korthikanti_activations: Optional[int] = None
    fits: Optional[bool] = None
    least_budget_bytes: Optional[int] = None
    plans: dict = dataclasses.field(default_factory=dict)
    step_time: Optional[StepTime] = None
    plain_step_time: Optional[StepTime] = None
    points: dict = dataclasses.field(default_factory=dict)
    host_peak_bytes: int = 0
    host_refusal: Optional[str] = None
    device_fits: Optional[bool] = None
    deepspeed_host_bytes: int = 0
    bound_peak_bytes: Optional[int] = None

    @property
    def bound_bytes(self) -> int:
        """The peak the plans and ``fits`` stand on: ``bound_peak_bytes``, else the predicted peak."""
        return self.predicted_peak_bytes if self.bound_peak_bytes is None else self.bound_peak_bytes

    def as_dict(self) -> dict:
        return {"predicted_peak_bytes": self.predicted_peak_bytes, "bound_peak_bytes": self.bound_peak_bytes,
                "host_peak_bytes": self.host_peak_bytes,
                "deepspeed_host_bytes": self.deepspeed_host_bytes, "by_category": dict(self.by_category),
                "peak_phase": self.peak_phase, "fits": self.fits, "least_budget_bytes": self.least_budget_bytes,
                "phases": {k: dict(v) for k, v in self.phases.items()}, "notes": list(self.notes),
                "plans": {k: v.as_dict() if hasattr(v, "as_dict") else v for k, v in self.plans.items()},
                "korthikanti_activations": self.korthikanti_activations,
                "predicted_step_time_s": self.step_time.seconds if self.step_time else None,
                "plain_step_time_s": self.plain_step_time.seconds if self.plain_step_time else None,
                "step_time": self.step_time.as_dict() if self.step_time else None,
                "plain_step_time": self.plain_step_time.as_dict() if self.plain_step_time else None}


def estimate_run(build: Callable[[], torch.nn.Module], ds_config: dict, seq: Optional[int] = None,
                 vocab: Optional[int] = None, world_size: int = 1, device: str = "cpu",
                 inputs: Optional[Inputs] = None, device_profile: Any = None,
                 device_total_bytes: Optional[int] = None, model_key: Optional[Hashable] = None,
                 timed: bool = True) -> Estimate:
    """Estimate one rank's peak for ``build()`` trained with ``ds_config`` on ``world_size`` ranks, on
    ``seq`` tokens below ``vocab`` per sample or on the batch ``inputs`` makes (`trace_model`).

    With a ``"xirang"`` block, the enabled plugins first edit the ds_config as they would at
    ``initialize`` (bucket sizes), then adjust the phases (`xirang_ds.roles.Estimates`); the activation
    planner plans on the trace, priced by ``device_profile`` (default: the CPU's), with
    ``device_total_bytes`` for ``memory_budget: auto`` where the device is not this machine's. Inside
    `xirang_ds.planning.trace_cache.reuse_traces`, ``model_key`` (what ``build`` makes: a model spec) lets
    estimates that trace the same share one trace. ``timed=False`` leaves the predicted step out (``None``): a
    caller that needs only the memory (the plan at ``initialize``) does not count the step's ops.
    """
    session = _session_for(build, ds_config, world_size)
    if session is not None:
        session.device_profile, session.device_total_bytes = device_profile, device_total_bytes
    shape = _plugin_shape(session, ds_config, world_size, device)
    if shape.stage not in (0, 1, 2, 3):
        raise EstimateError(f"zero_optimization.stage must be 0-3; got {shape.stage}")
    trace = traced(lambda seen: trace_model(build, seen, seq, vocab, inputs, session),
                   model_key if inputs is None else None, shape, seq, vocab, ds_config, session)
    est = _estimate(session, shape, trace)
    est.step_time = step_time(shape, trace, device_profile or PROFILES["cpu"], session) if timed else None
    if trace.loss_outside:
        est.notes.append("the forward returns no loss: what the loss computed outside it keeps is not traced")
    return est


def estimate_states(model: torch.nn.Module, ds_config: dict, world_size: int = 1, device: str = "cpu") -> Estimate:
    """`estimate_run` without activations: model states, gradients, buffers and the optimizer step
    of ``model`` (its parameters' sizes only: it may live on the meta device), for what no forward
    can be traced for (``"preset": "auto"`` at initialize, which has the model but not its inputs).

    The trace is replaced by what backward leaves without activations: every gradient at ZeRO 0/1,
    the reduced partition and the reduction buckets at ZeRO 2 (`xirang_ds.memory.trace._EngineEmulation`).
    """
    session = _session_for(lambda: model, ds_config, world_size, fake=False)
    shape = _plugin_shape(session, ds_config, world_size, device)
    if shape.stage not in (0, 1, 2, 3):
        raise EstimateError(f"zero_optimization.stage must be 0-3; got {shape.stage}")
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    total = sum(numels)
    backward = category_bytes()
    if shape.stage in (0, 1):
        backward = category_bytes(gradients=shape.lp_bytes * total)
    elif shape.stage == 2:
        buffers = (2 if shape.overlap_comm else 1) if shape.contiguous_gradients else 0
        backward = category_bytes(gradients=shape.lp_bytes * fullest_rank(shape, numels).numel,
                        comm_buffers=buffers * shape.reduce_bucket * shape.lp_bytes)
    trace = Trace(forward_peak=0, activations=0, backward_peak=sum(backward.values()), backward_by_category=backward,
                  forward_by_category=category_bytes(), inputs=0, param_numels=numels)
    return _estimate(session, shape, trace)


def _plugin_shape(session: Any, ds_config: dict, world_size: int, device: str) -> "RunShape":
    shape = RunShape.from_ds_config(ds_config, world_size, device)
    if session is not None:
        # Buckets and ZeRO-3's reuse distance as the plugins sized them; stage, precision and the
        # optimizer as the user asked (a plugin that takes a part over, like grad_release, hands
        # DeepSpeed stage 0 in fp32 and models its own layout in adjust_estimate).
        edited = RunShape.from_ds_config(session.ds_config, world_size, device)
        shape = dataclasses.replace(shape, reduce_bucket=edited.reduce_bucket, allgather_bucket=edited.allgather_bucket,
                                    prefetch_bucket=edited.prefetch_bucket, overlap_comm=edited.overlap_comm,
                                    max_reuse_distance=edited.max_reuse_distance, sub_group_size=edited.sub_group_size,
                                    max_live_parameters=edited.max_live_parameters)
        for plugin in session.plugins_with(ReshapesRun):
            shape = plugin.estimate_shape(shape)
    return shape


@dataclass
class Stage3Fetches:
    """ZeRO 3's fetches at a steady step replayed over the trace (`xirang_ds.memory.zero3_fetch`), by category
    above the resident states, the persistent weights left out: ``forward`` stands for the trace's forward peak,
    ``backward`` is added to backward's and ``backward_start`` to the point before its first gradient; ``held``:
    the flat buffers' bytes at forward's worst point."""

    forward: dict
    backward: dict
    backward_start: dict
    held: int


def stage3_fetches(shape: "RunShape", trace: Trace, first_step: bool = False) -> Stage3Fetches:
    """The point of forward where its own bytes, the flat all-gather buffers alive and the weights gathered are
    the most together, and the same over backward's module calls, set against backward's own peak. ``first_step``:
    those of the first step's second micro-batch, whose fetches take the persistent weights too
    (`xirang_ds.memory.zero3_fetch`)."""
    forward_calls, backward_calls = traced_calls(trace)
    steps = replay(shape, trace.param_numels, [use for _, use in forward_calls],
                   [use for _, use in backward_calls] or None, trace.unreleased_in_backward if first_step else None)

    def beside(sweep: Sweep, calls: list, fetches: list[Fetch], before: Fetch) -> tuple[dict, dict]:
        arrivals = [(clock, k) for k, (clock, _) in enumerate(calls)]
        _, own, _, taken = most_beside_point(sweep, arrivals, lambda k: _whole(fetches[k[-1]] if k else before),
                                             lambda k: {COMM_BUFFERS: fetches[k[-1]].spike})
        at = fetches[taken - 1] if taken else before  # the call the worst point comes after
        return own, category_bytes(comm_buffers=at.held, parameters=at.gathered)

    own, fetched = beside(trace.forward_sweep, forward_calls, steps.forward, Fetch(0, 0))
    held = fetched[COMM_BUFFERS]  # the buffers alive there, the module's own transient (in ``own``) left out
    engine = category_bytes(**{c: v for c, v in trace.forward_by_category.items() if c in ENGINE})
    forward = add_categories(add_categories(engine, own), fetched)
    start = category_bytes(comm_buffers=steps.forward_end.held, parameters=steps.forward_end.gathered)
    backward = start
    if trace.backward_calls and trace.backward_sweeps:
        sweep = trace.backward_sweeps[0]
        own, fetched = beside(sweep, backward_calls, steps.backward, steps.forward_end)
        # what backward's own bytes are there, against their own peak (which the trace's backward holds)
        backward = add_categories(fetched, category_bytes(temporaries=sum(own.values()) - _own_peak(sweep)))
    return Stage3Fetches(forward, backward, start, held)


def _device(categories: dict) -> int:
    return sum(v for c, v in categories.items() if c != "host")


def _whole(fetch: Fetch) -> int:
    return fetch.held + fetch.gathered


def _own_peak(sweep: Sweep) -> int:
    return most_beside(sweep, [], lambda taken: 0)[0]


def _estimate(session: Any, shape: "RunShape", trace: Trace) -> Estimate:
    """The phases from a trace (or what stands for one), the step, and the plugins' adjustments."""
    numels = trace.param_numels
    total = sum(numels)
    n, lp = shape.world_size, shape.lp_bytes
    states = model_states(shape, numels)
    notes = [f"ZeRO {shape.stage}, {str(shape.dtype).replace('torch.', '')}, micro-batch {shape.micro_batch}, "
             f"{n} rank(s), {total:,} parameters", f"optimizer step temporaries: {shape.adam_impl}"]
    notes += [f"zero_optimization.{k}: host offload is not modelled (the estimate keeps on the device what "
              "it moves to the host); measure with xirang-ds bench" for k in shape.unmodelled_offloads]
    fetch = stage3_fetch_buffer(shape, numels)
    replayed = None
    if shape.fetches_weights and trace.forward_calls and trace.forward_sweep is not None:
        replayed = stage3_fetches(shape, trace)
        held = replayed.held
        where = f"{format_bytes(held)} ({held:,} bytes) of flat buffers" if held else "no flat buffer"
        notes.append("ZeRO 3: the weights' fetches replayed over the traced modules as DeepSpeed's coordinator makes "
                     f"them (gathered weights, flat all-gather buffers): {where} alive at forward's worst point")
    elif fetch:
        notes.append(f"ZeRO 3: a coalesced fetch's flat all-gather buffer, up to {format_bytes(fetch)} ({fetch:,} "
                     "bytes: stage3_prefetch_bucket_size's weights), lives beside the weights copied out of it in "
                     "forward and is not counted in the phases (no module trace); a smaller "
                     "stage3_prefetch_bucket_size bounds it")
    inputs = category_bytes(temporaries=trace.inputs)
    accum = category_bytes()  # gradients carried into the next micro-step's forward (unless the trace holds them)
    if shape.grad_accum > 1 and not trace.accumulates:
        if shape.stage in (0, 1):
            accum = category_bytes(gradients=lp * total)
        elif shape.stage == 2:
            accum = category_bytes(gradients=lp * fullest_rank(shape, numels).numel)

    def micro_step(states: dict, replayed: Optional[Stage3Fetches]) -> tuple[dict, dict, dict]:
        forward_own = replayed.forward if replayed is not None else trace.forward_by_category
        fwd = add_categories(add_categories(states, inputs), add_categories(accum, forward_own))
        bwd = add_categories(add_categories(states, inputs), trace.backward_by_category)
        start = add_categories(add_categories(states, inputs),
                               trace.backward_start_by_category or trace.backward_by_category)
        if replayed is not None:
            bwd, start = add_categories(bwd, replayed.backward), add_categories(start, replayed.backward_start)
        return fwd, bwd, start

    fwd, bwd, start = micro_step(states, replayed)
    if replayed is not None and shape.grad_accum > 1:
        # the first step's second micro-batch, before the optimizer made its states (lazily, at the first update)
        fetched = stage3_fetches(shape, trace, first_step=True)
        first = micro_step({**states, OPTIMIZER_STATES: 0}, fetched)
        larger = [a if _device(a) >= _device(b) else b for a, b in zip((fwd, bwd, start), first)]
        if larger[0] is not fwd:
            notes.append("ZeRO 3 with accumulation: forward peaks in the first step's second micro-batch, before the "
                         "optimizer's states exist, whose fetches take the persistent weights with the others: "
                         f"{format_bytes(fetched.held)} ({fetched.held:,} bytes) of flat buffers alive at its worst "
                         "point")
        fwd, bwd, start = larger
    if shape.stage == 2:
        bwd, start = add_categories(bwd, accum), add_categories(start, accum)
    if shape.stage == 0:
        # engine.allreduce_gradients at the boundary (buffered_allreduce_fallback): every gradient
        # alive plus a flattened copy of up to 5e8 elements (engine.py allreduce_and_copy), after
        # the activations are gone; it runs even on one rank.
        flat = min(total, int(5e8))
        reduce = add_categories(add_categories(states, inputs), category_bytes(gradients=lp * total, temporaries=lp * flat))
        if sum(reduce.values()) > sum(bwd.values()):
            bwd = reduce
    if shape.stage == 3:
        fwd, bwd = stage3_working_set(shape, numels, fwd, bwd, replayed is not None)
        start = stage3_working_set(shape, numels, start, start, replayed is not None)[0]
    step, prepare = optimizer_step(shape, states, numels)
    phases = {"forward": fwd, "backward": bwd, "optimizer_step": step, BACKWARD_START: start}
    if prepare is not None:
        phases[STEP_PREPARE] = prepare
    if session is not None:
        notes += session.summary_left_out()
    plans: dict = {}
    if session is not None:
        session.trace = trace  # what a plugin reads beside the phases (the layers' gradient temporaries)
    unplanned = {k: dict(v) for k, v in phases.items()}
    phases, points, totals = _peaks(_apply_plugins(session, phases, shape, numels, notes, plans))
    bound = max(totals.values())
    host = max(v.get("host", 0) for v in phases.values())  # the host tiers at the bound, as the run allocates them
    likely = _at_likely(session, unplanned, shape, numels, plans, notes)
    if likely is not None:  # the same plans, each size only the data decide at what they give
        phases, points, totals = _peaks(likely)
    peak_phase = max(totals, key=totals.__getitem__)
    device_fits, least = _fits(session, bound, plans)
    host_budget = session.config.host_memory_budget if session is not None else "auto"
    refusal = None
    if host_budget != "auto" and host > int(host_budget):
        # how the block keeps them on the device, where a plugin says (grad_release's states fixed to the host)
        room = next((p["host_fix"] for p in plans.values() if isinstance(p, dict) and p.get("host_fix")), "")
        refusal = host_over_budget(host, int(host_budget), room)
        notes.append(f"host_memory_budget: {refusal}")
    return Estimate(predicted_peak_bytes=totals[peak_phase], by_category=phases[peak_phase], peak_phase=peak_phase,
                    phases={k: {**v, "total": totals[k]} for k, v in phases.items()}, notes=notes,
                    fits=False if refusal else device_fits, least_budget_bytes=least, plans=plans, points=points,
                    host_peak_bytes=host, host_refusal=refusal, device_fits=device_fits,
                    deepspeed_host_bytes=offloaded_optimizer_host(shape, numels)[1]
                    + offloaded_params_host(shape, numels),
                    bound_peak_bytes=bound if bound > totals[peak_phase] else None)


def _peaks(phases: dict) -> tuple[dict, dict, dict]:
    """``(phases, points, totals)``: each point a plugin adjusted inside a phase (grad_release's end of backward,
    the step's preparation, backward's start) taken into its phase where it is the larger, and each phase's device
    total."""
    points = {}
    for part, whole in ((STEP_PREPARE, "optimizer_step"), (BACKWARD_START, "backward"), (BACKWARD_END, "backward")):
        cats = phases.pop(part, None)  # each is inside the same call as its whole; the larger is its peak
        if cats is not None:
            points[part] = {**cats, "total": sum(v for c, v in cats.items() if c != "host")}
        if cats is not None and sum(cats.values()) > sum(phases[whole].values()):
            phases[whole] = cats
    return phases, points, {k: sum(v[c] for c in CATEGORIES if c != "host") for k, v in phases.items()}


def _at_likely(session: Any, phases: dict, shape: "RunShape", numels: list[int], plans: dict,
               notes: list[str]) -> Optional[dict]:
    """The plugins' phases again with each size only the data decide (`xirang_ds.roles.PricesAtBound`) at what the
    data give where its check passes, on the plans made at the bound (``plans``: a planner takes its own from
    ``session.estimate_replay`` instead of planning again); ``None`` where no plugin holds such a size. What the
    plugins planned for the estimate is theirs at the bound again after it."""
    if session is None:
        return None
    bounded = [(p, p.bound_headroom(shape)) for p in session.plugins if isinstance(p, PricesAtBound)]
    bounded = [(p, said) for p, said in bounded if said]
    if not bounded:
        return None
    planned = {id(p): {k: getattr(p, k) for k in ESTIMATE_ATTRIBUTES if hasattr(p, k)} for p in session.plugins}
    session.estimate_replay = plans
    for plugin, _ in bounded:
        plugin.price_at_bound(False)
    try:
        return _apply_plugins(session, phases, shape, numels, [], {})
    finally:
        session.estimate_replay = None
        for plugin, said in bounded:
            plugin.price_at_bound(True)
            notes.append(f"{plugin.section}: {said}: the plans, fits and the least budget take that bound")
        for plugin in session.plugins:
            for k, v in planned[id(plugin)].items():
                setattr(plugin, k, v)


ESTIMATE_ATTRIBUTES = ("estimate_plan", "estimate_note", "estimate_gradients_held", "estimate_gradients_held_chunked")
"""What a plugin keeps of the estimate it adjusted (its plan, its note, what it holds mid-backward), restored after
`_at_likely` priced the same plans again."""


def _fits(session: Any, peak: int, plans: dict) -> tuple[Optional[bool], int]:
    """Whether the predicted ``peak`` fits ``memory_budget`` (else the known device total), and the least
    budget the block meets: a plan's own word where a plugin planned within the budget (``fits`` and
    ``least_budget_bytes`` on its plan), else the peak itself."""
    least, verdicts = peak, []
    for plan in plans.values():
        if hasattr(plan, "least_budget_bytes"):
            least = plan.least_budget_bytes
            verdicts.append(plan.fits)
    budget = session.config.memory_budget if session is not None else "auto"
    limit = int(budget) if budget != "auto" else getattr(session, "device_total_bytes", None)
    if limit is not None:
        verdicts.append(peak <= int(limit))
    return (all(verdicts) if verdicts else None), least


def host_over_budget(host: int, budget: int, room: str = "") -> str:
    """What the estimate and ``initialize`` say where the host tiers would hold more than ``host_memory_budget``;
    ``room``: how the block keeps them on the device (default: a budget that gives the device room for them)."""
    room = room or "give the device room for them (a larger memory_budget, or a preset with smaller states)"
    return (f"the host tiers would hold {format_bytes(host)} ({host:,} bytes, pinned blocks as the host allocator "
            f"rounds them) over the budget of {format_bytes(budget)} ({budget:,} bytes). Fix: raise "
            f"xirang.host_memory_budget to at least {host:,}, or {room}")


def _session_for(build: Callable[[], torch.nn.Module], ds_config: dict, world_size: int, fake: bool = True) -> Any:
    """A session over a fake copy of the model (``fake``; else over ``build()`` itself) whose plugins
    have edited a copy of the ds_config."""
    import copy

    if BLOCK_KEY not in ds_config:
        return None
    fitted = fit_block(ds_config[BLOCK_KEY], ds_config)  # what initialize would run (a preset fits the ds_config)
    session = Session(fitted.config, copy.deepcopy(ds_config), world_size=world_size, left_out=fitted.left_out)
    with fake_tensor_mode() if fake else contextlib.nullcontext():
        session.model = build()
        session.prepare_ds_config()
    return session


def _apply_plugins(session: Any, phases: dict, shape: RunShape, numels: list[int], notes: list[str],
                   plans: dict) -> dict:
    """Let each enabled plugin of the block adjust the phases (`xirang_ds.roles.Estimates`; a plugin without
    the role keeps them when it is ``memory_neutral`` and is noted as not modelled otherwise); what one
    planned for them (its ``estimate_plan``) goes into ``plans`` by section."""
    if session is None:
        return phases
    # a plugin that plans within what the others leave (the activation planner) adjusts after them
    for plugin in sorted(session.plugins, key=lambda p: bool(getattr(p, "adjusts_last", False))):
        if isinstance(plugin, Estimates):
            adjusted = plugin.adjust_estimate(phases, shape, numels)
        else:
            adjusted = phases if plugin.memory_neutral else None
        if adjusted is None:
            notes.append(f"{plugin.section}: its effect on memory is not modelled; measure with xirang-ds bench")
        else:
            phases = adjusted
            if getattr(plugin, "estimate_note", None):  # what it chose for this estimate (grad_release's states)
                notes.append(f"{plugin.section}: {plugin.estimate_note}")
            if getattr(plugin, "estimate_plan", None) is not None:
                plans[plugin.section] = plugin.estimate_plan
    return phases


def korthikanti_activations(layers: int, seq: int, batch: int, hidden: int, heads: int) -> int:
    """Activation bytes of a standard 16-bit transformer without recomputation (Korthikanti et al.
    2022, eq. 1 with t = 1): s·b·h·(34 + 5·a·s/h) per layer."""
    return int(layers * seq * batch * hidden * (34 + 5 * heads * seq / hidden))


# The moved names stay importable from here.
__all__ = ["BACKWARD_END", "BACKWARD_START", "DEFAULT_ALLGATHER_BUCKET", "DEFAULT_MAX_REUSE_DISTANCE",
           "DEFAULT_PERSISTENCE_THRESHOLD", "DEFAULT_PREFETCH_BUCKET", "DEFAULT_REDUCE_BUCKET", "DTYPE_BYTES", "Estimate", "EstimateError", "Inputs",
           "RunShape", "STEP_PREPARE", "Trace", "adam_temporaries", "estimate_run", "estimate_states",
           "format_estimate", "korthikanti_activations", "loss_of", "model_states", "partition_numel", "recalibrate",
           "trace_model"]
