"""Where grad_release keeps its buckets' optimizer states: ``states: device``, ``host`` or ``auto``.

``auto`` decides twice, each time only where the device cannot hold them:

* at initialize (`choose_states_tier`, under DeepSpeed): if the estimator's model states, gradients
  and optimizer step with the states on the device (the figure ``"preset": "auto"`` compares,
  `xirang_ds.memory.estimator.estimate_states`) exceed ``memory_budget`` (``auto``: the device's
  capacity), the states start in host memory: the first steps would not fit otherwise;
* after the activation planner's profiling passes (`park_states`, called by
  `xirang_ds.plugins.activations.pricing.plan_within`): if no plan fits the budget with them on the
  device and one fits with them on the host, they move there, once.

`GradReleasePlugin` mixes this in; `parked_states.ParkedStates` moves the tensors.
"""
from __future__ import annotations

import logging
from typing import Any

from xirang_ds.config.types import format_bytes

logger = logging.getLogger("xirang_ds")


class StatesTier:
    """The states' tier of `plugin.GradReleasePlugin` (a mixin: the plugin holds the state)."""

    def states_tier(self) -> str:
        """Where the buckets start: ``host`` when asked for, or when ``auto`` chose it at initialize."""
        return "host" if self.config.states == "host" or self.parked_why else "device"

    def choose_states_tier(self, model: Any) -> None:
        """``auto``: start in host memory where the estimate with the states on the device is over
        ``memory_budget`` (``auto``: the device's capacity); said in the summary, recorded as a
        ``states_to_host`` event."""
        if self.config.states != "auto":
            return
        from deepspeed.accelerator import get_accelerator

        from xirang_ds.config.loader import BLOCK_KEY, deep_merge
        from xirang_ds.memory.estimator import estimate_states

        budget = self.session.config.memory_budget
        total = int(get_accelerator().total_memory()) if budget == "auto" else int(budget)
        requested = dict(self.session.requested_ds_config)  # the estimate's own auto would take the host
        requested[BLOCK_KEY] = deep_merge(requested[BLOCK_KEY], {"grad_release": {"states": "device"}})
        need = estimate_states(model, requested, self.session.world_size,
                               get_accelerator().device_name()).predicted_peak_bytes
        if need > total:
            self.parked_why = (f"the estimated model states, gradients and optimizer step with them on the device, "
                               f"{format_bytes(need)}, exceed memory_budget {format_bytes(total)}")
            self.session.record_event("states_to_host", reason=self.parked_why)

    def budget_fixes(self) -> str:
        """What grad_release can still lower losslessly, for a memory_budget error (", or ...")."""
        if self.config.states == "device" and self.buckets:
            return ", keep the optimizer states in host memory (xirang.grad_release.states \"host\", lossless)"
        return ""

    def parkable_bytes(self) -> int:
        """Device bytes ``auto`` frees by moving the optimizer states to host memory now: all the buckets'
        but the largest bucket's, which comes back for each update (0 unless auto, and under Megatron-core)."""
        if self.config.states != "auto" or not self.path.parks_states:
            return 0
        held = [b.state_bytes() for b in self.buckets if b.states_on == "device"]
        return sum(held) - max(held, default=0)

    def park_states(self, why: str) -> None:
        """``auto``: keep the optimizer states in host memory from now on (`parked_states.ParkedStates`)."""
        for bucket in self.buckets:
            bucket.states_on = "host"
            bucket.park_states()
        self.parked_why = why
        self.session.record_event("states_to_host", reason=why)
        if self.engine is not None and self.engine.global_rank == 0:
            logger.info("xirang grad_release: optimizer states moved to host memory: %s", why)


__all__ = ["StatesTier"]
