"""The optional roles of a plugin: one small protocol each, implemented by the plugins that play it.

`xirang_ds.registry.Plugin` holds only the seams every plugin has (prepare the model and the optimizer,
attach, remove, describe); what only some plugins do is a role here, as torchtitan keeps one small
protocol per role (``protocols/``). A plugin plays a role by defining its methods; the session and the
planners ask for the plugins that play it (`xirang_ds.session.Session.plugins_with`, or ``issubclass`` on
a plugin class before one is built) and leave the others alone, which is what the old no-op defaults did.

Every protocol is ``runtime_checkable``: ``isinstance`` and ``issubclass`` check that the methods exist.
This module imports nothing of the package, so any layer may name a role.
"""
from __future__ import annotations

from typing import Any, ContextManager, Hashable, Optional, Protocol, runtime_checkable


@runtime_checkable
class EditsDsConfig(Protocol):
    """It edits the ds_config DeepSpeed will see (bucket sizes, stage, precision)."""

    def prepare_ds_config(self, ds_config: dict) -> None:
        """Edit the ds_config DeepSpeed will see (a private copy)."""


@runtime_checkable
class EditsDdpConfig(Protocol):
    """Megatron-core's counterpart of `EditsDsConfig`."""

    def prepare_ddp_config(self, ddp_config: Any) -> None:
        """Edit the ``DistributedDataParallelConfig`` before Megatron's DDP wraps the model."""


@runtime_checkable
class FitsDsConfig(Protocol):
    """It says, before anything runs, whether it can run with the user's ds_config and optimizer, and
    whether a preset should turn it on there (`xirang_ds.planning.fit`). The methods are classmethods:
    the planner asks the plugin class (``issubclass(cls, FitsDsConfig)``). A plugin without the role can
    always run, always pays and keeps every key a preset set."""

    @classmethod
    def check_ds_config(cls, config: Any, ds_config: dict) -> list[tuple[str, str]]:
        """Problems running this plugin, configured as ``config``, with the user's ds_config (read
        before any plugin edits it). A preset leaves a plugin with problems out and says why; a
        section the user wrote is refused with them.

        Returns:
            ``[(path, message)]``, each message naming the key, its value, what is allowed and the
            fix (``" Fix: ..."``, dropped where a preset leaves the plugin out); empty when it can run.
        """

    @classmethod
    def check_optimizer(cls, config: Any, optimizer: Any) -> list[tuple[str, str]]:
        """As `check_ds_config`, for the optimizer ``initialize`` steps: the client's, the ds_config block's
        `xirang_ds.registry.OptimizerSpec`, or ``None`` (not asked where it is not known: ``xirang-ds validate``)."""

    @classmethod
    def preset_leave_out(cls, config: Any, ds_config: dict) -> Optional[str]:
        """Why a preset leaves this plugin out although it can run: with the user's ds_config it would
        lower nothing a step holds and only cost time (a section the user wrote runs as written). ``None``
        when it pays."""

    @classmethod
    def preset_fallbacks(cls, config: Any, ds_config: dict) -> list[tuple[str, Any, str]]:
        """Keys of this section, as a preset set them, that the user's ds_config cannot take, each with the
        value that replaces it and why (a key the user wrote is kept and meets `check_ds_config`).

        Returns:
            ``[(key, replacement, reason)]``; empty when every key can run.
        """


@runtime_checkable
class LowersBesidesActivations(Protocol):
    """It can still lower what a rank holds besides saved activations, losslessly, by a key of its own (grad_release:
    its optimizer states in host memory), which a budget's refusal names beside raising the budget. A classmethod:
    ``xirang-ds validate --model`` asks the plugin class; the run asks its stepper (``budget_fixes()``)."""

    @classmethod
    def budget_fix(cls, config: Any) -> str:
        """The fix, configured as ``config`` under DeepSpeed ("keep ... (xirang.<key> ...)"), or "" where the
        section already does it or cannot."""


@runtime_checkable
class RemarksOnAuto(Protocol):
    """It says what ``"preset": "auto"``'s line mentions of a candidate's estimate (grad_release: its optimizer
    states taken to host memory). A classmethod: `xirang_ds.planning.auto` asks the plugin class."""

    @classmethod
    def auto_remark(cls, notes: list) -> Optional[str]:
        """What the line adds after the estimate's figure (``", with ..."``), read from the estimate's
        ``notes``; ``None`` when it has nothing to add."""


@runtime_checkable
class Estimates(Protocol):
    """It models its effect on the estimator's prediction (`xirang_ds.planning.estimator`). A plugin
    without the role leaves the phases as they are when it is ``memory_neutral`` (it only observes), and
    otherwise the estimate notes that its effect is not modelled. One whose class sets ``adjusts_last``
    (the activation planner, which plans within what the others leave) adjusts after the others."""

    def adjust_estimate(self, phases: dict, shape: Any, numels: list) -> Optional[dict]:
        """Change the estimator's prediction for what this plugin does before anything runs.

        Args:
            phases: ``{"forward"|"backward"|"optimizer_step": {category: bytes}}`` for plain DeepSpeed.
            shape: the run's `xirang_ds.memory.run_shape.RunShape` (stage, dtype, world size, ...).
            numels: element count of each trainable parameter.

        Returns:
            The adjusted phases, or ``None`` when this plugin's effect is not modelled (the estimate then
            says so in its notes).
        """


@runtime_checkable
class PricesAtBound(Protocol):
    """It holds a size only the data decide (optimizer_states: a measured embedding's states, fp32 until its
    first update's error allows the policy's format). The estimate plans with it at its bound, and ``fits``,
    ``least_budget_bytes`` and the plan stand on that; it then prices the same plans again with the size at what
    the data give where the check passes, which is the predicted peak (`xirang_ds.planning.estimator`)."""

    def price_at_bound(self, bound: bool) -> None:
        """Whether `Estimates.adjust_estimate` prices the size at its bound (``True``, the default) or at what the
        data give where the check passes."""

    def bound_headroom(self, shape: Any) -> Optional[str]:
        """What the bound holds beyond the figure the data give where the check passes, said for the estimate's
        notes; ``None`` where the two are the same (no such size in this run)."""


@runtime_checkable
class TimesStep(Protocol):
    """It prices what it adds to a training step (`xirang_ds.planning.step_time`). A plugin without the role
    adds nothing when it is ``time_neutral``, and otherwise the predicted step time notes it as not priced."""

    def step_seconds(self, shape: Any, numels: list, profile: Any) -> Optional[float]:
        """Seconds this plugin adds to one optimizer step of the estimate on ``profile`` (a
        `xirang_ds.memory.device_profile.DeviceProfile`), or ``None`` where it cannot price them. Called after
        `Estimates.adjust_estimate`, so what the plugin planned for the estimate is known."""


@runtime_checkable
class CopiesBeside(Protocol):
    """Some of what it adds runs beside the compute stream (host copies on a side stream, the copy engine's work):
    the predicted step is the larger of the compute stream's parts and these (`xirang_ds.planning.step_time`)."""

    def beside_seconds(self, shape: Any, numels: list, profile: Any) -> float:
        """Seconds of one optimizer step on ``profile`` of the resource its work beside the compute stream runs on
        (the host link), that work and what of the compute stream's own (`TimesStep.step_seconds`) shares it."""


@runtime_checkable
class TimesUpdate(Protocol):
    """It runs the optimizer's update in place of torch's AdamW (low-bit states): the predicted step prices the
    update by it (`xirang_ds.planning.step_time`), DeepSpeed's work around the update (the gradient's upcast,
    clipping, the cast back into 16-bit weights) as before."""

    def update_ops(self, shape: Any, numels: list, profile: Any) -> Optional[Any]:
        """The ops of the update of one optimizer step on this rank as it runs on ``profile``'s device (an
        `xirang_ds.memory.device_profile.OpTally`), or ``None`` where it cannot count them (then torch's AdamW
        stands in, and the notes say so)."""

    def group_update_ops(self, shape: Any, pieces: list, profile: Any) -> Optional[Any]:
        """The ops of one optimizer step over ``pieces`` (``(parameter index, elements)``, the parameters indexed as
        the estimate's ``numels``): a `TimesGradients` plugin's own optimizer steps (a grad_release bucket's shard),
        or ``None`` where it cannot count them."""


@runtime_checkable
class TimesGradients(Protocol):
    """It reduces and steps the gradients in place of DeepSpeed's path (grad_release): the predicted step counts its
    ops there instead of DeepSpeed's (`xirang_ds.planning.step_time`)."""

    def gradient_ops(self, shape: Any, numels: list, profile: Any) -> Optional[tuple[Any, Any]]:
        """``(backward, boundary)``: `xirang_ds.memory.device_profile.OpTally` of its ops in one optimizer step's
        backwards (updates made there included) and after them on ``profile``'s device, the updates of its own
        optimizer steps with them (a `TimesUpdate` plugin's `TimesUpdate.group_update_ops` where one runs them);
        ``None`` where it cannot count them (DeepSpeed's path stands in, and the notes say so)."""

    def extra_backwards(self, shape: Any) -> int:
        """The model's backwards per optimizer step beyond one a micro-step that its method runs (grad_release's
        ``two_pass``: a norm-only backward before the boundary's): the step prices the trace's backward again
        for each."""


@runtime_checkable
class ReshapesRun(Protocol):
    """It changes what DeepSpeed runs, so the estimate's `RunShape` changes with it (precision's on-demand
    copies run DeepSpeed in fp32; optimizer_states' masters as views of the weights)."""

    def estimate_shape(self, shape: Any) -> Any:
        """The `xirang_ds.memory.run_shape.RunShape` the estimate uses, as this plugin changes it."""


@runtime_checkable
class ChangesTrace(Protocol):
    """It changes forward and backward, applied to the estimator's fake model while it is traced
    (`xirang_ds.memory.trace`), so the trace measures it."""

    def trace_context(self, model: Any, tracker: Any) -> Optional[ContextManager[Any]]:
        """What this plugin changes in forward and backward, as a context entered around the trace;
        ``None`` when the trace runs the model as it is.

        Args:
            model: the fake model (parameters in the estimate's dtype, under ``FakeTensorMode``).
            tracker: the trace's tracker (its ``scope`` gives roles).
        """

    def trace_key(self) -> Hashable:
        """What of this plugin's settings ``trace_context`` reads (not ``memory_budget``, which only the plan
        after the trace reads): estimates whose plugins give equal keys, on the same run shape, share one trace
        (`xirang_ds.planning.trace_cache`)."""


@runtime_checkable
class Checkpoints(Protocol):
    """It keeps state in engine checkpoints (`xirang_ds.checkpoints.engine_files`). A plugin without the
    role saves ``{}`` and loads nothing."""

    def state_dict(self) -> dict:
        """Plugin state for checkpoints (plain data)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""


@runtime_checkable
class LendsStorage(Protocol):
    """It lends idle device memory for other plugins' tensors (`xirang_ds.registry.STORAGE_LENDER`;
    comm_buffers' arena: `xirang_ds.session.Session.storage_lender`)."""

    def lent_storage(self) -> Any:
        """The `xirang_ds.plugins.activations.storage.StorageProvider` it lends now (``None`` until
        attached, or when nothing is lent in this run)."""


@runtime_checkable
class DropsGradients(Protocol):
    """It holds gradients of the step in progress itself (grad_release's buckets)."""

    def drop_gradients(self) -> None:
        """Forget every gradient this plugin holds for the step in progress, partial ones of an
        interrupted backward included: an out-of-memory retry (``monitor.on_oom``) runs the step's
        micro-batches again from the first (`xirang_ds.plugins.monitor.oom`)."""


@runtime_checkable
class SettlesLate(Protocol):
    """Its memory changes over the first steps (it profiles or warms up). A plugin without the role is
    settled from the start."""

    def settled(self) -> bool:
        """Whether this plugin's memory is as every later step will hold it (``False`` while it still
        profiles or warms up): the session calibrates its prediction on settled steps only
        (`xirang_ds.memory.calibration`)."""


@runtime_checkable
class ReportsFigures(Protocol):
    """It measures something in the run worth reporting (``xirang-ds bench`` JSON, the tuner)."""

    def figures(self) -> dict:
        """What the plugin measured in this run, as plain data; ``{}`` when there is nothing to report."""


ROLES = (EditsDsConfig, EditsDdpConfig, FitsDsConfig, RemarksOnAuto, Estimates, PricesAtBound, ReshapesRun,
         ChangesTrace, Checkpoints, LendsStorage, DropsGradients, SettlesLate, ReportsFigures)
"""Every role, for the structure test (each has a built-in plugin that plays it)."""
