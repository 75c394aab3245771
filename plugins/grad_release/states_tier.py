"""Where grad_release keeps its buckets' optimizer states: ``states: device``, ``host`` or ``auto``.

``auto`` decides twice, each time only where the device cannot hold them:

* at initialize (`choose_states_tier`, under DeepSpeed): where the estimate
  (`xirang_ds.planning.estimator.estimate_states`, the figure ``"preset": "auto"`` compares) puts them in
  host memory, by the plugin's own rule in ``adjust_estimate`` (with them on the device it is over
  ``memory_budget``; ``auto``: the device's capacity), they start there: the first steps would not fit
  otherwise;
* otherwise, where the activation planner profiles under a ``memory_budget`` in bytes, the states stay
  in host memory through its profiling passes (which then measure the rest besides activations without
  them, inside the budget), and the planner settles them (`settle_tier`, called by
  `xirang_ds.plugins.activations.pricing.plan_within`): back on the device where a plan fits with them
  there, else in host memory for good. A planner that settles without planning (every module fixed)
  brings them back at the next optimizer step (`settle_pending`).

`GradReleasePlugin` mixes this in; `parked_states.ParkedStates` moves the tensors.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from xirang_ds.config.loader import BLOCK_KEY
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.memory.run_shape import partition_numel
from xirang_ds.plugins.grad_release.parked_states import CopyStream

logger = logging.getLogger("xirang_ds")

HOST_NOTE = "optimizer states in host memory (states auto): "
"""How grad_release's estimate says it took the host for the states, before why (the estimate's notes)."""
STASH_NOTE = "gradient shard held in host memory until the norm is known (exact_method auto): "
"""How grad_release's estimate says it took the host for exact clipping's held shard, before why."""


def host_reason(notes: list[str]) -> Optional[str]:
    """Why an estimate (`xirang_ds.planning.estimator.Estimate`) put grad_release's states in host memory, or None."""
    prefix = f"grad_release: {HOST_NOTE}"
    return next((n[len(prefix):] for n in notes if n.startswith(prefix)), None)


def host_states_fix(config: Any, path: Any = None) -> str:
    """What grad_release (``config``) can still lower losslessly where a budget refuses the run, as a fix to name
    ("keep ...") or "": its optimizer states in host memory, where it keeps them on the device and the framework
    (``path``, a `xirang_ds.registry.FrameworkPath` class; default DeepSpeed's) takes ``states: host``."""
    if path is None:
        from xirang_ds.plugins.grad_release.deepspeed import DeepSpeedRelease as path
    refused = any(key == "states" for key, _ in path.check(dataclasses.replace(config, states="host")))
    if not config.enabled or config.states != "device" or refused:
        return ""
    return "keep the optimizer states in host memory (xirang.grad_release.states \"host\", lossless)"


class StatesTier:
    """The states' tier of `plugin.GradReleasePlugin` (a mixin: the plugin holds the state)."""

    tier_pending = False
    """``auto``: the states are in host memory until the activation planner settles them."""

    @classmethod
    def auto_remark(cls, notes: list[str]) -> Optional[str]:
        """`xirang_ds.roles.RemarksOnAuto`: ``preset: auto``'s line says where the estimate put the states on the
        host."""
        return ", with grad_release's optimizer states in host memory (states auto)" if host_reason(notes) else None

    def states_tier(self) -> str:
        """Where the buckets start: ``host`` when asked for, or when ``auto`` chose it or left it pending."""
        return "host" if self.config.states == "host" or self.parked_why or self.tier_pending else "device"

    def stashes_held(self, states_on_host: Optional[bool] = None) -> bool:
        """Exact clipping keeps the reduced shards in host memory until backward ends: ``exact_method: host``,
        or ``auto`` where the estimate needed the room or a planner decides under a byte budget
        (``stash_chosen``, `choose_states_tier`), or where the optimizer states are in host memory
        (``states_on_host``, default where they are now): the device could not fit them."""
        if self.config.exact_method != "auto":
            return self.config.exact_method == "host"
        return self.stash_chosen or (self.states_tier() == "host" if states_on_host is None else states_on_host)

    def exact_method_now(self) -> str:
        """``exact_method`` with ``auto`` resolved (`stashes_held`)."""
        method = self.config.exact_method
        return method if method != "auto" else "host" if self.stashes_held() else "hold"

    def choose_states_tier(self, model: Any) -> None:
        """``auto``: start in host memory where the estimate puts them there (its own rule, `adjust_estimate`:
        with them on the device it is over ``memory_budget``; ``auto``: the device's capacity); said in the
        summary, recorded as a ``states_to_host`` event. ``auto`` or ``host`` with ``host_memory_budget`` in
        bytes: refused here where the estimate's host tiers exceed it (its ``host_refusal``).

        Raises:
            XirangConfigError: the host tiers would not fit ``host_memory_budget``.
        """
        host_budget = self.session.config.host_memory_budget
        if self.config.states == "device" or self.config.states == "host" and host_budget == "auto":
            return
        from deepspeed.accelerator import get_accelerator

        budget = self.session.config.memory_budget
        requested = dict(self.session.requested_ds_config)
        if budget == "auto":
            requested[BLOCK_KEY] = {**requested[BLOCK_KEY], "memory_budget": int(get_accelerator().total_memory())}
        estimate = self.session.estimator.estimate_states(model, requested, self.session.world_size,
                                                          get_accelerator().device_name())
        if estimate.host_refusal:  # before the run, not in it
            raise XirangConfigError([("xirang.host_memory_budget",
                                      f"grad_release's host states and stash: {estimate.host_refusal}")])
        if self.config.states != "auto":
            return
        self.parked_why = host_reason(estimate.notes)
        # exact_method auto: the held shard goes to the host where the estimate needs the room, and while a
        # planner decides under a byte budget (it measures without the shard; `plugin.stashes_held`)
        self.stash_chosen = any(n.startswith(f"grad_release: {STASH_NOTE}") for n in estimate.notes)
        if self.parked_why is not None:
            self.session.record_event("states_to_host", reason=self.parked_why)
            return
        self.tier_pending = self.planner_decides()
        self.stash_chosen = self.stash_chosen or self.tier_pending

    def prefetches(self, device_type: str) -> bool:
        """Buckets on ``device_type`` fetch the next one's states ahead where those are in host memory
        (``prefetch_states``; ``auto``: off the CPU, where a side stream runs the copies)."""
        return self.config.states != "device" and self.stash_prefetches(device_type)

    def copy_stream(self) -> Optional[CopyStream]:
        """Where the states' host copies run ahead of the updates where they do (`prefetches`): the buckets'
        device's side stream, or none (the CPU: early and synchronous); None: just in time."""
        if not self.buckets or not self.prefetches(self.buckets[0].params[0].device.type):
            return None
        return CopyStream(self.buckets[0].params[0].device)

    def stash_prefetches(self, device_type: str) -> bool:
        """The stashed gradient shards' copies run on a side stream, each shard back while the bucket before it
        updates (exact clipping's ``host`` method), as ``prefetch_states`` has the states' (``auto``: where the
        device has streams; ``true``: on the CPU too, early and synchronous there, for tests)."""
        setting = self.config.prefetch_states
        return setting is True or (setting == "auto" and device_type != "cpu")

    def stash_copy_stream(self) -> Optional[CopyStream]:
        """Where the stash's copies run (`stash_prefetches`), where the run stashes; None: just in time."""
        if not self.buckets or not self.stashes_held():
            return None
        device = self.buckets[0].params[0].device
        return CopyStream(device) if self.stash_prefetches(device.type) else None

    def planner_decides(self) -> bool:
        """The activation planner plans under a ``memory_budget`` in bytes: it settles the states' tier, and
        ``exact_method: auto`` stashes the held shard in host memory meanwhile and after (`stashes_held`)."""
        planner = self.session.activation_planner
        c = planner.config if planner is not None else None
        return self.session.config.memory_budget != "auto" and c is not None and c.planner and c.follows_memory_budget

    @classmethod
    def budget_fix(cls, config: Any) -> str:
        """`xirang_ds.roles.LowersBesidesActivations`: `host_states_fix` under DeepSpeed."""
        return host_states_fix(config)

    def budget_fixes(self) -> str:
        """What this run's grad_release can still lower losslessly, for a budget's refusal (`host_states_fix`)."""
        return host_states_fix(self.config, type(self.path)) if self.buckets else ""

    def parkable_bytes(self) -> int:
        """Device bytes the optimizer states take there beyond the largest bucket's (which comes back for
        each update; fetched ahead, the largest adjacent pair's), where the planner may still choose their tier:
        0 unless ``auto`` and not settled on the host at initialize, and under Megatron-core."""
        if self.config.states != "auto" or not self.path.parks_states or (self.parked_why and not self.tier_pending):
            return 0
        held = [b.state_bytes() for b in self.buckets]
        back = max(held, default=0)
        copies = self.buckets[0].copies if self.buckets else None
        if copies is not None and copies.stream is not None:  # a copy back and the next copy in, together
            back = max((a + b for a, b in zip(held, held[1:])), default=back)
        return sum(held) - back

    def step_seconds(self, shape: Any, numels: list, profile: Any) -> float:
        """`xirang_ds.roles.TimesStep`: the host-link copies the estimate's tiers make each step on the compute
        stream, there and back (its ``estimate_plan``): the optimizer states where they are in host memory (their
        bytes; fetched ahead, only the first bucket's, which nothing precedes: `beside_seconds` has the rest), the
        reduced gradient shard where exact clipping stashes it there (on a side stream, `stash_prefetches`: only the
        first bucket's shard back)."""
        return self._link_bytes(shape, numels)[0] / profile.host_link_bytes_per_s

    def beside_seconds(self, shape: Any, numels: list, profile: Any) -> float:
        """`xirang_ds.roles.CopiesBeside`: where copies run on the side stream (the states' fetched ahead,
        ``prefetch_states``; the stashed shards', `stash_prefetches`), the host link's whole time a step, theirs and
        the compute stream's own (`step_seconds`): the link carries both, one copy at a time, so the step is no
        shorter."""
        on_stream, aside = self._link_bytes(shape, numels)
        return (on_stream + aside) / profile.host_link_bytes_per_s if aside else 0.0

    def _link_bytes(self, shape: Any, numels: list) -> tuple[int, int]:
        """Bytes over the host link a step ``(on the compute stream, on the side stream)``, from the estimate's
        plan: the states there and back, every bucket's but the first's fetch aside where fetched ahead; the
        stashed shard there in backward and back, every one but the first bucket's aside where it runs ahead."""
        plan = getattr(self, "estimate_plan", None) or {}
        on_stream = aside = 0
        if plan.get("states") == "host":
            first, states = plan.get("first_bucket_state_bytes"), plan.get("state_bytes", 0)
            on_stream += 2 * states if first is None else first
            aside += 0 if first is None else 2 * states - first
        if plan.get("stashes_shard"):  # in the reduced gradient's dtype
            first, shard = plan.get("first_bucket_stash_numel"), partition_numel(sum(numels), shape.world_size)
            size = plan.get("stash_bytes", 4)
            on_stream += size * (2 * shard if first is None else first)
            aside += 0 if first is None else size * (2 * shard - first)
        return on_stream, aside

    def settle_tier(self, on_host: bool, why: str = "") -> None:
        """``auto``: the optimizer states in host memory from now on (``why`` in the summary), or on the device."""
        for bucket in self.buckets:
            if on_host:
                bucket.states_on = "host"
                bucket.park_states()
            elif bucket.states_on == "host":
                bucket.unpark_states()
        self.tier_pending = False
        if on_host:
            self.parked_why = why
            self.session.record_event("states_to_host", reason=why)
            if self.engine is not None and self.engine.global_rank == 0:
                logger.info("xirang grad_release: optimizer states in host memory: %s", why)

    def settle_pending(self) -> None:
        """A pending tier the planner settled without planning: the states back on the device."""
        planner = self.session.activation_planner
        if self.tier_pending and (planner is None or planner.settled()):
            self.settle_tier(False)


__all__ = ["HOST_NOTE", "STASH_NOTE", "StatesTier", "host_reason"]
