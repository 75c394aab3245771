"""A preset's plugins that cannot pay for this model: left out on the estimate, with a line saying why.

`xirang_ds.config.fit` leaves out what cannot run with the ds_config and what a plugin knows from the
ds_config alone will save nothing (`Plugin.preset_leave_out`). Whether a plugin whose saving lies in
model states, gradients or the optimizer step (`Plugin.pays_in_model_states`: grad_release,
optimizer_states) lowers anything also depends on the model's parameter sizes and the world size:
grad_release holds a few buckets of gradients in flight where plain DeepSpeed holds its reduced
partition, and on a model smaller than its buckets, in fp32, those buckets are not fewer bytes.

Once the model is known (``initialize``, ``xirang-ds validate --model``, the estimator), each such
plugin a preset turned on is estimated with and without it (`estimator.estimate_states`: parameters'
sizes only). Activations are not known before the first batch, so both ends are compared: with no
activations (the whole peak) and with activations large enough to dominate (forward and backward
besides them, where they add alike to both runs). Because each side's peak is the largest of a few
phases each growing with the activations or not at all, a plugin that lowers neither end lowers no
peak in between: it cannot pay, and is left out. An estimate equal at both ends keeps the plugin (its
effect may be one the estimate does not model), and so does a model built under
``deepspeed.zero.Init`` (its parameters' sizes there are their partitions'). A section the user wrote
runs as written.
"""
from __future__ import annotations

from typing import Any

from xirang_ds.config.fit import FittedBlock, LeftOut, fit_block
from xirang_ds.config.loader import BLOCK_KEY
from xirang_ds.config.types import format_bytes

_GROWING = ("forward", "backward")
"""The phases that hold saved activations (the optimizer step holds none)."""


def _ends(estimate: Any) -> tuple[int, int]:
    """(the whole peak without activations, the largest phase that grows with them)."""
    return estimate.predicted_peak_bytes, max(estimate.phases[p]["total"] for p in _GROWING)


def leave_out_unpaid(fitted: FittedBlock, block: Any, ds_config: dict, model: Any, world_size: int = 1,
                     device: str = "cpu") -> FittedBlock:
    """``fitted`` without the preset's model-state plugins that lower no peak for ``model`` at
    ``world_size`` ranks, each with its `LeftOut` line; ``fitted`` itself when there is none (or no
    preset, or nothing to ask).

    Args:
        fitted: `fit_block`'s result for ``block`` and ``ds_config``.
        block: the block as written (its sections other than ``preset`` are the user's).
        model: the model (only its parameters' sizes are read; the meta or fake device will do).
    """
    from xirang_ds.memory.estimator import estimate_states
    from xirang_ds.registry import plugin_for

    if fitted.config.preset is None or not isinstance(block, dict):
        return fitted
    if any(hasattr(p, "ds_numel") for p in model.parameters()):
        return fitted  # built under deepspeed.zero.Init: the sizes read here are partitions
    names = [name for name, section in fitted.config.enabled_sections().items()
             if name not in block and getattr(plugin_for(section), "pays_in_model_states", False)]
    if not names:
        return fitted

    def estimate(trial: dict) -> Any:
        return estimate_states(model, {**ds_config, BLOCK_KEY: trial}, world_size, device, pay=False)

    current, base, unpaid = block, estimate(block), []
    for name in names:
        trial = {**current, name: {"enabled": False}}
        without = estimate(trial)
        (peak, grows), (peak_without, grows_without) = _ends(base), _ends(without)
        if peak >= peak_without and grows >= grows_without and (peak, grows) != (peak_without, grows_without):
            unpaid.append(LeftOut(name, f"it lowers no peak for this model at {world_size} rank(s): estimated "
                                        f"{format_bytes(peak)} with it against {format_bytes(peak_without)} without "
                                        f"(model states, gradients and the optimizer step), and "
                                        f"{format_bytes(grows)} against {format_bytes(grows_without)} besides "
                                        f"activations in forward and backward; write a {name} section to run it "
                                        "anyway"))
            current, base = trial, without
    if not unpaid:
        return fitted
    dropped = {item.section for item in unpaid}
    kept = tuple(item for item in fitted.left_out if item.section.split(".")[0] not in dropped)
    return FittedBlock(fit_block(current, ds_config).config, kept + tuple(unpaid))


__all__ = ["leave_out_unpaid"]
