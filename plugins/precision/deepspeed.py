"""precision under DeepSpeed: the kernels on ``engine.module``, fp16 loss scaling around the engine's
backward and step (`grad_scaling.GradScaling`), and at ZeRO 1/2 with on-demand copies the fp32 masters
shared with the model's weights (`zero_masters.share_fp32_masters`)."""
from __future__ import annotations

import logging
from typing import Any

from xirang_ds.plugins.precision.grad_scaling import GradScaling
from xirang_ds.plugins.precision.zero_masters import share_fp32_masters
from xirang_ds.registry import FrameworkPath

logger = logging.getLogger("xirang_ds")


class DeepSpeedPrecision(FrameworkPath):
    """The DeepSpeed engine's model, loss scaling and master weights."""

    def attach(self, engine: Any) -> None:
        p = self.plugin
        for handle in p.runtime.attach(engine.module):
            p.keep(handle)
        p.scaling = GradScaling(engine, p.plan)
        for handle in p.scaling.attach():
            p.keep(handle)
        if p.plan.on_demand and p.plan.zero_stage in (1, 2):
            reason = share_fp32_masters(engine.optimizer)
            p.masters_shared = reason is None
            if reason is not None and engine.global_rank == 0:
                logger.info("xirang precision: fp32 masters stay a separate copy: %s", reason)
        if p.pending_state is not None:
            p.scaling.load_state_dict(p.pending_state)
            p.pending_state = None


__all__ = ["DeepSpeedPrecision"]
