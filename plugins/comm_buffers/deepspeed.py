"""comm_buffers under DeepSpeed: the ZeRO-1/2 reduction buckets served from one arena, lent to activations
between reductions, and resized between steps (``adapt``); see the package docstring."""
from __future__ import annotations

from typing import Any, Optional

from xirang_ds.compat.deepspeed import gradient_reduction_dtype
from xirang_ds.config.types import format_bytes
from xirang_ds.hooks import wrap_method
from xirang_ds.plugins.comm_buffers import MAX_REDUCTIONS_PER_STEP, PRESSURE
from xirang_ds.plugins.comm_buffers.arena import Arena, ArenaLender, ArenaServer, bucket_slots, reductions_ordered
from xirang_ds.registry import FrameworkPath


class DeepSpeedBuffers(FrameworkPath):
    """DeepSpeed's ZeRO optimizer: its reduction buckets and the engine's step."""

    def __init__(self, plugin: Any):
        super().__init__(plugin)
        self._window: Any = None

    def attach(self, engine: Any) -> None:
        p = self.plugin
        opt = engine.optimizer
        slots = bucket_slots(opt)
        if p.config.arena and slots is not None:
            size = int(opt.reduce_bucket_size)
            p.arena = Arena(size, slots, gradient_reduction_dtype(opt), engine.device)
            self._mark_arena()
            p.server = p.keep(ArenaServer(opt, p.arena))
            if p.config.lend_to_activations:
                self._start_lending(opt)
        if slots is not None and hasattr(opt, "reduce_ipg_grads"):
            p.keep(wrap_method(opt, "reduce_ipg_grads", self._count))
        if (p.config.adapt or p.lender is not None) and slots is not None:
            p.keep(wrap_method(engine, "step", self._step))
            self._window = p.session.open_peak_window()

    def _start_lending(self, opt: Any) -> None:
        p = self.plugin
        if len(getattr(opt, "ipg_buckets", {}) or {}) != 1:
            p.log(f"lend_to_activations: not lending ({len(opt.ipg_buckets)} communication dtypes, so the "
                  "arena holds one bucket per dtype; lending handles one)")
            return

        unsafe = reductions_ordered() if getattr(opt, "reduction_stream", None) is not None else None
        if unsafe is not None:
            p.log(f"lend_to_activations: not lending ({unsafe})")
            return
        p.lender = p.keep(ArenaLender(opt, p.arena))
        p.log(f"lending the arena ({format_bytes(p.arena.nbytes)}) to saved activations between reductions")

    def _mark_arena(self) -> None:
        p = self.plugin
        tracker = p.session.started_tracker
        if tracker is not None and p.arena is not None:
            tracker.mark([p.arena.buffer], "comm_buffers")

    def _count(self, original, *args: Any, **kwargs: Any) -> Any:
        p = self.plugin
        p.reductions += 1
        return original(*args, **kwargs)

    # adapting -------------------------------------------------------------------------------------
    def _step(self, original, *args: Any, **kwargs: Any) -> Any:
        p = self.plugin
        before = p.engine.global_steps
        result = original(*args, **kwargs)
        if p.engine.global_steps != before:
            if p.lender is not None:
                p.lender.stats.end_step(p.engine.global_steps)
            if p.config.adapt and p.engine.global_steps % p.config.adapt_every_steps == 0:
                self.adapt()
            p.reductions = 0
        return result

    def _peak(self) -> int:
        p = self.plugin
        if self._window is None:  # adapt() called by hand before any step opened one
            self._window = p.session.open_peak_window()
        peak = self._window.peak_bytes  # since the previous decision, not an all-time peak
        self._window.reset()
        return peak

    def adapt(self) -> Optional[dict]:
        """One adaptation decision (all ranks decide alike: the inputs are agreed by all_reduce)."""
        import torch

        p = self.plugin
        opt = p.engine.optimizer
        size = int(opt.reduce_bucket_size)
        budget = p.budget_bytes()
        peak = self._peak()
        stats = torch.tensor([peak, p.reductions], dtype=torch.float64)
        import deepspeed.comm as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            stats = stats.to(p.engine.device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        peak, reductions = int(stats[0].item()), int(stats[1].item())
        extra = size * p.elem_bytes * p.buffers
        new, reason = size, None
        if peak > PRESSURE * budget and size > p.floor:
            new = max(p.floor, size // 2)
            reason = f"step peak {format_bytes(peak)} is above {PRESSURE:.0%} of the budget {format_bytes(budget)}"
        elif reductions > MAX_REDUCTIONS_PER_STEP and size * 2 <= p.cap and peak + extra < PRESSURE * budget:
            new = size * 2
            reason = f"{reductions} reductions in the last backward (> {MAX_REDUCTIONS_PER_STEP}) with headroom"
        if new == size:
            return None
        opt.reduce_bucket_size = new
        change = {"step": p.engine.global_steps, "from": size, "to": new, "why": reason}
        p.changes.append(change)
        p.session.record_event("comm_buffers_resize", **change)
        if p.arena is not None:
            self.replace_arena(Arena(new, p.arena.slots, p.arena.dtype, p.arena.device))
        p.log(f"step {change['step']}: reduce_bucket_size {size:,} -> {new:,} elements ({reason})")
        return change

    def replace_arena(self, arena: Any) -> None:
        """Serve (and lend) from ``arena`` from now on."""
        p = self.plugin
        p.arena = arena
        p.server.replace(arena)
        if p.lender is not None:
            p.lender.replace(arena)
        self._mark_arena()


__all__ = ["DeepSpeedBuffers"]
