"""The policy on a model: kernels, ``torch.autocast`` around the forward, and the module rules.

`PrecisionRuntime` is what the plugin attaches to ``engine.module``; `apply_precision` does the same
for a model trained without DeepSpeed (a Megatron-core loop), from a `PrecisionConfig`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import wrap_method
from xirang_ds.plugins.precision.config import PrecisionConfig
from xirang_ds.plugins.precision.kernels import CastPolicy, install
from xirang_ds.plugins.precision.modules import ModuleCast, match_modules, megatron_layer_types, outermost
from xirang_ds.plugins.precision.op_lists import build_op_lists

PATH = "xirang.precision"


@dataclass(frozen=True)
class ModelRules:
    """Which modules run as a whole in one dtype.

    Attributes:
        fp32_modules: outermost modules matched by ``fp32_modules`` globs.
        megatron_layers: Megatron-core ``ColumnParallelLinear``/``RowParallelLinear`` layers.
    """

    fp32_modules: tuple[str, ...] = ()
    megatron_layers: tuple[str, ...] = ()


def model_rules(model: torch.nn.Module, fp32_globs: tuple[str, ...],
                require_fp32: bool = True) -> tuple[ModelRules, list[tuple[str, str]]]:
    """Resolve the module rules and check the model; problems are returned, not raised.

    Problems: 16-bit parameters when ``require_fp32`` (on-demand copies keep the weights once, as
    fp32 masters), a glob matching no module, a Megatron layer with ``gradient_accumulation_fusion``
    (it writes into ``weight.main_grad``, which a 16-bit weight copy lacks).
    """
    problems: list[tuple[str, str]] = []
    narrow = [(n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if narrow and require_fp32:
        name, dtype = narrow[0]
        problems.append((PATH, f"{len(narrow)} parameter(s) are not fp32 (first: {name}, {dtype}); on-demand "
                               "weight copies keep the weights once, as fp32 masters: build the model in fp32, or "
                               "set weight_copies to \"persistent\""))
    names, glob_problems = match_modules(model, fp32_globs, f"{PATH}.fp32_modules")
    problems += glob_problems
    types = megatron_layer_types()
    layers = [(n, m) for n, m in model.named_modules() if types and isinstance(m, types)]
    for name, module in layers:
        if getattr(module, "gradient_accumulation_fusion", False):
            problems.append((PATH, f"Megatron layer {name} has gradient_accumulation_fusion on; it accumulates into "
                                   "weight.main_grad, which a 16-bit weight copy lacks: turn it off in the "
                                   "TransformerConfig"))
    return ModelRules(tuple(outermost(names)), tuple(n for n, _ in layers)), problems


@dataclass
class PrecisionRuntime:
    """Attaches a `CastPolicy` and `ModelRules` to a model; every handle is returned for removal.

    Attributes:
        policy: lists, device and dtypes.
        rules: module rules.
        weight_scope: context factory entered while weight copies are made (a tracker scope).
        widen_fp32_module_weights: fp32 modules also run on fp32 copies of their weights (the
            weights are 16-bit: DeepSpeed's persistent layout).
    """

    policy: CastPolicy
    rules: ModelRules = field(default_factory=ModelRules)
    weight_scope: Callable[[], Any] = contextlib.nullcontext
    widen_fp32_module_weights: bool = False

    def attach(self, model: torch.nn.Module) -> list[Any]:
        """Install the kernels and wrap the forwards of ``model`` and of its ruled modules.

        Megatron layers are wrapped before fp32 modules, so an fp32 module that contains one is
        outermost and switches autocast off for it.
        """
        policy, narrow = self.policy, self.policy.narrow_upcasts
        handles: list[Any] = [install(policy, self.weight_scope), wrap_method(model, "forward", self._autocast)]
        for name in self.rules.megatron_layers:
            module = model.get_submodule(name)
            cast = ModuleCast(module, policy.device_type, self._matmul_dtype, self.weight_scope, narrow,
                              cast_parameters=True)
            handles.append(wrap_method(module, "forward", cast.forward))
        for name in self.rules.fp32_modules:
            module = model.get_submodule(name)
            cast = ModuleCast(module, policy.device_type, torch.float32, self.weight_scope, narrow,
                              cast_parameters=self.widen_fp32_module_weights)
            handles.append(wrap_method(module, "forward", cast.forward))
        return handles

    def _autocast(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.policy.device_type, dtype=self.policy.low_dtype, cache_enabled=False):
            return original(*args, **kwargs)

    def _matmul_dtype(self) -> torch.dtype:
        return self.policy.low_dtype if self.policy.lists.policy_of("aten::matmul") == "low" else torch.float32


class AppliedPrecision:
    """Handle of `apply_precision`; ``remove()`` restores the model and PyTorch's autocast kernels."""

    def __init__(self, handles: list[Any], runtime: PrecisionRuntime) -> None:
        self._handles = handles
        self.runtime = runtime

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()


def apply_precision(model: torch.nn.Module, config: PrecisionConfig, dtype: torch.dtype = torch.bfloat16,
                    device_type: Optional[str] = None,
                    weight_scope: Callable[[], Any] = contextlib.nullcontext) -> AppliedPrecision:
    """The section's op lists and module rules on a model trained without DeepSpeed.

    The model keeps fp32 parameters; its forward runs under the lists with 16-bit weight copies
    made per op. Loss scaling is the caller's (fp16): use ``torch.amp.GradScaler``.

    Args:
        model: an fp32 model (plain PyTorch or Megatron-core layers).
        config: the ``precision`` section (``enabled`` is not consulted).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        device_type: the autocast device; default: the device of the model's first parameter.

    Raises:
        XirangConfigError: bad op lists, globs, parameters, or Megatron settings.

    Example:
        >>> handle = apply_precision(model, PrecisionConfig(fp32_modules=("output_layer",)))
        >>> loss = model(tokens).float().mean(); loss.backward()
        >>> handle.remove()
    """
    problems: list[tuple[str, str]] = []
    lists = build_op_lists(config.low_precision_ops, config.fp32_ops, PATH, problems)
    rules, rule_problems = model_rules(model, config.fp32_modules)
    problems += rule_problems
    if problems:
        raise XirangConfigError(problems)
    if device_type is None:
        first = next(model.parameters(), None)
        device_type = first.device.type if first is not None else "cpu"
    runtime = PrecisionRuntime(CastPolicy(lists, device_type, dtype, config.narrow_saved_upcasts), rules, weight_scope)
    return AppliedPrecision(runtime.attach(model), runtime)


__all__ = ["AppliedPrecision", "ModelRules", "PrecisionRuntime", "apply_precision", "model_rules"]
