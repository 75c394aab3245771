"""The run takes the plan ``xirang-ds estimate`` makes: at the first forward, before it runs, the estimator
traces this run's model twin on this batch's shapes (`xirang_ds.memory.calibration`: no memory, no data)
and plans there (`trace_plan`), priced by this run's device profile, with this device's memory for
``memory_budget: auto``. The same config, model, world size, batch shapes and device profile give the same
plan on any machine, and the same as the estimate's; no profiling pass runs, so none runs above the budget.

Where the estimator cannot plan for the run (the model does not run on fake tensors, a fixed option the
trace does not apply, ``budget_fraction``, Megatron-core, compiled modules, whose calls a pass times rather
than counts) the plugin profiles its first passes as before, and says why.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.memory.calibration import InputSignature, ModelTwin
from xirang_ds.plugins.activations.trace_plan import TracePlan


BEFORE_RUN = "planned before the run on the estimator's trace"
"""How the plan log names a plan taken from the estimator (`ActivationsPlugin.plan_source`)."""


def twin_for(plugin: Any, model: torch.nn.Module) -> Optional[ModelTwin]:
    """The model's twin for planning before the run, taken at ``prepare_model`` (before DeepSpeed hooks the
    model), or ``None`` where the run cannot ask the estimator (see the module docstring)."""
    session = plugin.session
    if not plugin.config.planner or session.estimator is None or not plugin.path.plans_before_run:
        return None
    calibration = getattr(session, "calibration", None)
    if calibration is not None and calibration.twin is not None:
        return calibration.twin
    return ModelTwin(model)


def plan_before_run(plugin: Any, twin: ModelTwin, args: tuple, kwargs: dict) -> tuple[Optional[TracePlan], str]:
    """The estimator's plan for this run on this batch's shapes, or ``(None, why not)``.

    Raises:
        XirangConfigError: no plan meets the budget (the least budget and its parts named).
    """
    from deepspeed.accelerator import get_accelerator

    session, acc = plugin.session, get_accelerator()
    sig = InputSignature(args, kwargs)
    tracker = session.started_tracker
    device = "cpu" if torch.device(plugin.runtime.device).type == "cpu" else "cuda"
    try:
        with tracker.paused() if tracker is not None else contextlib.nullcontext():
            est = session.estimator.estimate_run(twin.build, session.requested_ds_config, world_size=session.world_size,
                                                 device=device, inputs=sig.fake, device_profile=plugin.device_profile,
                                                 device_total_bytes=int(acc.total_memory()))
    except XirangConfigError:
        raise
    except Exception as e:  # fake tensors cannot run every model (data-dependent shapes, custom ops)
        return None, (f"the estimator could not trace this model on {sig.describe()} ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:200]})")
    plan = est.plans.get(plugin.section)
    if plan is None:
        note = next((n for n in est.notes if n.startswith(f"{plugin.section}:")), "")
        return None, note or "the estimate does not model this block's activation options"
    if not plan.fits:
        budget = session.config.memory_budget
        raise XirangConfigError([(key, f"{message} (planned before the run for a batch of {sig.describe()}; "
                                       f"memory_budget {budget if budget == 'auto' else format_bytes(int(budget))}: "
                                       f"the least any plan meets is {format_bytes(plan.least_budget_bytes)}, "
                                       f"{format_bytes(plan.other_bytes)} besides saved activations)")
                                 for key, message in plan.problems])
    stepper = session.stepper
    if stepper is not None and stepper.tier_pending:
        states = est.plans.get("grad_release") or {}
        stepper.settle_tier(states.get("states") == "host", states.get("why") or "")
    return plan, ""


__all__ = ["BEFORE_RUN", "plan_before_run", "twin_for"]
