"""Record a per-tensor memory timeline of one optimizer step and print its breakdown.

The window runs from the end of step ``step - 1`` to the end of step ``step`` (every micro-batch of
that step, its optimizer step included). Each rank writes ``timeline_rank<R>.<ext>`` into
``output_dir`` in the listed formats; rank 0 prints the breakdown at the peak, the phase of the
peak and the largest tensors. On CUDA the ``pickle`` format is the allocator's own snapshot
(``torch.cuda.memory._record_memory_history`` for that step).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from xirang_ds.hooks import wrap_method
from xirang_ds.plugins.profiler.config import ProfilerConfig
from xirang_ds.registry import Plugin, register_plugin

logger = logging.getLogger("xirang_ds")


@register_plugin(ProfilerConfig, section="profiler", order=80,
                 summary="Per-tensor memory timeline of one step.")
class ProfilerPlugin(Plugin):
    """Timeline of the configured step; ``files`` and ``report`` hold the results afterwards."""

    memory_neutral = time_neutral = True
    frameworks = ("deepspeed", "megatron")

    def __init__(self, config: ProfilerConfig, session):
        super().__init__(config, session)
        self.files: dict[str, str] = {}
        self.report = None
        self.timeline = None
        self._recording = False
        self.window = None
        self._module_handles_from = 0

    def attach(self, engine: Any) -> None:
        from deepspeed.accelerator import get_accelerator

        self.engine = engine
        self.cuda = get_accelerator().device_name() != "cpu"
        self.tracker = self.session.track_memory()
        self.keep(wrap_method(engine, "step", self._step))
        if self.config.step == engine.global_steps + 1:
            self._begin()

    def describe(self) -> str:
        return f"timeline of step {self.config.step} → {self.config.output_dir} ({', '.join(self.config.formats)})"

    def _step(self, original, *args: Any, **kwargs: Any) -> Any:
        before = self.engine.global_steps
        result = original(*args, **kwargs)
        now = self.engine.global_steps
        if now != before:
            if self._recording and now >= self.config.step:
                self._end()
            elif not self._recording and now + 1 == self.config.step:
                self._begin()
        return result

    def _begin(self) -> None:
        t = self.tracker
        self.window = t.open_window()
        t.record_uses = True
        self._module_handles_from = len(t._handles)
        t.watch_module(self.engine.module)
        if self.cuda and "pickle" in self.config.formats:
            from xirang_ds.compat.torch import record_memory_history

            record_memory_history(max_entries=1_000_000)
        self._recording = True

    def _zero_stage(self) -> int:
        """The ZeRO stage the user asked for: a plugin may run DeepSpeed at another underneath (grad_release
        runs it at stage 0 and shards itself), which the engine's own ``zero_optimization_stage()`` reports."""
        requested = self.session.requested_ds_config.get("zero_optimization") or {}
        return int(requested["stage"]) if "stage" in requested else self.engine.zero_optimization_stage()

    def _end(self) -> None:
        from xirang_ds.memory.report import breakdown_table, top_tensors_table
        from xirang_ds.memory.timeline import Timeline, export

        t = self.tracker
        self._recording = False
        t.record_uses = False
        while len(t._handles) > self._module_handles_from:
            t._handles.pop().remove()
        rank = self.engine.global_rank
        with t.paused():
            self.report = self.window.report(top=self.config.top_tensors)
            self.timeline = Timeline.from_tracker(t, self.window, meta={
                "step": self.config.step, "rank": rank, "world_size": self.engine.world_size,
                "zero_stage": self._zero_stage(),
                "micro_batch": self.engine.train_micro_batch_size_per_gpu(),
                "gradient_accumulation": self.engine.gradient_accumulation_steps(),
                "plugins": ", ".join(p.section for p in self.session.plugins)}, top=self.config.top_tensors)
            self.window.close()
            formats = [f for f in self.config.formats if not (self.cuda and f == "pickle")]
            self.files = export(self.timeline, self.config.output_dir, f"timeline_rank{rank}", formats)
            if self.cuda and "pickle" in self.config.formats:
                from xirang_ds.compat.torch import dump_memory_snapshot, record_memory_history

                path = os.path.join(self.config.output_dir, f"timeline_rank{rank}.pickle")
                dump_memory_snapshot(path)
                record_memory_history(enabled=None)
                self.files["pickle"] = path
        self.session.record_event("profile", step=self.config.step, files=dict(self.files),
                                  peak_bytes=self.report.peak_bytes)
        if rank == 0:
            logger.info("xirang profiler: step %d peak on rank 0\n%s\n%s\nfiles: %s", self.config.step,
                        breakdown_table(self.report), top_tensors_table(self.report),
                        ", ".join(self.files.values()))
