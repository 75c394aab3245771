"""What the precision section does to the ds_config DeepSpeed gets, decided before DeepSpeed runs.

``weight_copies: "on_demand"``: the plugin owns mixed precision. DeepSpeed trains in fp32 (its
``bf16``/``fp16`` sections are taken out of the copy it receives, so it keeps one fp32 copy of the
weights and the optimizer sees ordinary fp32 parameters and gradients), and the plugin runs the
forward under its op lists. The user's sections still say what they said:

* which 16-bit dtype (``dtype: "auto"`` follows them, bf16 when neither is enabled);
* ``fp16``'s loss-scale keys (``loss_scale``, ``initial_scale_power``, ``loss_scale_window``,
  ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``), read by DeepSpeed's own parser;
* ``bf16.check_grad_overflow`` (skip steps whose gradients are not finite; DeepSpeed's default on).

Keys that ask for 16-bit master weights or DeepSpeed's input casting contradict that and are errors.

``weight_copies: "persistent"``: DeepSpeed's own bf16/fp16 mode (the section for the dtype is
enabled in its copy if the user's ds_config lacks it), loss scaling included; the lists apply on top.

Both: DeepSpeed's ``torch_autocast``, ZeRO stage 3 and a dtype the device cannot run are errors.
``"auto"`` picks the layout with fewer weight bytes per parameter (`choose_weight_copies`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from xirang_ds.compat.torch import disable_current_modes
from xirang_ds.plugins.precision.config import PrecisionConfig

logger = logging.getLogger("xirang_ds")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_SECTIONS = ("bf16", "bfloat16", "fp16")


@dataclass(frozen=True)
class LossScaleSettings:
    """fp16 loss scaling as DeepSpeed reads it from the ``fp16`` section.

    Attributes:
        static_scale: the fixed scale, or ``None`` for dynamic scaling.
        dynamic_args: DeepSpeed's ``DynamicLossScaler`` keyword arguments (dynamic scaling only).
    """

    static_scale: Optional[float]
    dynamic_args: Optional[dict]


@dataclass(frozen=True)
class PrecisionPlan:
    """The decisions `plan` takes from the section and the ds_config.

    Attributes:
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        zero_stage: the ds_config's ZeRO stage.
        weight_copies: ``"on_demand"`` or ``"persistent"`` (``"auto"`` resolved).
        loss_scale: the plugin's fp16 loss scaling (on_demand); ``None`` under bf16 or when
            DeepSpeed's fp16 mode scales (persistent).
        check_overflow: the plugin skips optimizer steps whose gradients are not finite (on_demand).
    """

    dtype: torch.dtype
    zero_stage: int
    weight_copies: str
    loss_scale: Optional[LossScaleSettings]
    check_overflow: bool

    @property
    def dtype_name(self) -> str:
        return "fp16" if self.dtype == torch.float16 else "bf16"

    @property
    def on_demand(self) -> bool:
        return self.weight_copies == "on_demand"


def choose_weight_copies(setting: str, stage: int, world_size: int) -> str:
    """``auto``: fp32 masters alone keep 4 bytes per parameter; DeepSpeed's layout keeps 6 at
    ZeRO 0 and 2 + 4/N at ZeRO 1/2 over N data-parallel ranks (not more than 4 from N = 2 on, and
    its gradient buckets hold 16-bit elements), so ``persistent`` at ZeRO 1/2 with N > 1."""
    if setting != "auto":
        return setting
    return "persistent" if stage in (1, 2) and world_size > 1 else "on_demand"


def _enabled(ds_config: dict, key: str) -> bool:
    section = ds_config.get(key)
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _deepspeed_section(parser: Any, ds_config: dict, key: str, problems: list) -> Any:
    """DeepSpeed's own parse of a section; its validation errors become problems."""
    try:
        return parser(ds_config)
    except Exception as e:  # pydantic ValidationError or ValueError from DeepSpeed's validators
        text = " ".join(str(e).split())
        problems.append((key, f"DeepSpeed rejects this section: {text}"))
        return None


def _dtype_name(config: PrecisionConfig, ds_config: dict, bf16_key: str, problems: list) -> str:
    bf16_on, fp16_on = _enabled(ds_config, bf16_key), _enabled(ds_config, "fp16")
    if bf16_on and fp16_on:
        problems.append(("fp16.enabled", f"both {bf16_key} and fp16 are enabled; enable one of them"))
    if config.dtype == "auto":
        return "fp16" if fp16_on else "bf16"
    other = bf16_key if config.dtype == "fp16" else "fp16"
    if _enabled(ds_config, other):
        problems.append(("xirang.precision.dtype",
                         f"is {config.dtype!r} but ds_config enables {other}; write dtype \"auto\" (it then "
                         f"follows ds_config) or disable ds_config's {other} section"))
    return config.dtype


def plan(config: PrecisionConfig, ds_config: dict,
         world_size: int = 1) -> tuple[Optional[PrecisionPlan], list[tuple[str, str]]]:
    """Decide dtype, layout, loss scaling and overflow checks; every conflict is a ``(path, message)``.

    Args:
        config: the section.
        ds_config: the user's ds_config (not modified).
        world_size: data-parallel ranks (for ``weight_copies: "auto"``).

    Returns:
        The plan, or ``None`` and the problems. Paths starting with ``xirang.`` point into the
        block; others are ds_config keys.
    """
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    problems: list[tuple[str, str]] = []
    bf16_key = "bf16" if "bf16" in ds_config else "bfloat16"
    name = _dtype_name(config, ds_config, bf16_key, problems)
    if _enabled(ds_config, "torch_autocast"):
        problems.append(("torch_autocast.enabled", "DeepSpeed's torch_autocast and xirang.precision both cast "
                                                   "per op; remove the torch_autocast section (the precision "
                                                   "section replaces it) or disable xirang.precision"))
    zero = ds_config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    if stage == 3:
        problems.append(("zero_optimization.stage", "xirang.precision supports ZeRO stages 0, 1 and 2; stage 3 "
                                                    "gathers and frees the weights itself, which the weight "
                                                    "copies and their remaking in backward are not built for "
                                                    "yet; use stage 2 or disable xirang.precision"))
    bf16 = _deepspeed_section(get_bfloat16_config, ds_config, bf16_key, problems)
    fp16 = _deepspeed_section(get_float16_config, ds_config, "fp16", problems)
    copies = choose_weight_copies(config.weight_copies, stage, world_size)
    if copies == "on_demand":
        problems += _on_demand_conflicts(bf16, fp16, bf16_key)
    if problems:
        return None, problems
    loss_scale, check = None, False
    if copies == "on_demand":
        if name == "fp16":
            static = float(fp16.loss_scale) if fp16.loss_scale else None
            loss_scale = LossScaleSettings(static_scale=static,
                                           dynamic_args=None if static else fp16.dynamic_loss_scale_args())
        check = True if name == "fp16" else bool(bf16.check_grad_overflow)
    return PrecisionPlan(dtype=DTYPES[name], zero_stage=stage, weight_copies=copies, loss_scale=loss_scale,
                         check_overflow=check), []


def _on_demand_conflicts(bf16: Any, fp16: Any, bf16_key: str) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    if bf16 is not None:
        for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if getattr(bf16, key, False):
                problems.append((f"{bf16_key}.{key}", "asks for 16-bit master weights or states, but on_demand "
                                                      "weight copies keep fp32 masters; remove the key or set "
                                                      "xirang.precision.weight_copies to \"persistent\""))
    if fp16 is not None:
        if fp16.auto_cast:
            problems.append(("fp16.auto_cast", "DeepSpeed would cast the forward's inputs to fp16; "
                                               "xirang.precision casts per op instead: remove the key"))
        if fp16.fp16_master_weights_and_grads:
            problems.append(("fp16.fp16_master_weights_and_grads", "asks for fp16 master weights, but on_demand "
                                                                   "weight copies keep fp32 masters; remove it"))
    return problems


def edit_ds_config(ds_config: dict, decided: PrecisionPlan) -> None:
    """The copy DeepSpeed gets: fp32 (on_demand), or its 16-bit mode for the dtype on (persistent)."""
    if decided.on_demand:
        strip_mixed_precision(ds_config)
        return
    key = "fp16" if decided.dtype == torch.float16 else ("bfloat16" if "bfloat16" in ds_config and "bf16" not in ds_config
                                                          else "bf16")
    section = ds_config.get(key)
    ds_config[key] = {**(section if isinstance(section, dict) else {}), "enabled": True}


def strip_mixed_precision(ds_config: dict) -> None:
    """Take DeepSpeed's 16-bit modes out of the ds_config copy: DeepSpeed then trains in fp32."""
    for key in _SECTIONS:
        ds_config.pop(key, None)


def check_device_dtype(device_type: str, dtype: torch.dtype, accelerator: Any) -> Optional[str]:
    """Why ``dtype`` cannot run on ``device_type``, or ``None`` when it can.

    On CPU, torch runs bf16 and fp16 with reference kernels where the CPU has no native support,
    so a small matmul and softmax are run to decide, and a warning is logged when DeepSpeed's
    accelerator reports no native support (slow kernels). Other devices are not touched before
    DeepSpeed picks the rank's device: their accelerator's ``is_bf16_supported`` /
    ``is_fp16_supported`` decides.
    """
    name = str(dtype).replace("torch.", "")
    probe = {torch.bfloat16: "is_bf16_supported", torch.float16: "is_fp16_supported"}.get(dtype)
    native = bool(getattr(accelerator, probe)()) if probe and accelerator is not None else False
    if device_type != "cpu":
        return None if native else f"DeepSpeed's {device_type} accelerator reports that this device cannot run {name}"

    try:
        with disable_current_modes():  # a real probe, also under the estimator's FakeTensorMode
            a = torch.ones(4, 4, dtype=dtype)
            (a @ a).softmax(-1).sum().item()
    except (RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{name} cannot run on cpu ({first})"
    if not native:
        logger.warning("xirang precision: %s runs on this CPU with torch's reference kernels (DeepSpeed's accelerator "
                       "reports no native support); expect slow steps", name)
    return None


__all__ = ["DTYPES", "LossScaleSettings", "PrecisionPlan", "check_device_dtype", "choose_weight_copies",
           "edit_ds_config", "plan", "strip_mixed_precision"]
