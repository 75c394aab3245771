"""The plugin's forward bookkeeping: the first forward takes the plan made before the run (`run_plan`), or the
first ``profile_steps`` forwards are profiling passes (`profile.py`) after which the ranks agree on the
figures and the planner chooses (`pricing.py`, `planner.py`). A mixin of `ActivationsPlugin`, which holds the
state."""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from xirang_ds.plugins.activations.planner import estimate_peak
from xirang_ds.plugins.activations.pricing import OtherPeak, agree, build_tree, check_agreed, plan_within, reach
from xirang_ds.plugins.activations.profile import Profiler
from xirang_ds.plugins.activations.reserve import switch_reserves
from xirang_ds.plugins.activations.run_plan import BEFORE_RUN, plan_before_run
from xirang_ds.plugins.activations.storage import PayloadStorage


class Passes:
    """`ActivationsPlugin`'s root forward and what it runs: the plan taken, or profiling passes."""

    def _root_forward(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        rt = self.runtime
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        rt.eligible.refresh(self._model)
        rt.offloader.end_forward()
        if self.state == "planned":
            switch_reserves(self)  # lossy modules whose bound broke on some rank go lossless, on every rank
        scope = self._forward_scope if self._forward_scope is not None else contextlib.nullcontext()
        if self.state == "profiling" and self._twin is not None and self.region is None and rt.profiler is None:
            self._take_plan(args, kwargs)
        if self.state == "profiling":
            if self._passes == self.config.profile_steps:
                self._finish_profiling()
            else:
                self._passes += 1
                if rt.profiler is None:
                    self._start_profiling()
                with scope, rt.profiler.run_pass():  # the pass's pack composes with the scope's
                    return original(*args, **kwargs)
        with scope:
            return original(*args, **kwargs)

    def _take_plan(self, args: tuple, kwargs: dict) -> None:
        """The estimator's plan for this batch's shapes, in force from this forward (`run_plan`); where it has
        none, the profiling passes plan as before (the log says why)."""
        plan, why = plan_before_run(self, self._twin, args, kwargs)
        self._twin = None
        if plan is None:
            self._log(f"planning from {self.config.profile_steps} profiled passes: {why}")
            return
        self.profiles, self.choices, self.budget_bytes = plan.profiles, plan.choices, plan.budget_bytes
        self.planned_peaks, self.outside_bytes, self.reach = plan.planned_peaks, plan.outside_bytes, plan.reach
        self.planned_step_peak = plan.step_peak_bytes
        self._apply(plan.plan)
        check_agreed(self.plan, self.runtime.device, self._groups)
        self.state = "planned"
        self.plan_source = BEFORE_RUN + (f" ({why})" if why else "")
        self._log_plan()

    def _start_profiling(self) -> None:
        from deepspeed.accelerator import get_accelerator

        rt = self.runtime
        fixed = set(self._fixed.values())  # a lossy option fixed by hand is priced too, listed in options or not
        lossy = tuple(k for k in ("quantize", "sparsify") if k in self.options or k in fixed)
        rt.profiler = Profiler(rt.eligible, rt.handlers["offload"], PayloadStorage(), self.tolerant_names, lossy,
                               self.config.quantize_block_size, self.config.sparsify_threshold, self.device_profile)
        if self.config.follows_memory_budget:
            self._other_peak = OtherPeak(self.session, self._engine)
            rt.head_stretch = self._other_peak.exclude
            budget = self.session.config.memory_budget
            total = int(get_accelerator().total_memory()) if budget == "auto" else int(budget)
            other = self._other_peak
            rt.head_room = lambda: total - other.live_bytes()
            rt.profiler.trial_stretch, rt.profiler.trial_room = other.exclude, rt.head_room
            if self.session.tracker.active:
                rt.profiler.host_tier = self.session.tracker.host_tier

    def _close_other_peak(self) -> Optional[int]:
        peak = self._other_peak.stop() if self._other_peak is not None else None
        self._other_peak = None
        if self.runtime is not None:
            self.runtime.head_stretch = self.runtime.head_room = None
        return peak

    def _finish_profiling(self) -> None:
        from deepspeed.accelerator import get_accelerator

        rt = self.runtime
        profiles = rt.profiler.combined()
        rt.profiler = None
        rt.offloader.synchronize()
        rt.offloader.pool.clear()  # profiling offloaded everything; the plan's own buffers pool anew
        other, stepper = self._close_other_peak(), self.session.stepper
        parkable = stepper.parkable_bytes() if stepper is not None else 0  # the least over ranks, as all agree
        extra = agree(profiles, [-self._bandwidth, float(other or 0), -float(parkable)], rt.device, self._groups)
        self._bandwidth, other = -extra[0], (int(extra[1]) if other is not None else None)
        self.profiles = profiles
        streams = rt.offloader.stream is not None
        roots, before, after = build_tree(self._candidates, self._fixed, profiles, self.options, self.tolerant_names,
                                          self._bandwidth, streams, self.config.offload_prefetch, self.token_wise_names)
        self.outside_bytes = before + after
        self.budget_bytes, self.choices, other = plan_within(
            self.config, self.session.config.memory_budget, int(get_accelerator().total_memory()), profiles, other,
            (roots, before, after), self.region, stepper, int(-extra[2]))
        self.reach = reach(roots, before, after, other, self.profiles, self.choices, self.head_names, self.budget_bytes)
        self.planned_peaks = estimate_peak(roots, self.choices, before, after)
        self._apply({name: c.option for name, c in self.choices.items()})
        check_agreed(self.plan, rt.device, self._groups)
        self.state = "planned"
        self._log_plan()


__all__ = ["Passes"]
