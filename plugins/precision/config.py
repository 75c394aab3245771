"""The ``precision`` section of the ``"xirang"`` block, kept beside its plugin.

One frozen dataclass with a docstring under every field (docs/config.md's reference is generated from
them: ``make reference``) and its cross-field rules in ``check()``; the plugin registers it as the key
``precision`` of the block (`xirang_ds.registry.register_plugin`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xirang_ds.config.section import Issues, Section
from xirang_ds.config.types import Glob

@dataclass(frozen=True)
class PrecisionConfig(Section):
    """Mixed precision with editable op lists, and weights kept once as fp32 masters with 16-bit
    copies made per op (or DeepSpeed's persistent 16-bit layout where that is not larger)."""

    dtype: Literal["auto", "bf16", "fp16"] = "auto"
    """Low-precision dtype; ``auto`` follows ds_config's ``bf16``/``fp16`` section, else bf16. fp16
    uses DeepSpeed's dynamic loss scaler with the ``fp16`` section's settings."""
    low_precision_ops: tuple[str, ...] = ("default",)
    """White list: ATen ops that run in the low-precision dtype, applied in order. ``"default"`` is
    the built-in list (PyTorch autocast's CUDA and CPU lists and Apex O1's: matmuls, linear,
    convolutions, attention); ``"name"`` adds an op (``"gelu"``, ``"aten::bmm"``, one overload as
    ``"pow.Scalar"``); ``"-name"`` removes one from the list built so far."""
    fp32_ops: tuple[str, ...] = ("default",)
    """Black list: ops that always run in fp32, same syntax (the default has softmax, log_softmax,
    layer_norm, cross_entropy, exp, log, pow, sum, norms and losses). An op may be in one list only;
    ops in neither run in the widest floating dtype of their inputs."""
    fp32_modules: tuple[Glob, ...] = ()
    """Globs of full module names that run entirely in fp32 (``"lm_head"``, ``"blocks.*.ln_*"``);
    ``"blocks.2"`` does not match ``"blocks.20"``; each glob must match a module."""
    weight_copies: Literal["auto", "on_demand", "persistent"] = "auto"
    """Where the 16-bit weights live. ``on_demand``: the weights are kept once, as fp32 masters
    (DeepSpeed trains in fp32), and each op's 16-bit copy of a weight is made just before it runs,
    freed after it, and made again in backward: 4 bytes per parameter. ``persistent``: DeepSpeed's
    bf16/fp16 mode (16-bit weights all the time plus its fp32 masters: 6 bytes per parameter at
    ZeRO 0, 2 + 4/N at ZeRO 1/2 over N ranks) with the lists applied on top. ``auto``: whichever
    keeps fewer weight bytes: ``persistent`` at ZeRO 1/2 with more than one rank (unless DeepSpeed's
    16-bit mode cannot start on the device, as fp16 on most CPUs), else ``on_demand``."""
    narrow_saved_upcasts: bool = True
    """An fp32-listed op that widens a 16-bit input saves that input for backward and widens it
    again there, instead of saving the fp32 copy (exact, half the bytes). Turn off only if the
    program modifies such inputs in place before backward (an error says so)."""

    def check(self) -> Issues:
        issues: Issues = []
        if self.low_precision_ops or self.fp32_ops:
            from xirang_ds.plugins.precision.op_lists import build_op_lists

            build_op_lists(self.low_precision_ops, self.fp32_ops, "", issues)
        seen: set[str] = set()
        for i, glob in enumerate(self.fp32_modules):
            if not glob.strip():
                issues.append((f"fp32_modules[{i}]", "is empty; write a module name or a glob like \"blocks.*.ln_1\""))
            elif glob in seen:
                issues.append((f"fp32_modules[{i}]", f"{glob!r} is listed twice; remove one"))
            seen.add(glob)
        return issues


__all__ = ["PrecisionConfig"]
