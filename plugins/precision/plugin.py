"""The precision plugin: op lists at the autocast dispatch key, fp32 masters kept once, fp16 loss scaling.

Seams (in plugin order 20, before anything reads dtypes):

* ``prepare_ds_config``: decide dtype, loss scaling and overflow checks from the section and the
  ds_config (`ds_config.plan`), resolve the op lists (with Apex registrations), check the device
  runs the dtype, then edit DeepSpeed's copy (`ds_config.edit_ds_config`): ``on_demand`` takes
  its ``bf16``/``fp16`` sections out (DeepSpeed trains in fp32 and every optimizer sees ordinary
  fp32 parameters and gradients); ``persistent`` enables DeepSpeed's 16-bit mode for the dtype.
* ``prepare_model``: the model's parameters must be fp32; ``fp32_modules`` globs are resolved (a
  glob matching nothing is an error before DeepSpeed runs); Megatron-core layers are found.
* ``attach``: `runtime.PrecisionRuntime` installs the kernels (`kernels.install`), wraps the root
  module's ``forward`` in ``torch.autocast`` (inside DeepSpeed's forward, which would otherwise
  switch an outer autocast off) and the ruled modules (`modules.ModuleCast`); then loss scaling
  (`grad_scaling.GradScaling`), on DeepSpeed's path (`deepspeed.DeepSpeedPrecision`). Weight copies
  are counted as ``parameters`` by the tracker.
* ``remove``: everything above is undone; PyTorch's own autocast kernels come back.

Under Megatron-core (docs/megatron.md; `megatron.MegatronPrecision`) there is no ds_config to edit:
``prepare_model`` decides the plan (bf16, on-demand copies; fp16 and ``persistent`` are refused by
`check_framework`), and ``attach`` puts the same runtime on the model chunk inside Megatron's DDP, with
Megatron's tensor-parallel linears run whole in bf16 (`modules`) and the vocab-parallel cross entropy in fp32.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Optional

import torch

from xirang_ds.config.validate import XirangConfigError
from xirang_ds.memory.categories import PARAMETERS
from xirang_ds.plugins.precision.apex_lists import apex_registrations
from xirang_ds.plugins.precision.config import PrecisionConfig
from xirang_ds.plugins.precision.ds_config import PrecisionPlan, check_device_dtype, edit_ds_config, plan
from xirang_ds.plugins.precision.grad_scaling import GradScaling
from xirang_ds.plugins.precision.kernels import CastPolicy, autocast_key
from xirang_ds.plugins.precision.op_lists import OpLists, build_op_lists
from xirang_ds.plugins.precision.recast import fake_parameters
from xirang_ds.plugins.precision.runtime import PATH, ModelRules, PrecisionRuntime, model_rules
from xirang_ds.registry import Plugin, register_plugin

logger = logging.getLogger("xirang_ds")


def deepspeed_runs(accelerator: Any, dtype: torch.dtype) -> bool:
    """Whether DeepSpeed's own bf16/fp16 mode starts on this accelerator (``weight_copies: "persistent"``)."""
    probe = "is_fp16_supported" if dtype == torch.float16 else "is_bf16_supported"
    return bool(getattr(accelerator, probe)())


def loss_scale_conflicts(decided: Optional[PrecisionPlan], stepper: Any) -> list[tuple[str, str]]:
    """fp16 with a plugin that applies gradients inside backward (``grad_release``) is refused
    unless that plugin says it unscales them (``applies_loss_scale = True``, see the plugin API)."""
    if decided is None or decided.loss_scale is None or stepper is None or getattr(stepper, "applies_loss_scale", False):
        return []
    return [(f"{PATH}.dtype", f"fp16 with weight_copies \"on_demand\" scales the loss in the precision plugin, "
                              f"and xirang.{stepper.section} applies the gradients inside backward without "
                              "unscaling them; set xirang.precision.weight_copies to \"persistent\" (DeepSpeed's "
                              f"fp16 section is then {stepper.section}'s, which scales itself), use bf16, or disable "
                              f"xirang.{stepper.section}")]


@register_plugin(PrecisionConfig, section="precision", order=20,
                 summary="Mixed precision with editable op lists; fp32 masters with per-op 16-bit copies or "
                         "DeepSpeed's layout.")
class PrecisionPlugin(Plugin):
    """Mixed precision with editable op lists, and on-demand 16-bit weight copies or DeepSpeed's own layout.

    Attributes:
        plan: dtype, loss scaling and overflow checks (after ``prepare_ds_config``).
        lists: the resolved op lists.
        device_type: the autocast device (DeepSpeed's accelerator).
        rules: modules run as a whole in one dtype (fp32 modules, Megatron layers).
        scaling: loss scale and gradient checks (after ``attach``).
        masters_shared: ZeRO 1/2 fp32 master partitions are views of the model's weights
            (`zero_masters.share_fp32_masters`).
    """

    frameworks = ("deepspeed", "megatron")
    paths = {"deepspeed": "xirang_ds.plugins.precision.deepspeed:DeepSpeedPrecision",
             "megatron": "xirang_ds.plugins.precision.megatron:MegatronPrecision"}

    def __init__(self, config: PrecisionConfig, session: Any) -> None:
        super().__init__(config, session)
        self.plan: Optional[PrecisionPlan] = None
        self.lists: Optional[OpLists] = None
        self.device_type = ""
        self.rules = ModelRules()
        self.scaling: Optional[GradScaling] = None
        self.runtime: Optional[PrecisionRuntime] = None
        self.masters_shared = False
        self._tracker: Any = None
        self.pending_state: Optional[dict] = None
        self._traced = False  # the estimator's trace ran under this policy (`trace_context`)

    # seams ----------------------------------------------------------------------------------
    def prepare_ds_config(self, ds_config: dict) -> None:
        """Decide the plan and lists, check the device, edit the config DeepSpeed gets.

        Raises:
            XirangConfigError: conflicting ds_config sections, bad op names or lists, an Apex
                registration that is not an operator, or a dtype the device cannot run.
        """
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        world_size = self.session.world_size  # the launcher's at initialize, the estimate's in the estimator
        stepper = self.session.stepper
        decided, problems = plan(self.config, ds_config, world_size=world_size)
        if (decided is not None and not decided.on_demand and stepper is None
                and not deepspeed_runs(accelerator, decided.dtype)):
            # DeepSpeed's engine refuses its 16-bit mode where the accelerator says the dtype is not
            # native (engine.py ``_do_sanity_check``); on_demand runs any dtype torch can run.
            # grad_release takes the 16-bit mode over and hands DeepSpeed an fp32 config.
            if self.config.weight_copies == "auto":
                on_demand = dataclasses.replace(self.config, weight_copies="on_demand")
                decided, problems = plan(on_demand, ds_config, world_size=world_size)
            else:
                problems.append((f"{PATH}.weight_copies",
                                 f"is \"persistent\" (DeepSpeed's {decided.dtype_name} mode), which DeepSpeed "
                                 f"refuses on this {accelerator.device_name()} device; set it to \"on_demand\" "
                                 "or \"auto\""))
        problems = [(p if p.startswith("xirang.") else f"ds_config.{p}", m) for p, m in problems]
        lists, device_type = self.lists_and_device(accelerator, problems)
        problems += loss_scale_conflicts(decided, stepper)
        if decided is not None and stepper is not None and decided.check_overflow:
            # The step runs inside backward, bucket by bucket: gradients are gone by the boundary where
            # the check would run. grad_release's own ``nonfinite`` setting decides instead.
            decided = dataclasses.replace(decided, check_overflow=False)
        self.decide(decided, lists, device_type, accelerator, problems)
        edit_ds_config(ds_config, decided)

    def lists_and_device(self, accelerator: Any, problems: list) -> tuple[OpLists, str]:
        """The op lists (with Apex registrations) and the autocast device; problems are appended."""
        registered = apex_registrations(PATH, problems)
        lists = build_op_lists(self.config.low_precision_ops, self.config.fp32_ops, PATH, problems, registered)
        device_type = accelerator.device_name()
        try:
            autocast_key(device_type)
        except ValueError as e:
            problems.append((PATH, str(e)))
        return lists, device_type

    def decide(self, decided: Optional[PrecisionPlan], lists: OpLists, device_type: str, accelerator: Any,
                problems: list) -> None:
        """Check the device runs the dtype, raise every problem, else keep plan, lists and device."""
        if decided is not None and not problems:
            reason = check_device_dtype(device_type, decided.dtype, accelerator)
            if reason:
                problems.append((f"{PATH}.dtype", f"{reason}; use the other 16-bit dtype or disable xirang.precision"))
        if problems:
            raise XirangConfigError(problems)
        self.plan, self.lists, self.device_type = decided, lists, device_type

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Check the parameters are fp32 masters and resolve the module rules (`runtime.model_rules`).

        Raises:
            XirangConfigError: 16-bit parameters, a glob matching no module, or a Megatron layer
                with ``gradient_accumulation_fusion``.
        """
        self.path.prepare_model(model)
        rules, problems = model_rules(model, self.config.fp32_modules, require_fp32=self.plan.on_demand)
        if problems:
            raise XirangConfigError(problems)
        self.rules = rules

    def estimate_shape(self, shape: Any) -> Any:
        """On-demand copies: DeepSpeed runs the fp32 model (its ds_config copy has no 16-bit section):
        parameters, gradients and buckets are fp32, and at ZeRO 1/2 the fp32 masters are views of the
        weights (`share_fp32_masters`)."""
        if self.plan is None or not self.plan.on_demand:
            return shape
        return dataclasses.replace(shape, dtype=torch.float32,
                                   shared_masters=shape.stage in (1, 2) and not shape.offloaded)

    def trace_key(self) -> Any:
        """`xirang_ds.roles.ChangesTrace`: the section, the plan and the op lists the trace's policy installs."""
        return repr(self.config), repr(self.plan), repr(self.lists)

    def trace_context(self, model: torch.nn.Module, tracker: Any) -> Optional[Any]:
        """The policy's kernels, autocast and module rules on the estimator's fake model (CPU autocast:
        the trace's tensors are CPU fakes), so the trace measures what they save and copy: 16-bit weight
        copies per op (on demand), fp32 upcasts of the listed ops. ``None`` when the policy cannot be
        installed here (a different one is active in this process)."""
        self._traced = False
        if self.plan is None:
            return None
        rules, problems = model_rules(model, self.config.fp32_modules, require_fp32=False)
        if problems:
            return None
        policy = CastPolicy(self.lists, "cpu", self.plan.dtype, self.config.narrow_saved_upcasts)
        runtime = PrecisionRuntime(policy, rules, lambda: tracker.scope(PARAMETERS),
                                   widen_fp32_module_weights=not self.plan.on_demand)
        try:
            handles = runtime.attach(model)
        except RuntimeError:  # another policy holds the process-wide kernels (a live run's)
            return None
        self._traced = True
        undo = contextlib.ExitStack()  # removes the handles (last first) when the trace ends
        for handle in handles:
            undo.callback(handle.remove)
        undo.enter_context(fake_parameters(model.parameters()))
        return undo

    def adjust_estimate(self, phases: dict, shape: Any, numels: list) -> Optional[dict]:
        """Modelled by the trace itself (`trace_context`) and the shape (`estimate_shape`); not
        modelled where the trace could not install the policy."""
        return phases if self._traced else None

    def attach(self, engine: Any) -> None:
        """Install kernels, autocast and module rules on the framework's model (`deepspeed.DeepSpeedPrecision`,
        `megatron.MegatronPrecision`), and under DeepSpeed loss scaling."""
        self.engine = engine
        self._tracker = self.session.tracker
        policy = CastPolicy(self.lists, self.device_type, self.plan.dtype, self.config.narrow_saved_upcasts)
        self.runtime = PrecisionRuntime(policy, self.rules, self._weight_scope,
                                        widen_fp32_module_weights=not self.plan.on_demand)
        self.path.attach(engine)

    def _weight_scope(self) -> Any:
        tracker = self._tracker
        return tracker.scope(PARAMETERS) if tracker is not None and tracker.active else contextlib.nullcontext()

    # for other plugins -----------------------------------------------------------------------
    # A plugin that applies gradients itself (grad_release) under fp16 unscales them with
    # `unscale_and_check`, skips the update when it returns True, calls `update_scale` once per
    # optimizer step, and sets ``applies_loss_scale = True`` on itself; otherwise fp16 with it is
    # refused at initialize.
    @property
    def loss_scale(self) -> float:
        """The factor gradients carry during backward (1 under bf16); see `GradScaling`."""
        return self.scaling.loss_scale if self.scaling is not None else 1.0

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Unscale gradients a plugin applies itself; True when any rank saw a non-finite value."""
        return self.scaling.unscale_and_check(grads)

    def update_scale(self, overflow: bool) -> None:
        """Advance the loss scaler once per optimizer step (for plugins that step themselves)."""
        self.scaling.update_scale(overflow)

    def describe(self) -> str:
        """One line for the session summary (after ``attach``)."""
        p, stepper = self.plan, self.session.stepper
        if p.on_demand:
            layout = "fp32 masters kept once, 16-bit weight copies made per op and again in backward"
            scale = ("dynamic loss scale" if p.loss_scale and p.loss_scale.static_scale is None else
                     "static loss scale" if p.loss_scale else
                     "steps with non-finite gradients skipped" if p.check_overflow else
                     "non-finite gradients: grad_release's nonfinite setting" if stepper else "no overflow check")
        else:
            layout = "DeepSpeed's persistent 16-bit weights"
            scale = (f"grad_release scales and checks (it takes the {p.dtype_name} section over)" if stepper else
                     f"DeepSpeed's {p.dtype_name} mode scales and checks")
        modules = f"; fp32 modules: {', '.join(self.rules.fp32_modules)}" if self.rules.fp32_modules else ""
        return (f"{p.dtype_name}, {layout}; {len(self.lists.low)} low-precision and {len(self.lists.fp32)} fp32 "
                f"op overloads; {scale}{modules}")

    # checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = self.scaling.state_dict() if self.scaling is not None else {}
        return {"loss_scaler": state, "skipped_steps": self.scaling.skipped_steps if self.scaling else 0}

    def load_state_dict(self, state: dict) -> None:
        if self.scaling is None:
            self.pending_state = state.get("loss_scaler")
            return
        self.scaling.load_state_dict(state.get("loss_scaler"))
        self.scaling.skipped_steps = int(state.get("skipped_steps", 0))


__all__ = ["PrecisionPlugin", "deepspeed_runs", "loss_scale_conflicts"]
