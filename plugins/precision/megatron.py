"""precision under Megatron-core: bf16 with on-demand copies on the GPTModel, its loss kept in fp32, and
under pipeline parallelism each stage's output sent in ``config.pipeline_dtype``.

fp16's loss scaling and the persistent 16-bit layout are DeepSpeed's engine's; Megatron's own
``--fp16``/``--bf16`` are their counterparts, so only bf16 with on-demand copies runs here. There is no
overflow check: Megatron's FP32Optimizer has none and its own bf16 mode skips no step either.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from xirang_ds.compat.megatron import unwrap
from xirang_ds.compat.torch import DisableAutocast
from xirang_ds.hooks import wrap_method
from xirang_ds.plugins.precision.config import PrecisionConfig
from xirang_ds.plugins.precision.ds_config import plan
from xirang_ds.registry import FrameworkPath


class MegatronPrecision(FrameworkPath):
    """The plan decided without a ds_config, and the kernels installed on the unwrapped GPTModel."""

    @classmethod
    def check(cls, config: PrecisionConfig) -> list[tuple[str, str]]:
        problems = []
        if not config.enabled:
            return problems
        if config.dtype == "fp16":
            problems.append(("dtype", "'fp16' is not available under Megatron-core (allowed there: 'bf16', "
                                      "'auto'): its loss scaling runs on DeepSpeed's engine; use bf16, or "
                                      "Megatron's own --fp16 with xirang.precision disabled"))
        if config.weight_copies == "persistent":
            problems.append(("weight_copies", "'persistent' is not available under Megatron-core (allowed "
                                              "there: 'on_demand', 'auto'): it is DeepSpeed's 16-bit layout; "
                                              "use 'on_demand', or Megatron's own --bf16 with "
                                              "xirang.precision disabled"))
        return problems

    def prepare_model(self, model: Any) -> None:
        """Decide the plan once (Megatron calls this per model chunk; there is no ds_config to read)."""
        from deepspeed.accelerator import get_accelerator

        p = self.plugin
        if p.plan is not None:
            return
        accelerator = get_accelerator()
        decided, problems = plan(dataclasses.replace(p.config, weight_copies="on_demand"), {})
        if decided is not None:
            decided = dataclasses.replace(decided, check_overflow=False)
        lists, device_type = p.lists_and_device(accelerator, problems)
        p.decide(decided, lists, device_type, accelerator, problems)

    def attach(self, run: Any) -> None:
        p = self.plugin
        model = unwrap(run.module)  # the names of the rules are the GPTModel's
        for handle in p.runtime.attach(model):
            p.keep(handle)
        if hasattr(model, "compute_language_model_loss"):
            p.keep(wrap_method(model, "compute_language_model_loss", fp32_cross_entropy))
        boundary = getattr(getattr(model, "config", None), "pipeline_dtype", None)
        if boundary is not None and not getattr(model, "post_process", True):
            p.keep(wrap_method(model, "forward", functools.partial(send_as, boundary)))


def send_as(dtype: torch.dtype, original: Any, *args: Any, **kwargs: Any) -> Any:
    """A pipeline stage's output in ``config.pipeline_dtype``, the dtype of the buffers Megatron's
    point-to-point receives fill: under bf16 ops a stage ends in bf16, and a bf16 tensor sent into an
    fp32 buffer fills it with garbage. The cast up is exact, and its backward turns the fp32 gradient
    the next stage sends back into the dtype the stage's graph produced."""
    out = original(*args, **kwargs)
    if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != dtype:
        return out.to(dtype)
    return out


def fp32_cross_entropy(original: Any, labels: torch.Tensor, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Megatron's vocab-parallel cross entropy in fp32, autocast off: its max and sum of exponentials
    are all-reduced over the tensor-parallel group, and a bf16 sum over the vocabulary loses the loss's
    low digits (language_module.py ``compute_language_model_loss``)."""
    with DisableAutocast():
        return original(labels, logits.float(), *args, **kwargs)


__all__ = ["MegatronPrecision", "fp32_cross_entropy", "send_as"]
