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

from xirang_ds.compat.torch import storage_key
from xirang_ds.config.loader import BLOCK_KEY
from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.memory.calibration import InputSignature, ModelTwin
from xirang_ds.memory.categories import TEMPORARIES
from xirang_ds.memory.storages import tensors_in
from xirang_ds.planning.suggest import least_fitting_budget
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
    held = held_besides_the_run(tracker, args, kwargs)
    ds_config, total = session.requested_ds_config, int(acc.total_memory())
    budget = session.config.memory_budget

    def estimate(config: dict, device_total: int) -> Any:
        with tracker.paused() if tracker is not None else contextlib.nullcontext():
            return session.estimator.estimate_run(twin.build, config, world_size=session.world_size, device=device,
                                                  inputs=sig.fake, device_profile=plugin.device_profile,
                                                  device_total_bytes=device_total, timed=False)

    try:
        est = estimate(ds_config, total)  # the plan `xirang-ds estimate` makes, which knows nothing the script holds
        beside = held and fits_beside(est, plugin.section, held, total if budget == "auto" else int(budget))
        if held and not beside:  # what the user holds on the device comes off the budget, and the plan is made again
            total -= held
            if budget != "auto":
                ds_config = {**ds_config, BLOCK_KEY: {**ds_config[BLOCK_KEY], "memory_budget": int(budget) - held}}
            est = estimate(ds_config, total)
    except XirangConfigError:
        raise
    except Exception as e:  # fake tensors cannot run every model (data-dependent shapes, custom ops)
        return None, (f"the estimator could not trace this model on {sig.describe()} ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:200]})")
    plan = est.plans.get(plugin.section)
    if plan is None:
        note = next((n for n in est.notes if n.startswith(f"{plugin.section}:")), "")
        return None, note or "the estimate does not model this block's activation options"
    stepper = session.stepper
    if not plan.fits:
        fixes = stepper.budget_fixes() if stepper is not None else ""  # what the run's stepper can still lower
        least = least_fitting_budget(ds_config, lambda c: estimate(c, total), plan.least_budget_bytes)[0] \
            if budget != "auto" else None
        raise XirangConfigError(plan.refusal(budget, f"planned before the run for a batch of {sig.describe()}", held,
                                             fixes, least))
    if est.host_refusal:  # the host tiers, the offloads' included
        raise XirangConfigError([("xirang.host_memory_budget", f"{est.host_refusal} (planned before the run for a "
                                                               f"batch of {sig.describe()})")])
    plan.step_peak_bytes = est.bound_bytes + held  # what the plan promises, whatever the data give
    if stepper is not None and stepper.tier_pending:
        states = est.plans.get("grad_release") or {}
        stepper.settle_tier(states.get("states") == "host", states.get("why") or "")
    if not held:
        return plan, ""
    return plan, f"{format_bytes(held)} of it held on the device besides the run: " + (
        "the plan of the whole budget fits beside it" if beside else "taken off the budget")


def fits_beside(est: Any, section: str, held: int, limit: int) -> bool:
    """The estimate's plan (``est``, at the whole budget ``limit``) fits with ``held`` more bytes on the device: then
    the run takes it, the plan ``xirang-ds estimate`` makes, and plans again with ``held`` taken off only where it
    does not (so a few bytes a script keeps on the device do not move a plan that has room for them)."""
    plan = est.plans.get(section)
    return (plan is not None and plan.fits and not est.host_refusal
            and est.bound_bytes + held <= limit)


def held_besides_the_run(tracker: Any, args: tuple, kwargs: dict) -> int:
    """Device bytes live as the first forward starts that belong to no role of the run, less this batch: what
    the user keeps on the device beside the training (a dataset, another model), which the estimate cannot
    know and the plan must leave room for. Known where the live tracker runs (0 elsewhere)."""
    if tracker is None:
        return 0
    loose = tracker.live_by_category().get(TEMPORARIES, 0)
    batch = {storage_key(t.untyped_storage()): t.untyped_storage().nbytes()
             for t in tensors_in((args, kwargs)) if t.device.type == tracker.device_type}
    return max(0, loose - sum(batch.values()))


__all__ = ["BEFORE_RUN", "fits_beside", "held_besides_the_run", "plan_before_run", "twin_for"]
