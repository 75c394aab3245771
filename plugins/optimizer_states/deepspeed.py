"""optimizer_states under DeepSpeed: the ds_config it refuses, and the basic optimizer swapped in its wrappers.

* DeepSpeed's wrappers hold the basic optimizer as ``.optimizer`` (ZeRO 1/2/3, the bf16 and the fp16
  optimizers), besides ``engine.basic_optimizer``, or ``engine.optimizer`` without a wrapper; it is
  swapped when the plugin is removed (`swap_basic_optimizer`).
* ZeRO 1/2 and the bf16 optimizer keep views of every optimizer-state tensor shaped like the fp32
  partition for ``safe_get_full_optimizer_state``. After a tensor's states change format those views
  would keep the old fp32 buffers alive, so the links are rebuilt (`relink_state_views`, through
  `xirang_ds.compat.deepspeed.relink_hp_params`; quantized buffers have another shape and are not
  linked, and DeepSpeed's per-parameter state getters then report no state for them).

``tests/optimizer_states/test_deepspeed.py`` fails when a DeepSpeed release moves these.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

import torch

from xirang_ds.compat.deepspeed import relink_hp_params, zero3_param_groups
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.plugins.optimizer_states import build
from xirang_ds.plugins.optimizer_states.build import settings_from_spec
from xirang_ds.plugins.optimizer_states.export import to_torch_optimizer
from xirang_ds.plugins.optimizer_states.masters import ParkedMasters, zero3_problem
from xirang_ds.plugins.optimizer_states.optimizer import DynamicAdamW
from xirang_ds.registry import FrameworkPath, OptimizerSpec

logger = logging.getLogger("xirang_ds")

SECTION = "xirang.optimizer_states"
PARKED_MASTERS = ("remainders", "remainders_8bit", "none")
"""``masters`` values that park DeepSpeed's ZeRO-3 masters (`masters.ParkedMasters`): ZeRO-3 in bf16 only."""


def check_ds_config(config: Any, ds_config: dict) -> None:
    """Refuse ds_config settings this plugin cannot work with, before DeepSpeed starts.

    Raises:
        XirangConfigError: every problem of `ds_config_problems`.
    """
    problems = ds_config_problems(config, ds_config)
    if problems:
        raise XirangConfigError(problems)


def ds_config_problems(config: Any, ds_config: dict) -> list[tuple[str, str]]:
    """The ds_config settings this plugin, configured as ``config``, cannot work with: optimizer
    offload (DeepSpeed then steps its own CPU Adam on host memory); ``masters`` ``"remainders"`` or
    ``"none"`` other than at ZeRO-3 in bf16; an ``optimizer`` block `build.settings_from_spec` refuses
    (not Adam or AdamW, amsgrad, a key it does not know)."""
    zero = ds_config.get("zero_optimization") or {}
    problems = []
    spec = ds_config.get("optimizer")
    if isinstance(spec, dict):
        try:
            settings_from_spec(str(spec.get("type", "")), dict(spec.get("params") or {}))
        except XirangConfigError as e:
            problems.extend(e.problems)
    offload = zero.get("offload_optimizer") or {}
    if isinstance(offload, dict) and offload.get("device") not in (None, "none"):
        problems.append((f"{SECTION}.enabled",
                         f"zero_optimization.offload_optimizer.device is {offload.get('device')!r}: DeepSpeed then "
                         f"keeps the optimizer states in host memory and steps its own CPU Adam, so there are no "
                         f"device states to shrink. Fix: remove offload_optimizer or disable optimizer_states"))
    masters = getattr(config, "masters", "auto")
    if masters in PARKED_MASTERS:
        stage = int(zero.get("stage", 0) or 0)
        if stage != 3:
            problems.append((f"{SECTION}.masters",
                             f"is {masters!r} but zero_optimization.stage is {stage}: this key keeps DeepSpeed's "
                             f"ZeRO-3 masters; at ZeRO 0-2 grad_release keeps them "
                             f"(grad_release.masters: remainders, remainders_8bit or none). "
                             f"Fix: set masters \"auto\" or \"fp32\", or enable grad_release"))
        if (ds_config.get("bf16") or {}).get("enabled") not in (True, "true"):
            why = ("remainders rebuild an fp32 master from its bf16 rounding (an fp16 weight is not the top half "
                   "of an fp32 number)" if masters in ("remainders", "remainders_8bit") else
                   "'none' rounds each update stochastically into bf16 weights")
            problems.append((f"{SECTION}.masters",
                             f"is {masters!r} but bf16.enabled is not true: {why}. "
                             "Fix: enable bf16, or set masters \"auto\" or \"fp32\""))
    return problems


def relink_state_views(engine: Any) -> None:
    """Rebuild DeepSpeed's views of the optimizer states (see the module docstring)."""
    wrapper = getattr(engine, "optimizer", None)
    if not getattr(wrapper, "cpu_offload", False):
        relink_hp_params(wrapper)


def swap_basic_optimizer(engine: Any, old: Any, new: Any) -> None:
    """Put ``new`` wherever the engine and its wrapper hold ``old``.

    Raises:
        RuntimeError: ``old`` is not found (a DeepSpeed release moved the attribute).
    """
    found = False
    if getattr(engine, "basic_optimizer", None) is old:
        engine.basic_optimizer = new
        found = True
    wrapper = getattr(engine, "optimizer", None)
    if wrapper is old:
        engine.optimizer = new
        found = True
    elif getattr(wrapper, "optimizer", None) is old:
        wrapper.optimizer = new
        found = True
    if not found:
        raise RuntimeError(f"xirang optimizer_states: cannot find the basic optimizer in {type(wrapper).__name__}; "
                           "this DeepSpeed version is not supported")


class DeepSpeedStates(FrameworkPath):
    """`DynamicAdamW` as DeepSpeed's basic optimizer: built from the ``optimizer`` block or the client's."""

    def keep_reasons(self, model: torch.nn.Module) -> dict[int, str]:
        """No reasons beyond the section's own (`build.keep_reasons`)."""
        return {}

    def prepare_optimizer(self, optimizer: Any) -> Any:
        p = self.plugin
        if isinstance(optimizer, OptimizerSpec):
            p.source = f"ds_config optimizer {optimizer.type}"
            return self._capture(build.from_spec(optimizer.type, optimizer.params, p.config, p.model))
        if isinstance(optimizer, torch.optim.Optimizer):
            p.source = f"client {type(optimizer).__name__}"
            p.original = optimizer
            p.optimizer = build.from_client(optimizer, p.config, p.model)
            p.optimizers = [p.optimizer]
            return p.optimizer
        if callable(optimizer):  # a client callable: build theirs, then replace it
            p.source = "client callable"

            def make(params: Any) -> Any:
                p.original = optimizer(params)
                return build.from_client(p.original, p.config, p.model)

            return self._capture(make)
        raise XirangConfigError([("optimizer", build.unsupported_message(type(optimizer).__name__))])

    def _capture(self, make: Any) -> Any:
        p = self.plugin

        def built(params: Any) -> Any:
            p.optimizer = make(params)
            p.optimizers = [p.optimizer]
            return p.optimizer

        built.__name__ = built.__qualname__ = "DynamicAdamW"
        return built

    def attach(self, engine: Any) -> None:
        p = self.plugin
        if not isinstance(getattr(engine, "basic_optimizer", None), DynamicAdamW):
            raise RuntimeError("xirang optimizer_states: DeepSpeed did not take the optimizer this plugin built "
                               f"(basic optimizer: {type(getattr(engine, 'basic_optimizer', None)).__name__})")
        p.optimizer = engine.basic_optimizer
        p.optimizers = [p.optimizer]
        p.keep(p.optimizer.register_format_change_hook(lambda opt, param, old, new: relink_state_views(engine)))
        p.use_pool()
        self._park_masters(engine)
        if engine.global_rank == 0:
            logger.info("xirang optimizer_states: %s replaced by DynamicAdamW; %d parameter(s) keep fp32 states; "
                        "masters: %s", p.source, len(p.keep_reasons), p.masters_line)

    def _park_masters(self, engine: Any) -> None:
        """``masters``: ZeRO-3's fp32 masters kept as remainders where they can be (`masters.py`)."""
        p = self.plugin
        if p.config.masters == "fp32":
            p.masters_line = "fp32 (masters: fp32)"
            return
        problem = zero3_problem(engine.optimizer) if p.session.stepper is None else "grad_release holds them"
        if problem is not None:
            if p.config.masters in PARKED_MASTERS:
                raise XirangConfigError([(f"{SECTION}.masters", f"is {p.config.masters!r} but {problem}. "
                                                                 "Fix: set masters \"auto\" or \"fp32\"")])
            p.masters_line = f"as the run keeps them ({problem})"
            return
        stochastic, eight = p.config.masters == "none", p.config.masters == "remainders_8bit"
        parked = ParkedMasters(engine.optimizer, p.session.tracker.scope, stochastic=stochastic, eight=eight)
        count = len(parked.masters)
        p.keep_parked([parked], f"none (no master: each update rounded stochastically into the bf16 weights; one of "
                                f"{count} sub-group(s) widened at a time)" if stochastic else
                      f"remainders_8bit (ZeRO-3's fp32 masters to 16 significant bits, 8-bit remainders between "
                      f"updates; one of {count} sub-group(s) whole at a time)" if eight else
                      f"remainders (ZeRO-3's fp32 masters as bf16 remainders between updates; one of "
                      f"{count} sub-group(s) whole at a time)")

    def states_moved(self) -> None:
        """Quantized buffers moved into the pool: DeepSpeed's views of the states are rebuilt."""
        relink_state_views(self.plugin.engine)

    def remove(self) -> None:
        """Hand the engine a ``torch.optim`` Adam/AdamW with the states decoded to fp32."""
        p = self.plugin
        if p.engine is None or p.optimizer is None:
            return
        wrapper = p.engine.optimizer
        # ZeRO-3 puts its flat partitions into the param groups only around a step (and a save)
        with zero3_param_groups(wrapper) if hasattr(wrapper, "fp32_partitioned_groups_flat") else nullcontext():
            replacement = to_torch_optimizer(p.optimizer, into=p.original)
        swap_basic_optimizer(p.engine, p.optimizer, replacement)


__all__ = ["DeepSpeedStates", "check_ds_config", "ds_config_problems", "relink_state_views", "swap_basic_optimizer"]
