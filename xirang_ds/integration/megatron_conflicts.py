"""Megatron settings that clash with a xirang section: each rule names both settings and the fix.

Two mechanisms on the same layer break each other silently: Megatron's recompute and offload wrap a
layer's forward in their own checkpoint function or ``saved_tensors_hooks`` context, and only the
innermost ``saved_tensors_hooks`` context applies, so xirang's activation plan would be ignored or
applied to recomputed tensors twice. The rules compare module names: xirang's targets (globs matched
against the model chunk's names, ``decoder.layers.3.mlp``) against the modules Megatron's
``TransformerConfig`` makes it recompute or offload; a module and its ancestor count as the same place.

Rules (each only when its xirang section is enabled):

* ``activations`` × ``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers`` /
  ``recompute_modules`` (Megatron-LM ``--recompute-*``, ``--recompute-activations``) on the same layers.
* ``activations`` × ``cpu_offloading`` / ``fine_grained_activation_offloading`` on the same layers.
* ``precision`` × ``bf16`` / ``fp16`` (Megatron-LM ``--bf16``/``--fp16``): Megatron's ``Float16Module``
  casts every weight after the model provider, so there is no fp32 weight left for xirang's
  on-demand 16-bit copies and ``fp32_modules`` would be cast anyway.
* ``optimizer_states`` × Megatron's precision-aware optimizer (``use_precision_aware_optimizer``,
  ``exp_avg_dtype``, ``exp_avg_sq_dtype``) and ``optimizer_cpu_offload``: both own the state format.
* ``comm_buffers`` × ``DistributedDataParallelConfig.bucket_size``: checked where it is applied
  (``plugins/comm_buffers.py`` ``prepare_ddp_config``).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from xirang_ds.compat.megatron import (
    OFFLOAD_MODULES,
    RECOMPUTE_MODULES,
    optimizer_configs,
    transformer_layers,
    unwrap,
)
from xirang_ds.config.schema import Section, XirangConfig, glob_matches

Issues = list[tuple[str, str]]
SHOWN = 4
"""How many module names a message lists before "and N more"."""


Setting = tuple[str, Any, str]
"""``(field, value, Megatron-LM flag)``: one Megatron setting as config field and command line."""

MEGATRON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "fp8"}


def setting(field: str, value: Any, flag: str | None = None) -> Setting:
    """A `Setting`; the flag defaults to the field's Megatron-LM spelling (``--recompute-granularity``)."""
    return field, value, flag or "--" + field.replace("_", "-")


def describe(owner: str, settings: list[Setting]) -> str:
    """``TransformerConfig recompute_granularity='full', recompute_method='block' (Megatron-LM
    --recompute-granularity full --recompute-method block)``."""
    fields = ", ".join(f"{field}={value!r}" for field, value, _ in settings)
    words = []
    for _, value, flag in settings:
        if value is True:
            words.append(flag)
        else:
            shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else MEGATRON_DTYPES.get(value, value)
            words.append(f"{flag} {shown}")
    return f"{owner} {fields} (Megatron-LM {' '.join(words)})"


def _names(names: Iterable[str]) -> str:
    names = sorted(set(names))
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _overlap(ours: Iterable[str], theirs: Iterable[str]) -> list[str]:
    """Names of ``theirs`` equal to, inside, or containing a name of ``ours``."""
    ours = list(ours)

    def related(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or b.startswith(a + ".")

    return sorted({t for t in theirs if any(related(o, t) for o in ours)})


def activation_targets(section: Section, model: torch.nn.Module) -> list[str]:
    """Module names the activations section acts on: the planner's candidates (``auto``: every
    ``TransformerLayer``) and the modules fixed to recompute, compress or offload."""
    names = [n for n, _ in model.named_modules() if n]
    globs: list[str] = []
    targets: set[str] = set()
    if section.planner:
        if section.candidates == "auto":
            targets.update(n for n, _ in transformer_layers(model))
        else:
            globs.extend(section.candidates)
    globs.extend(section.recompute)
    globs.extend(section.compress)
    globs.extend(section.offload)
    targets.update(n for n in names if any(glob_matches(g, n) for g in globs))
    return sorted(targets)


def megatron_recomputed(tc: Any, model: torch.nn.Module) -> tuple[list[str], str]:
    """Modules Megatron recomputes under ``tc`` (a ``TransformerConfig``) and the settings that say so."""
    granularity = getattr(tc, "recompute_granularity", None)
    if granularity is None:
        return [], ""
    layers = [n for n, _ in transformer_layers(model)]
    settings = [setting("recompute_granularity", granularity)]
    if granularity == "full":
        method, count = getattr(tc, "recompute_method", None), getattr(tc, "recompute_num_layers", None)
        settings.append(setting("recompute_method", method))
        if method == "block":
            settings.append(setting("recompute_num_layers", count))
            return layers[: int(count or 0)], describe("TransformerConfig", settings)
        return layers, describe("TransformerConfig", settings)
    keys = list(getattr(tc, "recompute_modules", None) or ["core_attn"])
    settings.append(setting("recompute_modules", keys))
    subs = [sub for key in keys for sub in RECOMPUTE_MODULES.get(key, ("",))]
    return ([f"{layer}.{sub}" if sub else layer for layer in layers for sub in subs],
            describe("TransformerConfig", settings))


def megatron_offloaded(tc: Any, model: torch.nn.Module) -> tuple[list[str], str]:
    """Modules whose activations Megatron offloads to the host, and the settings that say so."""
    layers = [n for n, _ in transformer_layers(model)]
    if getattr(tc, "cpu_offloading", False) and getattr(tc, "cpu_offloading_activations", True):
        count = int(getattr(tc, "cpu_offloading_num_layers", 0) or 0)
        return layers[:count], describe("TransformerConfig", [setting("cpu_offloading_num_layers", count)])
    if getattr(tc, "fine_grained_activation_offloading", False):
        keys = list(getattr(tc, "offload_modules", None) or [])
        subs = [sub for key in keys for sub in OFFLOAD_MODULES.get(key, ("",))]
        return ([f"{layer}.{sub}" if sub else layer for layer in layers for sub in subs],
                describe("TransformerConfig", [setting("fine_grained_activation_offloading", True),
                                               setting("offload_modules", keys)]))
    return [], ""


def check_model(config: XirangConfig, model: torch.nn.Module) -> Issues:
    """Conflicts between the block and the model's ``TransformerConfig`` (``model.config``).

    Args:
        config: the validated block.
        model: the model chunk as the model provider built it (wrappers are looked through).

    Returns:
        ``[(dotted xirang path, message)]``; empty when nothing clashes.
    """
    model = unwrap(model)
    tc = getattr(model, "config", None)
    if tc is None:
        return []
    issues: Issues = []
    if config.activations.enabled:
        ours = activation_targets(config.activations, model)
        for what, (theirs, setting_text) in (("recomputes", megatron_recomputed(tc, model)),
                                        ("offloads the activations of", megatron_offloaded(tc, model))):
            clash = _overlap(ours, theirs)
            if clash:
                issues.append(("xirang.activations",
                               f"Megatron {what} {_names(clash)} ({setting_text}) and xirang.activations plans "
                               f"the same modules ({_names(_overlap(clash, ours))}); two mechanisms on one layer "
                               "override each other's saved-tensor handling. Drop the Megatron flags and let "
                               "xirang plan, or limit xirang.activations.candidates/recompute/compress/offload "
                               "to other layers"))
    if config.precision.enabled and (getattr(tc, "bf16", False) or getattr(tc, "fp16", False)):
        flag = "bf16" if getattr(tc, "bf16", False) else "fp16"
        issues.append(("xirang.precision.enabled",
                       f"Megatron casts every weight to 16 bits ({describe('TransformerConfig', [setting(flag, True)])}"
                       ": Float16Module, fp32 master weights in its optimizer), so xirang.precision has no fp32 "
                       "weight to make on-demand copies from and cannot keep fp32_modules; use one of them: "
                       f"drop --{flag} (xirang.precision then runs the op lists from fp32 weights) or set "
                       "xirang.precision.enabled to false"))
    return issues


def check_optimizer(config: XirangConfig, optimizer: Any) -> Issues:
    """Conflicts between the block and Megatron's ``OptimizerConfig`` (each ``MegatronOptimizer.config``)."""
    issues: Issues = []
    if not config.optimizer_states.enabled:
        return issues
    for oc in optimizer_configs(optimizer):
        owned = []
        if getattr(oc, "use_precision_aware_optimizer", False):
            owned.append(setting("use_precision_aware_optimizer", True))
        for field in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            dtype = getattr(oc, field, torch.float32)
            if dtype is not None and dtype != torch.float32:
                owned.append(setting(field, dtype))
        if getattr(oc, "optimizer_cpu_offload", False):
            owned.append(setting("optimizer_cpu_offload", True))
        if owned:
            issues.append(("xirang.optimizer_states.enabled",
                           f"Megatron already owns the optimizer states ({describe('OptimizerConfig', owned)}) and "
                           "xirang.optimizer_states would replace them; use one of them: drop those Megatron "
                           "flags, or set xirang.optimizer_states.enabled to false"))
            break
    return issues


SHARDED_STATE_DICT_FORMATS = ("torch_dist", "zarr")
"""Megatron-LM checkpoint formats saved through the optimizer's ``sharded_state_dict``."""


def check_args(config: XirangConfig, args: Any) -> Issues:
    """Megatron-LM arguments that clash with the block (``prepare_optimizer`` reads them): with
    ``--save``, grad_release's states are not wired into Megatron's ``sharded_state_dict`` (any format
    but ``torch``), and optimizer_states saves through it in ``torch.optim`` layout
    (``plugins/optimizer_states/megatron.py``): ``torch_dist`` and ``zarr``, not the formats that skip
    it (``torch_dcp``, ``fsdp_dtensor``)."""
    fmt = getattr(args, "ckpt_format", "torch")
    if not getattr(args, "save", None) or fmt == "torch":
        return []
    issues: Issues = []
    if config.grad_release.enabled:
        issues.append(("xirang.grad_release.enabled",
                       f"Megatron-LM would save a distributed checkpoint (--ckpt-format {fmt}), and grad_release "
                       "carries its optimizer states in Megatron's optimizer state_dict only; use --ckpt-format "
                       "torch, or set xirang.grad_release.enabled to false"))
    if config.optimizer_states.enabled and fmt not in SHARDED_STATE_DICT_FORMATS:
        issues.append(("xirang.optimizer_states.enabled",
                       f"Megatron-LM would save with --ckpt-format {fmt}, which does not build the optimizer's "
                       "sharded_state_dict where optimizer_states writes its states in torch layout; use "
                       "--ckpt-format torch_dist or torch, or set xirang.optimizer_states.enabled to false"))
    return issues



__all__ = ["activation_targets", "check_args", "check_model", "check_optimizer", "describe", "megatron_offloaded",
           "megatron_recomputed", "setting"]
