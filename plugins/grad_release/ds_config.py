"""What grad_release takes over from DeepSpeed, and the ds_config keys it cannot work with.

grad_release owns the gradient reduction, the ZeRO 1/2 sharding of master weights and optimizer
states, mixed precision (fp32 masters, fp16 loss scaling) and clipping. So the ds_config copy
DeepSpeed receives asks for none of them (`hand_over`): ZeRO stage 0, no ``bf16``/``fp16``
section, no ``gradient_clipping``. DeepSpeed then builds a plain engine whose optimizer is the
basic optimizer itself, holding no state; everything else (the module, schedulers, the step and
sample counters, checkpoints, monitors) stays DeepSpeed's. `read_setup` reads what the user asked
for before that, with DeepSpeed's own parsers, and lists every key that cannot work.

The 16-bit cast DeepSpeed would do (``engine.py`` ``_cast_module_mixed_precision``: parameters to
the fp16/bf16 dtype, buffers untouched) happens in `cast_model`, before DeepSpeed sees the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from xirang_ds.config.validate import XirangConfigError, describe_value
from xirang_ds.contributions import HandOver, TakeOver, register_fit
from xirang_ds.plugins.grad_release.config import GradReleaseConfig

CASTABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Parameter dtypes DeepSpeed casts to the 16-bit dtype (``engine.py`` ``CASTABLE_DTYPES``)."""
DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BF16_MASTERS = {"remainders": "the master's low 16 bits rebuild it only beside its bf16 rounding",
                "remainders_8bit": "the master's second byte rebuilds it only beside its bf16 rounding",
                 "none": "the stochastic rounding of an update is onto bf16 weights"}
"""``masters`` values that only bf16 parameters can take, and why."""


@dataclass(frozen=True)
class TrainingSetup:
    """What the user's ds_config asks of training, read before grad_release takes it over.

    Attributes:
        zero_stage: ``zero_optimization.stage`` (0, 1 or 2).
        param_dtype: the model's dtype: fp16/bf16 when that section is enabled, else fp32.
        gradient_clipping: the global norm limit (0: off; DeepSpeed's default is 1.0).
        comm_dtype: dtype gradients are reduced in (``communication_data_type``, else param_dtype).
        fp16: DeepSpeed's parsed ``fp16`` section when enabled, else None.
        skip_nonfinite: skip steps with non-finite gradients (else raise).
    """

    zero_stage: int
    param_dtype: torch.dtype
    gradient_clipping: float
    comm_dtype: torch.dtype
    fp16: Any
    skip_nonfinite: bool


def _problem(key: str, value: Any, allowed: str, fix: str) -> tuple[str, str]:
    return ("", f"xirang.grad_release cannot run with {key} = {describe_value(value)}; {allowed}. Fix: {fix}")


def parameter_dtype(ds_config: dict) -> torch.dtype:
    """The dtype the model trains in under this ds_config (its fp16/bf16 section, else fp32)."""
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    if get_float16_config(ds_config).enabled:
        return torch.float16
    return torch.bfloat16 if get_bfloat16_config(ds_config).enabled else torch.float32


def read_setup(ds_config: dict, config: GradReleaseConfig) -> TrainingSetup:
    """Read precision, ZeRO stage and clipping from the user's ds_config; check what cannot work.

    Raises:
        XirangConfigError: every key that cannot work with grad_release, each naming the key, its
            value, what is allowed and the fix.
    """
    from deepspeed.runtime.config import (
        get_communication_data_type,
        get_gradient_clipping,
        get_gradient_predivide_factor,
        get_managed_gradient_accumulation,
        get_prescale_gradients,
    )
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
    from deepspeed.runtime.zero.config import get_zero_config

    problems: list[tuple[str, str]] = []
    zero = get_zero_config(ds_config)
    fp16, bf16 = get_float16_config(ds_config), get_bfloat16_config(ds_config)
    stage = int(zero.stage)
    if stage == 3:
        problems.append(_problem(
            "zero_optimization.stage", 3, "ZeRO-3 partitions the parameters themselves, while grad_release updates "
            "whole parameters during backward; allowed: stage 0, 1 or 2 (grad_release shards master weights, "
            "optimizer states and gradient accumulators itself at 1 and 2)",
            "set zero_optimization.stage to 2, or disable xirang.grad_release"))
    for key, section in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        device = getattr(section, "device", "none") if section is not None else "none"
        if str(getattr(device, "value", device)) != "none":
            instead = (" (xirang.grad_release.states \"host\" keeps the optimizer states in host memory and steps "
                       "them on the device)" if key == "offload_optimizer" else "")
            problems.append(_problem(f"zero_optimization.{key}.device", str(getattr(device, "value", device)),
                                     "grad_release steps the optimizer on the device during backward; allowed: "
                                     "\"none\"", f"remove zero_optimization.{key}{instead}, or disable "
                                     "xirang.grad_release"))
    if zero.zenflow is not None:
        problems.append(_problem("zero_optimization.zenflow", "set", "ZenFlow schedules its own optimizer updates",
                                 "remove zero_optimization.zenflow, or disable xirang.grad_release"))
    if fp16.enabled and fp16.auto_cast:
        problems.append(_problem("fp16.auto_cast", True, "grad_release casts the model itself and DeepSpeed no "
                                 "longer sees the fp16 section; allowed: false",
                                 "cast inputs in the model or data loader and set fp16.auto_cast to false"))
    for key, flag in (("fp16.fp16_master_weights_and_grads", fp16.fp16_master_weights_and_grads),
                      ("bf16.bf16_master_weights_and_grads", bf16.bf16_master_weights_and_grads),
                      ("bf16.bf16_optimizer_states", bf16.bf16_optimizer_states)):
        if flag:
            problems.append(_problem(key, True, "grad_release keeps fp32 master slices of 16-bit parameters",
                                     f"set {key} to false, or disable xirang.grad_release"))
    if (ds_config.get("torch_autocast") or {}).get("enabled"):
        problems.append(_problem("torch_autocast.enabled", True, "grad_release owns mixed precision (fp16/bf16 "
                                 "sections); allowed: false", "use \"bf16\": {\"enabled\": true} instead"))
    if (ds_config.get("compile") or {}).get("deepcompile"):
        problems.append(_problem("compile.deepcompile", True, "DeepCompile inserts its own gradient reduction",
                                 "set compile.deepcompile to false, or disable xirang.grad_release"))
    if not get_managed_gradient_accumulation(ds_config):
        problems.append(_problem("managed_gradient_accumulation", False, "grad_release applies the update in the "
                                 "backward of the last micro-step, so it must know that micro-step in advance",
                                 "set managed_gradient_accumulation to true"))
    if ds_config.get("sparse_gradients"):
        problems.append(_problem("sparse_gradients", True, "grad_release reduces dense buckets",
                                 "set sparse_gradients to false"))
    if get_prescale_gradients(ds_config) or float(get_gradient_predivide_factor(ds_config)) != 1.0:
        problems.append(_problem("prescale_gradients / gradient_predivide_factor",
                                 [get_prescale_gradients(ds_config), get_gradient_predivide_factor(ds_config)],
                                 "grad_release averages after the reduction, as DeepSpeed does by default",
                                 "remove both keys"))
    if str(ds_config.get("gradient_allreduce_op", "mean")).lower() != "mean":
        problems.append(_problem("gradient_allreduce_op", ds_config.get("gradient_allreduce_op"),
                                 "grad_release averages gradients over data-parallel ranks; allowed: \"mean\"",
                                 "remove gradient_allreduce_op"))
    param_dtype = parameter_dtype(ds_config)
    data_types = ds_config.get("data_types") or {}
    for key in ("buffer_dtype", "keep_in_fp32_modules"):
        if data_types.get(key):
            problems.append(_problem(f"data_types.{key}", data_types[key], "grad_release casts parameters only",
                                     f"remove data_types.{key}, or disable xirang.grad_release"))
    accum = data_types.get("grad_accum_dtype")
    if accum not in (None, "fp32"):
        problems.append(_problem("data_types.grad_accum_dtype", accum, "grad_release accumulates gradients in "
                                 "fp32; allowed: \"fp32\"", "remove data_types.grad_accum_dtype"))
    declared = data_types.get("param_dtype")
    if declared is not None and DTYPE_NAMES.get(str(declared)) != param_dtype:
        problems.append(_problem("data_types.param_dtype", declared, "it must match the enabled fp16/bf16 section",
                                 "remove data_types.param_dtype"))
    if config.masters in BF16_MASTERS and param_dtype != torch.bfloat16:
        problems.append(("", f"xirang.grad_release.masters = {config.masters!r} needs bf16 parameters and this "
                             f"ds_config trains in {str(param_dtype).replace('torch.', '')}: "
                             f"{BF16_MASTERS[config.masters]}; allowed here: \"auto\" or \"fp32\". Fix: set "
                             "xirang.grad_release.masters to \"auto\", or enable the \"bf16\" section"))
    skip_nonfinite = config.nonfinite == "skip_step" or (config.nonfinite == "auto" and fp16.enabled)
    if fp16.enabled and config.nonfinite == "raise":
        problems.append(("", "xirang.grad_release.nonfinite = 'raise' cannot run with fp16.enabled = true: dynamic "
                             "loss scaling finds overflows by skipping steps; allowed: \"auto\" or \"skip_step\". "
                             "Fix: set xirang.grad_release.nonfinite to \"auto\""))
    try:
        comm_dtype = get_communication_data_type(ds_config) or param_dtype
    except ValueError as e:
        problems.append(("", f"communication_data_type: {e}"))
        comm_dtype = param_dtype
    if problems:
        raise XirangConfigError(problems)
    return TrainingSetup(zero_stage=stage, param_dtype=param_dtype,
                         gradient_clipping=float(get_gradient_clipping(ds_config) or 0.0), comm_dtype=comm_dtype,
                         fp16=fp16 if fp16.enabled else None, skip_nonfinite=skip_nonfinite)


def hand_over(ds_config: dict) -> None:
    """Edit DeepSpeed's copy of the ds_config so that it leaves the taken-over parts to grad_release."""
    zero = ds_config.get("zero_optimization")
    if isinstance(zero, dict):
        ds_config["zero_optimization"] = {**zero, "stage": 0}
    elif zero is not None:
        ds_config["zero_optimization"] = {"stage": 0}
    for key in ("fp16", "bf16", "bfloat16", "communication_data_type"):
        ds_config.pop(key, None)
    ds_config["gradient_clipping"] = 0.0  # DeepSpeed's default is 1.0: say explicitly that it must not clip
    data_types = ds_config.get("data_types")
    if isinstance(data_types, dict):
        rest = {k: v for k, v in data_types.items() if k not in ("param_dtype", "grad_accum_dtype")}
        if rest:
            ds_config["data_types"] = rest
        else:
            ds_config.pop("data_types")


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters to ``dtype`` the way DeepSpeed does for fp16/bf16 (buffers stay as they are)."""
    if dtype == torch.float32:
        return
    for param in model.parameters():
        if param.dtype in CASTABLE_DTYPES and param.dtype != dtype:
            param.data = param.data.to(dtype)


def make_loss_scaler(setup: TrainingSetup) -> Optional[Any]:
    """DeepSpeed's own loss scaler for the fp16 section (dynamic or static), else None."""
    if setup.fp16 is None:
        return None
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

    fp16 = setup.fp16
    dynamic = fp16.loss_scale == 0
    return CreateLossScaler(torch.float16, fp16.loss_scale, dynamic, fp16.dynamic_loss_scale_args() if dynamic else None)


# where a preset leaves grad_release out (ZeRO-3), optimizer_states keeps its masters (`xirang_ds.planning.fit`)
register_fit(TakeOver("grad_release", "optimizer_states", {"schedule": [{"dtype": "fp32"}]},
                      "keeps DeepSpeed's ZeRO-3 masters as remainders in its place, with fp32 states (exact)"))
register_fit(HandOver("grad_release", "masters", "optimizer_states", "masters"))


__all__ = ["BF16_MASTERS", "TrainingSetup", "cast_model", "hand_over", "make_loss_scaler", "parameter_dtype", "read_setup"]
