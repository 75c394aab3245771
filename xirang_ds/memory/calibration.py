"""The session's prediction of its own peak, calibrated on its first steady measured step.

Before a run the estimator predicts a peak from a ds_config and a model spec
(`xirang_ds.planning.estimator`), within a few percent on the configurations it was fitted on and
those it was not. A running session knows more: its own model, its own batches, and what it
measured. With the monitor on, the session keeps a `Calibration`:

1. At ``initialize``, before DeepSpeed and the plugins touch the model, a `ModelTwin`: the model's
   structure with every parameter and buffer on the meta device (no memory).
2. Each forward's input shapes (`InputSignature`, values not kept).
3. At the first *steady* window the monitor measures (below), the estimator runs on the twin and
   that window's batch (a fake trace: no memory, no compute), and each phase's measured peak over
   its estimate becomes that phase's factor. Model states the window created and kept (optimizer
   states allocated lazily in the first step) are added back to the phases measured before they
   existed: what every later step holds (the first step's own effect, separated).
4. The calibrated prediction for any batch is its estimate times each phase's factor, the largest
   phase. For the calibrated shapes it is the steady measured peak; for other shapes (a longer
   sequence) the estimator carries the shape's effect and the factors what it does not model.

A window is steady when every plugin has settled (`xirang_ds.roles.SettlesLate`: no profiling passes left) and
ZeRO-3 holds a parameter trace (not in the first step) at both ends, and no memory-changing event (a monitor action, the activation plan escalated, buckets
resized) happened in it; such an event also makes the calibration stale, and the next steady window
calibrates again. Every later check records the prediction for the shapes it saw beside what it
measured (`checks`, `worst_error`).

On CPU the live-storage tracker gives each phase's peak and the records; on an accelerator the
allocator's counter gives the window's total only: one factor, from a window whose allocated bytes
did not grow. Where the twin cannot be made or traced (a model fake tensors cannot run), the
prediction is the steady measured peak for the shapes measured, and nothing for other shapes; the
notes say why.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import torch

from xirang_ds.compat.torch import buffer_table, parameter_table, pytree
from xirang_ds.memory.categories import OPTIMIZER_STATES, PARAMETERS
from xirang_ds.memory.model_states import BACKWARD_END
from xirang_ds.roles import SettlesLate

logger = logging.getLogger("xirang_ds")

PHASES = ("forward", "backward", "optimizer_step")
"""The phases the estimator predicts and the tracker measures."""

MEMORY_EVENTS = ("monitor_action", "activations_escalated", "comm_buffers_resize", "optimizer_state_taken_over")
"""Session events after which memory differs from what was calibrated (`Session.record_event`)."""

CACHED_ESTIMATES = 32
"""Estimates kept by input shapes (one fake trace each; a run with many lengths re-traces the oldest)."""


# ------------------------------------------------------------------------------------------------
# what the estimator needs from the live run


@dataclass(frozen=True)
class TensorSpec:
    """A tensor input's shape and dtype."""

    shape: tuple
    dtype: torch.dtype
    requires_grad: bool = False

    def fake(self) -> torch.Tensor:
        """A tensor of this spec, under the active ``FakeTensorMode`` (no memory)."""
        return torch.zeros(self.shape, dtype=self.dtype, requires_grad=self.requires_grad)


class InputSignature:
    """The shapes of one forward's inputs: tensors as `TensorSpec`, other values kept as given.

    Attributes:
        key: a hashable text of the structure and shapes (equal for batches of equal shapes).
    """

    def __init__(self, args: tuple, kwargs: dict):
        spec = lambda t: TensorSpec(tuple(t.shape), t.dtype, bool(t.requires_grad))  # noqa: E731
        self.template = pytree.tree_map_only(torch.Tensor, spec, (tuple(args), dict(kwargs)))
        leaves, structure = pytree.tree_flatten(self.template)
        self.key = repr(structure) + "|" + ",".join(
            f"{tuple(x.shape)}:{x.dtype}" if isinstance(x, TensorSpec) else type(x).__name__ for x in leaves)

    def fake(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with fake tensors (call under the trace's ``FakeTensorMode``)."""
        return pytree.tree_map_only(TensorSpec, TensorSpec.fake, self.template)

    def describe(self) -> str:
        leaves = [x for x in pytree.tree_leaves(self.template) if isinstance(x, TensorSpec)]
        return ", ".join("x".join(map(str, x.shape)) + " " + str(x.dtype).replace("torch.", "") for x in leaves)


class ModelTwin:
    """A model's structure with every parameter and buffer on the meta device (no memory): a deep
    copy whose memo maps each parameter and buffer to a meta tensor of its shape (ZeRO-3's
    ``ds_shape`` for a parameter ``deepspeed.zero.Init`` already partitioned), so ties are kept.

    Take it before DeepSpeed and the plugins hook the model: the copy keeps the model's own hooks.
    """

    def __init__(self, model: torch.nn.Module):
        memo: dict[int, Any] = {}
        for t in list(model.parameters()) + list(model.buffers()):
            shape = tuple(getattr(t, "ds_shape", t.shape))
            meta = torch.empty(shape, dtype=t.dtype, device="meta")
            memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else meta
        self.skeleton = copy.deepcopy(model, memo)

    def build(self) -> torch.nn.Module:
        """The twin with tensors of the active ``FakeTensorMode`` in place of the meta ones (each
        shared parameter once)."""
        made: dict[int, Any] = {}

        def fake(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in made:
                new = torch.zeros(t.shape, dtype=t.dtype)
                made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else new
            return made[id(t)]

        for module in self.skeleton.modules():
            for table in (parameter_table(module), buffer_table(module)):
                for name, t in list(table.items()):
                    if t is not None:
                        table[name] = fake(t)
        return self.skeleton


# ------------------------------------------------------------------------------------------------
# the calibration


def phase_factors(measured: dict[str, int], estimated: dict[str, int]) -> dict[str, float]:
    """Measured over estimated, per phase both have (``peak``: totals only, an accelerator's)."""
    if "peak" in measured:
        return {"peak": measured["peak"] / max(estimated.values())}
    return {p: measured[p] / estimated[p] for p in measured if estimated.get(p)}


def map_phase(estimated: float, points: list[tuple[float, float]]) -> float:
    """A phase's estimate mapped to a prediction through ``(estimated, measured)`` points of windows
    measured: one point (or two estimates within 5% of each other) scales by its ratio; otherwise the
    line through the two points nearest in estimate, interpolating between them or extrapolating."""
    near = sorted(points, key=lambda pt: abs(pt[0] - estimated))[:2]
    if len(near) == 1 or abs(near[0][0] - near[1][0]) < 0.05 * max(near[0][0], near[1][0]):
        return estimated * near[0][1] / near[0][0]
    (e0, m0), (e1, m1) = near
    return m0 + (estimated - e0) * (m1 - m0) / (e1 - e0)


def calibrated_peak(estimated: dict[str, int], factors: dict[str, float]) -> int:
    """The largest phase of an estimate once each phase is scaled by its factor; a phase the
    calibration did not measure (no allocation in it) is scaled by the largest factor."""
    if "peak" in factors:
        return int(max(estimated.values()) * factors["peak"])
    fallback = max(factors.values())
    return int(max(v * factors.get(p, fallback) for p, v in estimated.items()))


class Calibration:
    """A session's calibrated peak prediction (see the module docstring).

    Attributes:
        calibrated_at: the optimizer step of the window it calibrated on, or ``None``.
        steady_phases: that window's measured peak per phase as later steps hold it (``peak``: the
            total, on an accelerator).
        predicted_peak_bytes: the calibrated prediction for the calibrated shapes.
        predicted_phase: the phase it falls in.
        checks: every later check: ``step``, ``measured_bytes``, ``predicted_bytes``, ``error``.
        notes: what the prediction could not use, and why.

    The estimator runs only when a prediction is asked for shapes not measured yet (`factors`).
    """

    def __init__(self, session: Any, model: torch.nn.Module):
        self.session = session
        self.notes: list[str] = []
        self.twin: Optional[ModelTwin] = None
        try:
            self.twin = ModelTwin(model)
        except Exception as e:  # a module holding what cannot be copied (a process group, a file)
            self.notes.append(f"the model's structure could not be copied for the estimator ({type(e).__name__}: "
                              f"{e}); the prediction is the measured steady peak, for the shapes measured only")
        self.calibrated_at: Optional[int] = None
        self.steady_phases: dict[str, int] = {}
        self.predicted_peak_bytes: Optional[int] = None
        self.predicted_phase: Optional[str] = None
        self.checks: list[dict] = []
        self.on_accelerator = False
        self._anchor: list[InputSignature] = []  # the calibrated window's shapes
        self._factors: Optional[dict[str, float]] = None
        self._points: dict[str, tuple[list[InputSignature], dict[str, int]]] = {}
        """The first steady phases measured for each set of shapes, by `_key` (since the calibration)."""
        self._estimates: OrderedDict[str, Any] = OrderedDict()
        self._window: dict[str, InputSignature] = {}
        self._stale = False
        self._events = 0
        self._settled = False
        self._handle = None

    # -- the live run ----------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        """Record every forward's input shapes from now on; the first window starts here."""
        self.on_accelerator = torch.device(engine.device).type != "cpu"
        self._handle = engine.module.register_forward_pre_hook(self._record, with_kwargs=True)
        self.window_started()

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _record(self, module: Any, args: tuple, kwargs: dict) -> None:
        sig = InputSignature(args, kwargs)
        self._window.setdefault(sig.key, sig)

    def _all_settled(self) -> bool:
        """Every plugin settled, and ZeRO-3's parameter coordinator holding a trace (in the first step
        it records one and releases every parameter after use; from the second, which starts by
        completing it, it keeps those reused soon gathered: partitioned_param_coordinator.py
        ``reset_step``; a trace that stops matching is invalidated and recorded again)."""
        offload = getattr(getattr(self.session.engine, "optimizer", None), "parameter_offload", None)
        if offload is not None and offload.get_param_coordinator().is_invalid_trace():
            return False
        return all(p.settled() for p in self.session.plugins if isinstance(p, SettlesLate))

    def window_started(self) -> None:
        """A measurement window starts now (after a check and its actions)."""
        self._settled = self._all_settled()
        self._events = len(self.session.events)

    def observe(self, step: int, peak: int, window: Any) -> Optional[dict]:
        """A check's measurement of the window that ends now (before it is reset): compare it with
        the prediction, then calibrate when the window is steady and there is no calibration yet (or
        it is stale).

        Args:
            step: the optimizer step the window ends at.
            peak: the window's peak device bytes.
            window: the tracker's `Window` on CPU (phase peaks and records), else the allocator's.

        Returns:
            The check's record (``predicted_bytes`` ``None`` before the first calibration), or
            ``None`` when no forward ran in the window.
        """
        sigs = list(self._window.values())
        self._window = {}
        if not sigs:
            return None
        events = [e for e in self.session.events[self._events:] if e["kind"] in MEMORY_EVENTS]
        steady = self._settled and self._all_settled() and not events
        if events:
            self._stale = True
        record = {"step": step, "measured_bytes": int(peak), "predicted_bytes": None, "error": None,
                  "shapes": [s.describe() for s in sigs]}
        if self.calibrated_at is not None and not self._stale:
            predicted = self.predict(sigs)
            if predicted is not None:
                record.update(predicted_bytes=predicted, error=(predicted - peak) / peak)
            self.checks.append(record)
        if steady and not (self.on_accelerator and _grew(window)):
            measured = self._steady_phases(peak, window)
            if self.calibrated_at is None or self._stale:
                self._calibrate(step, measured, sigs)
                record["calibrated"] = True
            self._points.setdefault(_key(sigs), (sigs, measured))
        return record

    # -- calibrating and predicting --------------------------------------------------------------
    def _steady_phases(self, peak: int, window: Any) -> dict[str, int]:
        """Each phase's measured peak as every later step holds it: model states this window created
        and kept (optimizer states made lazily in the first step) added where they did not exist yet.
        On an accelerator: the total only (``{"peak": bytes}``)."""
        if self.on_accelerator or not hasattr(window, "phase_peak_clocks"):
            return {"peak": int(peak)}
        kept = [r for r in window.tracker.live_records() if not r.host and r.created > window.start_clock
                and r.resolved_category() in (PARAMETERS, OPTIMIZER_STATES)]
        return {p: window.phase_peaks[p] + sum(r.nbytes for r in kept if r.created > window.phase_peak_clocks[p])
                for p in PHASES if p in window.phase_peaks}

    def _calibrate(self, step: int, measured: dict[str, int], sigs: list[InputSignature]) -> None:
        self._points = {}  # memory changed (or nothing measured yet): earlier shapes no longer stand
        self.steady_phases = measured
        self._anchor = sigs
        self._factors = None
        self.calibrated_at = step
        self._stale = False
        self.predicted_peak_bytes = max(measured.values())
        self.predicted_phase = max(measured, key=measured.__getitem__)
        if getattr(self.session.engine, "global_rank", 0) == 0:
            logger.info("xirang: calibrated prediction %s bytes (%s) at step %d", f"{self.predicted_peak_bytes:,}",
                        self.predicted_phase, step)

    @property
    def factors(self) -> Optional[dict[str, float]]:
        """Per phase, the calibrated window's steady peak over the estimator's (``peak``: the one
        factor of an accelerator's total); ``None`` before calibration or where the estimator cannot
        run on this model. Computed on first use (one fake trace)."""
        if self._factors is None and self.calibrated_at is not None:
            estimated = self._estimated_phases(self._anchor)
            if estimated is not None:
                self._factors = phase_factors(self.steady_phases, estimated)
        return self._factors

    def estimator_error(self) -> Optional[float]:
        """The estimator's own error at the calibrated window, before any factor ((estimated - measured)
        / measured), or ``None``."""
        estimated = self._estimated_phases(self._anchor) if self.calibrated_at is not None else None
        if estimated is None:
            return None
        return (max(estimated.values()) - self.predicted_peak_bytes) / self.predicted_peak_bytes

    def _estimated_phases(self, sigs: list[InputSignature]) -> Optional[dict[str, int]]:
        """The estimator's phases for a window of these shapes: each phase's largest over them."""
        out: dict[str, int] = {}
        for sig in sigs:
            est = self.estimate(sig)
            if est is None:
                return None
            for p in PHASES:
                out[p] = max(out.get(p, 0), est.phases[p]["total"])
            # the end of backward apart (grad_release's update and all-gather, which no batch shape changes): where a
            # short batch's backward peaks there, the line through the measured mid-backward points does not apply
            # to it, so it keeps a phase of its own (`predict`)
            end = est.points.get(BACKWARD_END)
            if end is not None:
                out[BACKWARD_END] = max(out.get(BACKWARD_END, 0), end["total"])
        return out

    def estimate(self, sig: InputSignature) -> Any:
        """The estimator's `Estimate` for one forward of these shapes on this run (cached), or ``None``
        (no twin, or the trace failed: a note says why)."""
        if self.twin is None:
            return None
        if sig.key in self._estimates:
            self._estimates.move_to_end(sig.key)
            return self._estimates[sig.key]
        session = self.session
        tracker = session.started_tracker
        try:
            with tracker.paused() if tracker is not None else contextlib.nullcontext():
                est = session.estimator.estimate_run(self.twin.build, session.requested_ds_config,
                                                     world_size=session.world_size,
                                                     device="cuda" if self.on_accelerator else "cpu", inputs=sig.fake,
                                                     timed=False)
        except Exception as e:  # fake tensors cannot run every model (data-dependent shapes, custom ops)
            self.notes.append(f"the estimator could not trace this model on {sig.describe()} ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}); the prediction is the measured steady peak, for "
                              "the shapes measured only")
            self.twin = None
            return None
        self._estimates[sig.key] = est
        if len(self._estimates) > CACHED_ESTIMATES:
            self._estimates.popitem(last=False)
        return est

    def predict(self, sigs: list[InputSignature]) -> Optional[int]:
        """The calibrated peak of a window running batches of these shapes, or ``None`` (before
        calibration, or other shapes where the estimator cannot run).

        Shapes measured in a steady window: that window's steady peak. Others: each phase of their
        estimate mapped through the shapes measured (`map_phase`): scaled by the calibrated window's
        factor while one set of shapes is measured, then along the line through the two measured
        nearest in that phase's estimate, which also takes out an error that does not grow with the
        batch (an optimizer state the estimator sizes a little off)."""
        if self.calibrated_at is None:
            return None
        key = _key(sigs)
        if key in self._points:
            return max(self._points[key][1].values())
        if self.factors is None:
            return None
        estimated = self._estimated_phases(sigs)
        if estimated is None:
            return None
        points = []
        for point_sigs, measured in self._points.values():
            at = self._estimated_phases(point_sigs)
            if at is not None:
                points.append((at, measured))
        if "peak" in self.factors:
            return int(map_phase(max(estimated.values()),
                                 [(max(at.values()), m["peak"]) for at, m in points]) or 0) or None
        out = []
        for p, e in estimated.items():
            known = [(at[p], m[p]) for at, m in points if p in m and at.get(p)]
            if known:
                out.append(map_phase(e, known))
            elif p == BACKWARD_END:  # no window measured has peaked there: as estimated, or scaled up if found low
                out.append(e * max(1.0, max(self.factors.values())))
            else:  # no allocation measured in this phase (an in-place step): the largest factor
                out.append(e * max(self.factors.values()))
        return int(max(out))

    def predict_batch(self, *args: Any, **kwargs: Any) -> Optional[int]:
        """The calibrated peak of a step whose micro-batches are ``model(*args, **kwargs)`` (say, the
        next batch of a loader with variable lengths, before it runs); ``None`` as for `predict`."""
        return self.predict([InputSignature(args, kwargs)])

    # -- reporting -------------------------------------------------------------------------------
    @property
    def worst_error(self) -> Optional[float]:
        """The largest |predicted - measured| / measured over the checks after calibration."""
        errors = [abs(c["error"]) for c in self.checks if c["error"] is not None]
        return max(errors) if errors else None

    def describe(self) -> str:
        if self.calibrated_at is None:
            return "calibrated prediction: after the first steady measured step"
        worst = self.worst_error
        return (f"calibrated prediction {self.predicted_peak_bytes:,} bytes ({self.predicted_phase}) since step "
                f"{self.calibrated_at}" + (f", worst error {worst:.2%} over {len(self.checks)} check(s)"
                                           if worst is not None else ""))

    def as_dict(self) -> dict:
        """Plain data (no estimator run: `factors` only if something already asked for them)."""
        return {"calibrated_at": self.calibrated_at, "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_phase": self.predicted_phase, "steady_phases": dict(self.steady_phases),
                "factors": dict(self._factors) if self._factors else None, "worst_error": self.worst_error,
                "checks": [dict(c) for c in self.checks], "notes": list(self.notes)}


def _key(sigs: list[InputSignature]) -> str:
    return " + ".join(sorted(s.key for s in sigs))


def _grew(window: Any) -> bool:
    """The allocator's bytes at the window's end differ from its start (an accelerator's window: what
    it allocated and kept, later steps hold from their start)."""
    base = getattr(window, "baseline_bytes", None)
    live = getattr(window, "live_bytes", None)
    return base is None or live is None or abs(int(live) - int(base)) > max(1 << 20, int(base) // 200)


__all__ = ["Calibration", "InputSignature", "ModelTwin", "TensorSpec", "calibrated_peak", "phase_factors"]
