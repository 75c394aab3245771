"""``"preset": "auto"``: the mode chosen from the memory pressure and the run's precision sensitivity.

The candidates are the presets the block's ``sensitivity`` allows, least aggressive first:
``lossless`` allows conservative, ``normal`` (the default) conservative and balanced, ``tolerant``
all three. Each is estimated on the model's parameters (`xirang_ds.planning.estimator.estimate_states`: model states,
gradients, buffers and the optimizer step, as each preset lays them out at this ds_config; the
activations are the planner's to fit into what is left, and the model's inputs are not known
before training), and the first whose estimate fits ``memory_budget`` (``auto``: the device's
capacity) is taken. The choice is one line in the session summary and in ``xirang-ds validate
--model``; no fit is an error naming the shortfall in bytes.

The resolved block names the preset taken, so checkpoints, ``--show-resolved`` and every later
reader see an ordinary preset.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError, describe_value
from xirang_ds.models import build_model, parse_model_spec
from xirang_ds.planning.estimator import estimate_states
from xirang_ds.planning.fit import fit_block
from xirang_ds.registry import plugin_classes
from xirang_ds.roles import RemarksOnAuto

AUTO = "auto"
SENSITIVITY_KEY = "sensitivity"
SENSITIVITIES: dict[str, tuple[str, ...]] = {
    "lossless": ("conservative",),
    "normal": ("conservative", "balanced"),
    "tolerant": ("conservative", "balanced", "aggressive"),
}
"""Sensitivity → the presets it allows, least aggressive first."""


def is_auto(block: Any) -> bool:
    return isinstance(block, dict) and block.get("preset") == AUTO


def choose_preset(block: dict, ds_config: dict, model: Any, world_size: int = 1, device: str = "cpu",
                  total_memory: Optional[int] = None) -> tuple[dict, Optional[str]]:
    """The block with ``"auto"`` replaced by the preset taken, and the line saying which and why
    (``(block, None)`` when the preset is not auto).

    Args:
        model: the model (only its parameters' sizes are read; the meta device will do).
        total_memory: the device's capacity, for ``memory_budget: auto`` (default: the accelerator's).

    Raises:
        XirangConfigError: a bad ``sensitivity``, an invalid block, or no allowed preset fits.
    """
    if not is_auto(block):
        return block, None
    sensitivity = block.get(SENSITIVITY_KEY, "normal")
    if not isinstance(sensitivity, str) or sensitivity not in SENSITIVITIES:
        raise XirangConfigError([(f"xirang.{SENSITIVITY_KEY}", f"must be one of {', '.join(map(repr, SENSITIVITIES))}; "
                                                              f"got {describe_value(sensitivity)}")])
    rest = {k: copy.deepcopy(v) for k, v in block.items() if k not in ("preset", SENSITIVITY_KEY)}
    allowed = SENSITIVITIES[sensitivity]
    budget = fit_block({**rest, "preset": allowed[0]}, ds_config).config.memory_budget  # every problem of the rest
    if budget == "auto":
        if total_memory is None:
            from deepspeed.accelerator import get_accelerator

            total_memory = int(get_accelerator().total_memory())
        budget = total_memory
    budget = int(budget)
    needs: list[tuple[str, int]] = []
    for name in allowed:
        candidate = {**rest, "preset": name}
        # the budget in bytes, as the run compares it (grad_release's states: auto takes the host over it)
        estimate = estimate_states(model, {**ds_config, "xirang": {**candidate, "memory_budget": budget}}, world_size,
                                   device)
        need = estimate.bound_bytes  # what only the data decide at its bound (`Estimate.bound_peak_bytes`)
        needs.append((name, need))
        if need <= budget:
            tried = "".join(f"; {n} needs {format_bytes(b)}" for n, b in needs[:-1])
            host = "".join(cls.auto_remark(estimate.notes) or "" for cls in plugin_classes()
                           if issubclass(cls, RemarksOnAuto))
            return candidate, (f"preset auto took {name}: model states, gradients and the optimizer step estimated "
                               f"{format_bytes(need)} per rank{host} against memory_budget {format_bytes(budget)}"
                               f"{tried} (sensitivity {sensitivity}: {', '.join(allowed)})")
    name, need = min(needs, key=lambda item: item[1])
    listed = ", ".join(f"{n} {format_bytes(b)}" for n, b in needs)
    more = "" if sensitivity == "tolerant" else ", set sensitivity to a lossier one (\"tolerant\" allows aggressive)"
    offloaded = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    last = " or train on more ranks" if offloaded else (", train on more ranks, or offload the optimizer "
                                                         "(zero_optimization.offload_optimizer)")
    raise XirangConfigError([("xirang.preset", f"auto: no preset that sensitivity {sensitivity!r} allows fits "
                                               f"memory_budget {format_bytes(budget)} per rank: the least, {name}, needs "
                                               f"{format_bytes(need)} for model states, gradients and the optimizer "
                                               f"step, {need - budget:,} bytes more ({listed}). Fix: raise memory_budget"
                                               f"{more}{last}")])


def choose_for_spec(ds_config: dict, model: Any, world_size: int = 1, device: str = "cpu"
                    ) -> tuple[dict, Optional[str]]:
    """`choose_preset` for a ``--model`` spec (built on the meta device: no weights are made); the
    ds_config with its block resolved."""
    block = ds_config.get("xirang")
    if not is_auto(block):
        return ds_config, None
    with torch.device("meta"):
        net = build_model(parse_model_spec(model))
    block, line = choose_preset(block, ds_config, net, world_size, device)
    return {**ds_config, "xirang": block}, line


__all__ = ["AUTO", "SENSITIVITIES", "SENSITIVITY_KEY", "choose_for_spec", "choose_preset", "is_auto"]
