"""A ``--model`` spec planned: its ``"preset": "auto"`` decided for the model, then its peak estimated.

Above `xirang_ds.planning.auto`, which estimates each candidate preset with the estimator, so the
estimator itself never decides a preset.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from xirang_ds.config.loader import BLOCK_KEY
from xirang_ds.memory.device_profile import DeviceProfile
from xirang_ds.models import ModelSpec, build_model, parse_model_spec
from xirang_ds.planning.auto import choose_for_spec
from xirang_ds.planning.estimator import Estimate, RunShape, estimate_run, korthikanti_activations


def estimate_spec(model: Union[str, Any], ds_config: dict, world_size: int = 1, device: str = "cpu",
                  device_profile: Optional[DeviceProfile] = None, plain: bool = False, timed: bool = True) -> Estimate:
    """`estimate_run` for a ``--model`` spec (built-in name, ``gpt:...``, or a parsed spec such as a
    `xirang_ds.models.FactorySpec`: its ``seq`` and ``vocab`` shape the inputs); ``"preset": "auto"`` is
    resolved first (`xirang_ds.planning.auto`), its choice a note. With a named GPU's ``device_profile``
    (``--gpu``) the plan is priced by it and ``memory_budget: auto`` is that GPU's memory. Plain DeepSpeed's
    predicted step (the ds_config without the block, traced on its own) is set beside the block's with
    ``plain`` (``xirang-ds estimate``; a second trace). ``timed=False``: the memory only, no predicted step
    (`estimate_run`)."""
    spec = parse_model_spec(model)
    ds_config, choice = choose_for_spec(ds_config, spec, world_size, device)
    total = device_profile.memory_bytes or None if device_profile is not None else None
    est = estimate_run(lambda: build_model(spec), ds_config, spec.seq, spec.vocab, world_size, device,
                       device_profile=device_profile, device_total_bytes=total, model_key=spec, timed=timed)
    if BLOCK_KEY in ds_config and plain and timed:  # plain DeepSpeed's step on the same profile, beside the block's
        plain = {k: v for k, v in ds_config.items() if k != BLOCK_KEY}
        est.plain_step_time = estimate_run(lambda: build_model(spec), plain, spec.seq, spec.vocab, world_size, device,
                                           device_profile=device_profile, model_key=spec).step_time
    elif BLOCK_KEY not in ds_config and timed:
        est.plain_step_time = est.step_time
    if choice:
        est.notes.append(choice)
    if isinstance(spec, ModelSpec):
        shape = RunShape.from_ds_config(ds_config, world_size, device)
        est.korthikanti_activations = korthikanti_activations(spec.layers, spec.seq, shape.micro_batch,
                                                              spec.hidden, spec.heads)
    return est


__all__ = ["estimate_spec"]
