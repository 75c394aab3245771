"""Build `DynamicAdamW` in place of the optimizer DeepSpeed would wrap.

Two sources, as in ``deepspeed.initialize``:

* ds_config's ``optimizer`` block (an `OptimizerSpec`): ``type`` Adam or AdamW and ``params``
  exactly as DeepSpeed reads them (``runtime/engine.py`` ``_configure_basic_optimizer``): type
  Adam means AdamW unless ``adam_w_mode`` is false; ``weight_decay`` defaults to 0.01 for
  ``torch_adam`` AdamW (``torch.optim.AdamW``'s default) and to 0 otherwise (FusedAdam's).
* a client ``torch.optim.Adam``/``AdamW`` (or DeepSpeed's FusedAdam) object: its param groups and
  their hyperparameters are kept; states it already holds are carried over as fp32 states.

Per-parameter rules (``keep_fp32`` globs, embeddings and norms by module type, ``min_numel``)
split every param group in two, the kept half marked ``keep_fp32`` (and, with
``keep_fp32_embeddings_and_norms: "measured"``, a third part of embeddings marked ``"measured"``):
ZeRO 1/2 flatten and partition per group, so a rule on a parameter survives as a rule on its
group's partition.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from xirang_ds.compat.torch import NormBase
from xirang_ds.config.schema import glob_matches
from xirang_ds.config.validate import XirangConfigError, describe_value
from xirang_ds.plugins.optimizer_states.config import OptimizerStatesConfig
from xirang_ds.plugins.optimizer_states.optimizer import DynamicAdamW, config_to_dict

SECTION = "xirang.optimizer_states"
SUPPORTED_TYPES = ("Adam", "AdamW")
SPEC_KEYS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad",
             "maximize", "foreach", "fused", "capturable", "set_grad_none")
"""Keys of the ``optimizer.params`` block understood here; the last five only choose an
implementation (or must be false) and are otherwise ignored."""

_NORM_TYPES: tuple[type, ...] = (torch.nn.LayerNorm, torch.nn.GroupNorm, NormBase,
                                 torch.nn.LocalResponseNorm) + ((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ())
_EMBEDDING_TYPES: tuple[type, ...] = (torch.nn.Embedding, torch.nn.EmbeddingBag)
MEASURED = "measured: "
"""Prefix of a keep reason whose parameter is measured (`DynamicAdamW._measure_release`), not pinned."""


@dataclass(frozen=True)
class AdamSettings:
    """Hyperparameters read from a spec or a client optimizer (the defaults of every group)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    adam_w_mode: bool
    maximize: bool = False
    bias_correction: bool = True

    def as_kwargs(self) -> dict:
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                    adam_w_mode=self.adam_w_mode, maximize=self.maximize, bias_correction=self.bias_correction)


# ------------------------------------------------------------------------------------------------
# which parameters keep fp32 states

def is_norm_module(module: torch.nn.Module) -> bool:
    """Normalisation layers: torch's classes, and classes named ``*Norm`` (RMSNorm, FusedLayerNorm,
    Megatron's and Transformer Engine's norms)."""
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm")


def keep_reasons(model: torch.nn.Module, config: OptimizerStatesConfig) -> dict[int, str]:
    """Why each parameter (by ``id``) keeps fp32 states; parameters not listed follow the policy.

    Raises:
        XirangConfigError: a ``keep_fp32`` glob matches no parameter name.
    """
    reasons: dict[int, str] = {}
    if config.keep_fp32_embeddings_and_norms:
        measured = config.keep_fp32_embeddings_and_norms == "measured"
        for module_name, module in model.named_modules():
            kind = "embedding" if isinstance(module, _EMBEDDING_TYPES) else "norm" if is_norm_module(module) else None
            if kind:
                prefix = MEASURED if measured and kind == "embedding" else ""
                for p in module.parameters(recurse=False):
                    reasons.setdefault(id(p), f"{prefix}{kind} ({type(module).__name__} {module_name or '<root>'})")
    names = list(model.named_parameters())
    problems = []
    for i, pattern in enumerate(config.keep_fp32):
        hits = [p for name, p in names if glob_matches(pattern, name)]
        if not hits:
            examples = ", ".join(name for name, _ in names[:4])
            problems.append((f"{SECTION}.keep_fp32[{i}]",
                             f"{describe_value(pattern)} matches no parameter name (globs match whole names, "
                             f"e.g. {examples}); fix the pattern or remove it"))
        for p in hits:
            reasons.setdefault(id(p), f"keep_fp32 {pattern!r}")
    if problems:
        raise XirangConfigError(problems)
    for _, p in names:
        if p.numel() < config.min_numel:
            reasons.setdefault(id(p), f"{p.numel()} elements < min_numel {config.min_numel}")
    return reasons


def split_groups(groups: list[dict], reasons: dict[int, str]) -> list[dict]:
    """Each group as up to three groups with the same settings: policy-driven, kept fp32, then
    measured; each says which group it came from (``xirang_group``: a checkpoint read without the
    plugin rebuilds the user's groups from it, `xirang_ds.checkpoints`)."""
    out = []
    for index, group in enumerate(groups):
        params = list(group["params"])
        rest = {k: v for k, v in group.items() if k != "params"}
        rest.setdefault("xirang_group", index)
        kinds = {id(p): ("measured" if reasons[id(p)].startswith(MEASURED) else True) if id(p) in reasons else False
                 for p in params}
        for kind in (False, True, "measured"):
            part = [p for p in params if kinds[id(p)] == kind]
            if part:
                out.append({**rest, "params": part, "keep_fp32": kind})
    return out


def as_groups(model_parameters: Any) -> list[dict]:
    """``model_parameters`` as ``torch.optim`` would read them: a list of param-group dicts."""
    items = list(model_parameters)
    if not items:
        return []
    if isinstance(items[0], dict):
        return [dict(g, params=list(g["params"]) if not isinstance(g["params"], torch.Tensor) else [g["params"]])
                for g in items]
    return [{"params": items}]


# ------------------------------------------------------------------------------------------------
# hyperparameters from the two sources

def settings_from_spec(type_name: str, params: dict) -> AdamSettings:
    """Read ds_config's ``optimizer`` block the way DeepSpeed would.

    Raises:
        XirangConfigError: a type other than Adam/AdamW, an unknown or unsupported key, or a bad
            value; every problem at once.
    """
    problems: list[tuple[str, str]] = []
    if type_name.lower() not in ("adam", "adamw"):
        raise XirangConfigError([("optimizer.type", unsupported_message(f"{type_name!r} (ds_config optimizer.type)"))])
    for key in params:
        if key not in SPEC_KEYS:
            problems.append((f"optimizer.params.{key}",
                             f"is not an Adam parameter xirang's optimizer_states understands; allowed: "
                             f"{', '.join(SPEC_KEYS)}; remove it or disable xirang.optimizer_states"))
    if params.get("amsgrad"):
        problems.append(("optimizer.params.amsgrad", "true is not supported by optimizer_states (it would need a "
                                                    "third state tensor); set it to false or disable the section"))
    adam_w_mode = bool(params.get("adam_w_mode", True))
    decoupled = type_name.lower() == "adamw" or adam_w_mode
    torch_adam = bool(params.get("torch_adam", False))
    default_wd = 1e-2 if (torch_adam and decoupled) else 0.0
    settings = AdamSettings(
        lr=_number(params, "lr", 1e-3, problems), betas=_betas(params, problems),
        eps=_number(params, "eps", 1e-8, problems), weight_decay=_number(params, "weight_decay", default_wd, problems),
        adam_w_mode=decoupled, maximize=bool(params.get("maximize", False)),
        bias_correction=bool(params.get("bias_correction", True)))
    if problems:
        raise XirangConfigError(problems)
    return settings


def settings_from_client(optimizer: Any) -> AdamSettings:
    """Read a client optimizer's defaults (its groups keep their own values).

    Raises:
        XirangConfigError: not an Adam-type optimizer, or one using amsgrad.
    """
    kind = client_kind(optimizer)
    if kind is None:
        raise XirangConfigError([("optimizer", unsupported_message(f"{type(optimizer).__module__}."
                                                                  f"{type(optimizer).__name__} (client optimizer)"))])
    d = optimizer.defaults
    if d.get("amsgrad") or any(g.get("amsgrad") for g in optimizer.param_groups):
        raise XirangConfigError([("optimizer", "a client optimizer with amsgrad=True is not supported by "
                                               "optimizer_states; build it with amsgrad=False")])
    decoupled = {"AdamW": True, "Adam": bool(d.get("decoupled_weight_decay", False)),
                 "FusedAdam": bool(d.get("adam_w_mode", True))}[kind]
    return AdamSettings(lr=float(d["lr"]), betas=tuple(d["betas"]), eps=float(d["eps"]),
                        weight_decay=float(d["weight_decay"]), adam_w_mode=decoupled,
                        maximize=bool(d.get("maximize", False)), bias_correction=bool(d.get("bias_correction", True)))


def unsupported_message(what: str) -> str:
    return (f"optimizer_states replaces Adam and AdamW only; the optimizer is {what}. Fix: use ds_config "
            f"\"optimizer\": {{\"type\": \"AdamW\", ...}} or a torch.optim.AdamW/Adam, or set "
            f"xirang.optimizer_states.enabled to false")


def client_kind(optimizer: Any) -> Optional[str]:
    if type(optimizer) is torch.optim.AdamW:
        return "AdamW"
    if type(optimizer) is torch.optim.Adam:
        return "Adam"
    if type(optimizer).__name__ == "FusedAdam" and type(optimizer).__module__.startswith("deepspeed"):
        return "FusedAdam"
    return None


def group_decoupled(kind: Optional[str], group: dict, default: bool) -> bool:
    if kind == "AdamW":
        return True
    if kind == "Adam":
        return bool(group.get("decoupled_weight_decay", default))
    return bool(group.get("adam_w_mode", default))


def _number(params: dict, key: str, default: float, problems: list) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        problems.append((f"optimizer.params.{key}", f"must be a number >= 0; got {describe_value(value)}"))
        return default
    return float(value)


def _betas(params: dict, problems: list) -> tuple[float, float]:
    value = params.get("betas", (0.9, 0.999))
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)
    if not ok:
        problems.append(("optimizer.params.betas", f"must be two numbers in [0, 1); got {describe_value(value)}"))
        return (0.9, 0.999)
    return (float(value[0]), float(value[1]))


# ------------------------------------------------------------------------------------------------
# the optimizer

def build_optimizer(groups: list[dict], settings: AdamSettings, config: OptimizerStatesConfig,
                    reasons: dict[int, str]) -> DynamicAdamW:
    """`DynamicAdamW` over ``groups`` split by ``reasons``, with ``settings`` as defaults."""
    return DynamicAdamW(split_groups(groups, reasons), **settings.as_kwargs(), states=config_to_dict(config))


def from_client(optimizer: Any, config: OptimizerStatesConfig, model: torch.nn.Module) -> DynamicAdamW:
    """`DynamicAdamW` in place of a client optimizer: same groups and values, states carried over.

    Raises:
        XirangConfigError: the optimizer is not Adam-type (see `settings_from_client`), or a
            ``keep_fp32`` glob matches nothing.
    """
    settings = settings_from_client(optimizer)
    kind = client_kind(optimizer)
    groups = []
    for g in optimizer.param_groups:
        own = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "maximize", "bias_correction") if k in g}
        own["adam_w_mode"] = group_decoupled(kind, g, settings.adam_w_mode)
        groups.append({**own, "params": list(g["params"])})
    new = build_optimizer(groups, settings, config, keep_reasons(model, config))
    for p, st in optimizer.state.items():
        if st:
            new.state[p] = dict(st)  # torch.optim.Adam(W) states are this optimizer's fp32 format
    return new


def from_spec(type_name: str, params: dict, config: OptimizerStatesConfig, model: torch.nn.Module
              ) -> Callable[[Any], DynamicAdamW]:
    """A callable ``f(model_parameters)`` for ``deepspeed.initialize``: the optimizer of the block.

    The block is read at once, so bad values fail at initialize before DeepSpeed starts.
    """
    settings = settings_from_spec(type_name, params)
    reasons = keep_reasons(model, config)

    def make(model_parameters: Iterable[Any]) -> DynamicAdamW:
        return build_optimizer(as_groups(model_parameters), settings, config, reasons)

    make.__name__ = make.__qualname__ = "DynamicAdamW"
    return make
