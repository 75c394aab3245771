"""Live memory monitor: watch the step peak against the budget, warn, then act before an OOM.

Every ``every_steps`` optimizer steps each rank measures its peak device bytes since the last check
(CUDA: the caching allocator's ``max_memory_allocated`` through a window of its one owner,
`xirang_ds.memory.device_peak`, so the bench's own reading is not reset; CPU: the live-storage
tracker) and all ranks take the maximum fraction of the budget through one ``all_reduce``. Every rank therefore sees
the same figure and takes the same decision, so no rank acts alone and none waits in a collective
the others skip (the ``checkpoint`` action is itself collective).

Actions at ``act_at``, in the order listed, by *episode*: an episode starts at the first check at
``act_at`` and ends at the first check below ``warn_at`` (hysteresis between the two thresholds).

* ``empty_cache``: ``gc.collect()`` and the accelerator's ``empty_cache()``; once per episode.
* ``checkpoint``: ``engine.save_checkpoint(checkpoint_dir, tag="xirang-step<N>")`` (loadable); once
  per episode, when the threshold is first crossed.
* ``halve_micro_batch``: run each micro-batch as twice as many pieces inside ``engine.forward``
  (`xirang_ds.microbatch`), so the global batch and the gradient stay the same; again at each check
  of the episode still at ``act_at``. With ``restore_after_steps`` N, N checks in a row below
  ``warn_at`` double the pieces back one level, until the micro-batch is whole.
* ``raise_recompute`` / ``raise_compression``: the activation plan moves one more module off the
  device at each check at ``act_at``.

Where the activation plan was made before the run, a step peaking more than `PLAN_TOLERANCE` above the budget
on the fullest rank is named once as the plan missing its budget (a ``plan_missed_budget`` event); the
actions above take over.

Each warning and action is logged once on rank 0 when it happens and sent to DeepSpeed's monitor
(tensorboard / csv / wandb) as an event; per-step memory figures go there too.

Inside the step, where these checks come too late: ``on_oom = "halve_micro_batch"`` retries a
micro-step that ran out of memory on every rank with the micro-batch halved (`xirang_ds.plugins.monitor.oom.OomGuard`,
a retry is an ``oom_halve_micro_batch`` action), and ``enforce_budget`` makes ``memory_budget`` a hard
cap (CPU: the tracker's ``limit``; CUDA: the allocator's per-process fraction).
"""
from __future__ import annotations

import gc
import logging
from typing import Any, Optional

import torch

from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import CallbackHandle, wrap_method
from xirang_ds.memory.usage import MemoryReport
from xirang_ds.microbatch import MicroBatchSplitter
from xirang_ds.plugins.monitor.config import MonitorConfig
from xirang_ds.plugins.monitor.oom import OomGuard
from xirang_ds.registry import MEMORY_WATCH, Plugin, register_plugin

logger = logging.getLogger("xirang_ds")

EVENT_PREFIX = "xirang/monitor"
GROWTH_WARNING = 0.02
"""A check whose peak is this much above the calibrated prediction for its shapes warns."""
PLAN_TOLERANCE = 0.05
"""How far above ``memory_budget`` a step of a plan made before the run may peak before the monitor says the
plan missed it: the estimate's stated accuracy (issue 57's target; docs/activations.md)."""
ONCE_PER_EPISODE = ("empty_cache", "checkpoint")
"""Actions that run when an episode starts only: repeating them while memory stays high writes a
checkpoint every step, and freeing caches cannot lower a peak the allocator already measured."""


def resolve_budget(requested: Any, device_total: int, model_state_bytes: int) -> int:
    """The per-rank byte budget: ``memory_budget`` or the device's capacity.

    Raises:
        XirangConfigError: the budget exceeds the device or is below the rank's model states.
    """
    if requested == "auto":
        return int(device_total)
    budget = int(requested)
    if budget > device_total:
        raise XirangConfigError([("xirang.memory_budget",
                                  f"{format_bytes(budget)} is more than the device has "
                                  f"({format_bytes(device_total)}); lower it or use \"auto\"")])
    if budget < model_state_bytes:
        raise XirangConfigError([("xirang.memory_budget",
                                  f"{format_bytes(budget)} is below what this rank's model states "
                                  f"already take ({format_bytes(model_state_bytes)}); raise it")])
    return budget


@register_plugin(MonitorConfig, section="monitor", order=90,
                 summary="Live memory monitor with thresholds and actions.")
class MonitorPlugin(Plugin):
    """Checks memory after optimizer steps and runs the configured actions on every rank."""

    memory_neutral = time_neutral = True
    frameworks = ("deepspeed", "megatron")

    paths = {"megatron": "xirang_ds.plugins.monitor.megatron:MegatronMonitor"}
    provides = frozenset({MEMORY_WATCH})

    def __init__(self, config: MonitorConfig, session):
        super().__init__(config, session)
        self.budget = 0
        self.level = "ok"
        self.history: list[dict] = []
        self.actions_taken: list[dict] = []
        self.splitter = None
        self.guard = None
        self.last_report = None
        """The tracker's report of the last checked window (CPU only)."""
        self.window = None
        self._last_step = None
        self.episode: int = 0
        """Episodes so far (a run of checks from the first at ``act_at`` until one below ``warn_at``)."""
        self._in_episode = False
        self._quiet_checks = 0
        self._retried = False
        self.last_prediction: Optional[dict] = None
        """The session calibration's record of the last check (`Calibration.observe`)."""
        self._above_prediction = False
        self._plan_missed = False
        self._peak: Optional[MemoryReport] = None
        """The highest check so far (`peak`)."""

    # ----------------------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        from deepspeed.accelerator import get_accelerator

        self.engine = engine
        self.accel = get_accelerator()
        self.on_cpu = self.accel.device_name() == "cpu"
        tracker = self.session.track_memory() if self.on_cpu else None
        self.window = self.session.open_peak_window()
        state_bytes = tracker.live_bytes if tracker is not None else int(self.accel.memory_allocated())
        self.budget = resolve_budget(self.session.config.memory_budget, self.accel.total_memory(), state_bytes)
        if self.config.enforce_budget:
            self._enforce(tracker)
        if "halve_micro_batch" in self.config.actions or self.config.on_oom == "halve_micro_batch":
            self.splitter = self.keep(MicroBatchSplitter(engine))
        if self.config.on_oom == "halve_micro_batch":
            self.guard = self.keep(OomGuard(engine, self.splitter, self.session, self._on_retry))
            self.session.oom_guard = self.guard
            self.keep(CallbackHandle(lambda: setattr(self.session, "oom_guard", None)))
        self.keep(wrap_method(engine, "step", self._step))
        self._last_step = engine.global_steps
        if self.session.calibration is not None:
            self.session.calibration.attach(engine)

    def _enforce(self, tracker: Any) -> None:
        """``enforce_budget``: the budget becomes this process's hard cap on device memory."""
        if tracker is not None:
            tracker.limit = self.budget
            self.keep(CallbackHandle(lambda: setattr(tracker, "limit", None)))
            return
        if self.accel.device_name() != "cuda":
            raise XirangConfigError([("xirang.monitor.enforce_budget",
                                      f"true caps memory through the CUDA allocator; the accelerator here is "
                                      f"{self.accel.device_name()!r}. Fix: set enforce_budget to false")])
        device = self.accel.current_device()
        torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget / self.accel.total_memory()), device)
        self.keep(CallbackHandle(lambda: torch.cuda.set_per_process_memory_fraction(1.0, device)))

    def describe(self) -> str:
        return (f"budget {format_bytes(self.budget)}" + (" (enforced)" if self.config.enforce_budget else "")
                + f", warn at {self.config.warn_at:.0%}, act at {self.config.act_at:.0%} with "
                f"{', '.join(self.config.actions) or 'no actions'}"
                + (", out-of-memory errors in forward/backward retried with the micro-batch halved"
                   if self.guard is not None else ""))

    def _on_retry(self, record: dict) -> None:
        """An out-of-memory retry (`OomGuard`): log, count as an action, send the event."""
        step, micro = record["step"], self.engine.train_micro_batch_size_per_gpu()
        self._log(f"step {step}: out of memory in {record['where']} of micro-step {record['micro_step']} "
                  f"({record['error']}); every rank dropped it, micro-batch {micro} now runs as {record['pieces']} "
                  f"pieces of {micro // record['pieces']} and this step's {record['micro_step']} micro-batch(es) run "
                  "again (global batch unchanged)", logging.WARNING)
        self.actions_taken.append({"step": step, "action": "oom_halve_micro_batch", "fraction": None, "done": True,
                                   "episode": self.episode, **record})
        self.session.record_event("monitor_action", step=step, action="oom_halve_micro_batch", done=True)
        self._retried = True
        self._emit([(f"{EVENT_PREFIX}/action/oom_halve_micro_batch", float(record["pieces"]), step)])

    # ----------------------------------------------------------------------------------------
    def _step(self, original, *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        engine = self.engine
        if engine.global_steps != self._last_step:  # an optimizer step happened (boundary)
            self._last_step = engine.global_steps
            if engine.global_steps % self.config.every_steps == 0:
                self.check()
        return result

    def measure(self) -> int:
        """This rank's peak device bytes since the previous measurement (then restart the window);
        the session's calibration sees the window first (`last_prediction`)."""
        if self.on_cpu:
            self.last_report = self.window.report()
        peak = self.window.peak_bytes
        calibration = self.session.calibration
        self.last_prediction = (calibration.observe(self.engine.global_steps, peak, self.window)
                                if calibration is not None else None)
        self.window.reset()  # this window only: the bench's and comm_buffers' keep their peaks
        return peak

    def agree(self, fraction: float) -> float:
        """The largest fraction over all ranks (one collective; every rank gets the same value)."""
        import torch.distributed as dist  # the process group DeepSpeed or Megatron initialized

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return fraction
        t = torch.tensor([fraction], dtype=torch.float64, device=self.accel.current_device_name())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def check(self) -> str:
        """Measure, agree across ranks, then warn or act. Returns the level reached."""
        peak = self.measure()
        own = peak / self.budget
        fraction = self.agree(own)
        step = self.engine.global_steps
        level = "act" if fraction >= self.config.act_at else "warn" if fraction >= self.config.warn_at else "ok"
        predicted = (self.last_prediction or {}).get("predicted_bytes")
        record = {"step": step, "peak_bytes": peak, "fraction": own, "max_fraction": fraction, "level": level,
                  "predicted_bytes": predicted}
        self.history.append(record)
        if self._peak is None or peak > self._peak.peak_bytes:
            self._peak = MemoryReport.of(peak, self.last_report if self.on_cpu else None, step, self.budget)
        events = [(f"{EVENT_PREFIX}/peak_bytes", peak, step), (f"{EVENT_PREFIX}/budget_fraction", fraction, step)]
        if predicted is not None:
            events.append((f"{EVENT_PREFIX}/predicted_peak_bytes", predicted, step))
            self._compare(step, peak, predicted)
        if self._plan_check(step, fraction, level):
            events.append((f"{EVENT_PREFIX}/plan_missed_budget", fraction, step))
        record["plan_missed_budget"] = self._plan_missed
        if self.config.log_every_steps and step % self.config.log_every_steps == 0:
            self._log(f"step {step}: peak {format_bytes(peak)} = {own:.1%} of budget "
                      f"(max over ranks {fraction:.1%})")
        if level == "warn" and self.level == "ok":
            self._log(f"step {step}: memory at {fraction:.1%} of the budget {format_bytes(self.budget)} "
                      f"(warn_at {self.config.warn_at:.0%})", logging.WARNING)
            events.append((f"{EVENT_PREFIX}/warning", fraction, step))
        starts = level == "act" and not self._in_episode
        if starts:
            self._in_episode = True
            self.episode += 1
        elif self._in_episode and level == "ok":  # below warn_at: the episode is over
            self._in_episode = False
            self._log(f"step {step}: memory back below warn_at ({fraction:.1%}); episode {self.episode} ended")
        if level == "act":
            for action in self.config.actions:
                if action in ONCE_PER_EPISODE and not starts:
                    continue
                done = self._run(action, step)
                self.actions_taken.append({"step": step, "action": action, "fraction": fraction, "done": done,
                                           "episode": self.episode})
                self.session.record_event("monitor_action", step=step, action=action, done=done)
                events.append((f"{EVENT_PREFIX}/action/{action}", 1.0 if done else 0.0, step))
        quiet = level == "ok" and not self._retried  # a step that ran out of memory is not quiet
        self._quiet_checks = self._quiet_checks + 1 if quiet else 0
        self._retried = False
        if self._restore_due():
            events.append(self._restore(step))
        self.level = level
        self._emit(events)
        if self.session.calibration is not None:
            self.session.calibration.window_started()  # after this check's actions
        return level

    def _compare(self, step: int, peak: int, predicted: int) -> None:
        """Warn once when the measured peak leaves the calibrated prediction for the same shapes by more
        than `GROWTH_WARNING` (memory kept across steps, fragmentation, something unmodelled), and
        once when it comes back."""
        above = peak > predicted * (1 + GROWTH_WARNING)
        if above and not self._above_prediction:
            self._log(f"step {step}: peak {format_bytes(peak)} is {peak / predicted - 1:.1%} above the calibrated "
                      f"prediction {format_bytes(predicted)} for these input shapes: memory this step keeps that "
                      "earlier steps did not (tensors held across steps, e.g. losses kept with their graph)",
                      logging.WARNING)
        elif not above and self._above_prediction:
            self._log(f"step {step}: peak {format_bytes(peak)} back within the calibrated prediction")
        self._above_prediction = above

    def _plan_check(self, step: int, fraction: float, level: str) -> bool:
        """Say once (until a step is back within the budget) when a step of the plan made before the run
        peaks more than `PLAN_TOLERANCE` above the budget on some rank; the actions at ``act_at`` take over.
        Returns whether it said so now."""
        planner = self.session.activation_planner
        planned = getattr(planner, "planned_step_peak", None)
        if planned is None:
            return False
        missed = fraction > 1 + PLAN_TOLERANCE
        says = missed and not self._plan_missed
        if says:
            acting = ", ".join(self.config.actions) if level == "act" else "none"
            self._log(f"step {step}: the plan made before the run missed its budget: peak {fraction:.1%} of "
                      f"memory_budget {format_bytes(self.budget)} on the fullest rank, above the stated tolerance "
                      f"of {PLAN_TOLERANCE:.0%} (predicted {format_bytes(planned)}): memory the estimate did not see "
                      f"(tensors the script holds, hooks, fragmentation) or a miss of the estimate; the monitor's "
                      f"actions take over ({acting})",
                      logging.WARNING)
        elif self._plan_missed and fraction <= 1:
            self._log(f"step {step}: peak back within memory_budget ({fraction:.1%})")
        self._plan_missed = missed or (self._plan_missed and fraction > 1)
        return says

    def peak(self) -> MemoryReport:
        """The highest device memory over every step so far: the checks' and the window still open."""
        current = self.window.peak_bytes
        if self._peak is not None and self._peak.peak_bytes >= current:
            return self._peak
        return MemoryReport.of(current, self.window.report() if self.on_cpu else None, self.engine.global_steps,
                               self.budget)

    def figures(self) -> dict:
        calibration = self.session.calibration
        out = {"calibration": calibration.as_dict()} if calibration is not None else {}
        if self.guard is not None:
            out["oom_retries"] = list(self.guard.retries)
        return out

    # actions ----------------------------------------------------------------------------------
    def _restore_due(self) -> bool:
        after = self.config.restore_after_steps
        return bool(after and self.splitter is not None and self.splitter.pieces > 1 and self._quiet_checks >= after)

    def _restore(self, step: int) -> tuple:
        """Double the micro-batch's pieces back one level (every rank: the inputs were agreed)."""
        self.splitter.pieces //= 2
        self._quiet_checks = 0
        micro = self.engine.train_micro_batch_size_per_gpu()
        self._log(f"step {step}: {self.config.restore_after_steps} quiet check(s); micro-batch {micro} now runs as "
                  f"{self.splitter.pieces} piece(s) of {micro // self.splitter.pieces}")
        self.actions_taken.append({"step": step, "action": "restore_micro_batch", "fraction": None, "done": True,
                                   "episode": self.episode})
        self.session.record_event("monitor_action", step=step, action="restore_micro_batch", done=True)
        return (f"{EVENT_PREFIX}/action/restore_micro_batch", 1.0, step)

    def _run(self, action: str, step: int) -> bool:
        if action == "empty_cache":
            gc.collect()
            self.accel.empty_cache()
            self._log(f"step {step}: memory above act_at; freed allocator caches", logging.WARNING)
            return True
        if action == "checkpoint":
            tag = f"xirang-step{step}"
            self.engine.save_checkpoint(self.config.checkpoint_dir, tag=tag)
            self._log(f"step {step}: memory above act_at; saved checkpoint {self.config.checkpoint_dir}/{tag}",
                      logging.WARNING)
            return True
        if action == "halve_micro_batch":
            k = self.splitter.pieces * 2
            if not self.splitter.can_split(k):
                self._log(f"step {step}: cannot halve the micro-batch again "
                          f"({self.engine.train_micro_batch_size_per_gpu()} samples in {self.splitter.pieces} pieces)",
                          logging.WARNING)
                return False
            self.splitter.pieces = k
            micro = self.engine.train_micro_batch_size_per_gpu()
            self._log(f"step {step}: memory above act_at; micro-batch {micro} now runs as {k} pieces of "
                      f"{micro // k} with the accumulation boundary held (global batch unchanged)",
                      logging.WARNING)
            return True
        if action in ("raise_recompute", "raise_compression"):
            activations = self.session.activation_planner
            changed = activations.raise_recompute() if action == "raise_recompute" else activations.raise_compression()
            self._log(f"step {step}: memory above act_at; " + (
                f"{action}: the activation plan moved one more module off the device" if changed else
                f"{action}: no module left to change (or the plan is not made yet)"), logging.WARNING)
            return changed
        raise XirangConfigError([("xirang.monitor.actions", f"action {action!r} is not built yet")])

    def _log(self, message: str, level: int = logging.INFO) -> None:
        if self.engine.global_rank == 0:
            logger.log(level, "xirang monitor: %s", message)

    def _emit(self, events: list) -> None:
        monitor = getattr(self.engine, "monitor", None)
        if self.config.to_deepspeed_monitor and monitor is not None and monitor.enabled:
            monitor.write_events(events)

    # ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"pieces": self.splitter.pieces if self.splitter else 1, "level": self.level,
                "episode": self.episode, "in_episode": self._in_episode, "quiet_checks": self._quiet_checks}

    def load_state_dict(self, state: dict) -> None:
        if self.splitter is not None:
            self.splitter.pieces = int(state.get("pieces", 1))
        self.level = state.get("level", "ok")
        self.episode = int(state.get("episode", 0))
        self._in_episode = bool(state.get("in_episode", False))
        self._quiet_checks = int(state.get("quiet_checks", 0))


__all__ = ["MonitorPlugin", "resolve_budget"]
