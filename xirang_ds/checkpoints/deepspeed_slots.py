"""The tensors DeepSpeed's optimizer steps in this run, as `Slot` s of named parameters (read in
deepspeed 0.19.8), so a checkpoint's `ParamStates` can be loaded into them.

* ZeRO 1/2: per param group the rank's flat fp32 partition (``single_partition_of_fp32_groups``);
  each 16-bit parameter's ``_hp_mapping`` says which of its elements the partition holds and where
  (``utils/tensor_fragment.py``).
* ZeRO 3: per sub-group the flat fp32 partition (``fp32_partitioned_groups_flat``), the concatenated
  ``ds_tensor`` partitions of ``fp16_groups``; rank ``r`` holds elements ``[r * n, (r + 1) * n)`` of each
  parameter, ``n = ds_tensor.ds_numel``.
* Stage 0 with fp16/bf16: the fp16 optimizer's fp32 copies (``fp32_groups_flat``, one flat per group,
  or ``fp32_groups``, one per parameter).
* Stage 0 fp32: the parameters themselves.

The DeepSpeed internals read or called, as of deepspeed 0.19.8 (the version ``constraints.txt`` pins;
``setup.py`` allows 0.16 to 0.20); `tests/checkpoints/test_deepspeed_files.py` and `tests/checkpoints/test_deepspeed_resume.py` fail
when a release moves them:

| internal | where (0.19.8) |
|---|---|
| ``single_partition_of_fp32_groups``, ``bit16_groups``, ``_link_all_hp_params()`` | ``runtime/zero/stage_1_and_2.py`` L364, L354, L824 |
| ``param._hp_mapping`` (``lp_fragment_address``, ``get_hp_fragment_address()``, ``update_lp()``) | ``utils/tensor_fragment.py`` L18-L35, L378 |
| ``fp32_partitioned_groups_flat``, ``fp16_groups``, ``fp16_partitioned_groups[_flat]``, ``unflatten`` | ``runtime/zero/stage3.py`` L416, L401, L998, L237 |
| ``_set_fp32_optimizer_param_groups()`` / ``_clear_fp32_optimizer_param_groups()`` | ``runtime/zero/stage3.py`` L3403, L3409 |
| ``fp32_groups_flat`` (fused), ``fp32_groups`` (unfused) and ``fp16_groups`` | ``runtime/fp16/fused_optimizer.py`` L82, ``runtime/fp16/unfused_optimizer.py`` L68 |
| ``engine._get_shared_params()`` (used by the session for the model-states file) | ``runtime/engine.py`` L5490 |
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from xirang_ds.checkpoints.param_states import Fragment, ParamStates, Slot, load_slots
from xirang_ds.compat.deepspeed import hp_mapping, relink_hp_params, zero3_param_groups


class UnknownOptimizerError(TypeError):
    """DeepSpeed's optimizer in this run is a wrapper whose fp32 state xirang does not know how to write
    (the message names it); a take-over into it is refused before anything is loaded."""


def engine_slots(engine: Any) -> tuple[torch.optim.Optimizer, list[Slot]]:
    """``(basic optimizer, its slots)`` of a DeepSpeed engine.

    Raises:
        UnknownOptimizerError: an optimizer wrapper other than those listed in the module docstring.
    """
    names = {p: n for n, p in engine.module.named_parameters()}
    wrapper = engine.optimizer
    if hasattr(wrapper, "single_partition_of_fp32_groups") and hasattr(wrapper, "bit16_groups"):
        return wrapper.optimizer, _zero12(wrapper, names)
    if hasattr(wrapper, "fp32_partitioned_groups_flat"):
        return wrapper.optimizer, _zero3(wrapper, names)
    if hasattr(wrapper, "fp32_groups_flat") and hasattr(wrapper, "fp16_groups"):
        return wrapper.optimizer, [_flat_slot(flat, group, names)
                                   for flat, group in zip(wrapper.fp32_groups_flat, wrapper.fp16_groups)]
    if hasattr(wrapper, "fp32_groups") and hasattr(wrapper, "fp16_groups"):
        return wrapper.optimizer, [Slot(fp32, [Fragment(names[p], 0, p.numel(), 0)])
                                   for f32s, f16s in zip(wrapper.fp32_groups, wrapper.fp16_groups)
                                   for fp32, p in zip(f32s, f16s)]
    if isinstance(wrapper, torch.optim.Optimizer) and all(p in names for g in wrapper.param_groups
                                                          for p in g["params"]):
        return wrapper, [Slot(p, [Fragment(names[p], 0, p.numel(), 0)]) for g in wrapper.param_groups
                         for p in g["params"]]
    raise UnknownOptimizerError(f"DeepSpeed's optimizer {type(wrapper).__name__} is not one whose state xirang can "
                                "write (ZeRO 1/2/3, the fp16 wrappers, or a torch optimizer over the parameters)")


def _zero12(wrapper: Any, names: dict) -> list[Slot]:
    slots = []
    for flat, group in zip(wrapper.single_partition_of_fp32_groups, wrapper.bit16_groups):
        fragments = []
        for lp in group:
            mapping = hp_mapping(lp)
            if mapping is None:
                continue
            lp_address, hp_address = mapping.lp_fragment_address, mapping.get_hp_fragment_address()
            fragments.append(Fragment(names[lp], lp_address.start, lp_address.numel, hp_address.start))
        slots.append(Slot(flat, fragments))
    return slots


def _zero3(wrapper: Any, names: dict) -> list[Slot]:
    import deepspeed.comm as dist

    rank = dist.get_rank(group=wrapper.dp_process_group)
    slots = []
    for flat, group in zip(wrapper.fp32_partitioned_groups_flat, wrapper.fp16_groups):
        fragments, offset = [], 0
        for p in group:
            part = p.ds_tensor.ds_numel
            start = min(rank * part, p.ds_numel)
            numel = min(part, p.ds_numel - start)
            if numel > 0:
                fragments.append(Fragment(names[p], start, numel, offset))
            offset += part
        slots.append(Slot(flat, fragments))
    return slots


def _flat_slot(flat: torch.Tensor, group: list, names: dict) -> Slot:
    fragments, offset = [], 0
    for p in group:
        fragments.append(Fragment(names[p], 0, p.numel(), offset))
        offset += p.numel()
    return Slot(flat, fragments)


def load_engine_states(engine: Any, states: ParamStates) -> int:
    """Give DeepSpeed's optimizer in this run the whole per-parameter ``states``: fp32 masters, moments,
    step counts, param-group hyperparameters and the fp16 loss scale; the 16-bit weights follow the
    masters. Returns the number of elements given state."""
    wrapper = engine.optimizer
    zero3 = hasattr(wrapper, "fp32_partitioned_groups_flat")
    # masters kept as remainders between steps (optimizer_states' masters) are whole while they are written
    with getattr(wrapper, "_xirang_whole_masters", contextlib.nullcontext)():
        optimizer, slots = engine_slots(engine)
        # ZeRO-3 puts its flat partitions into the param groups only around a step
        with zero3_param_groups(wrapper) if zero3 else contextlib.nullcontext():
            filled = load_slots(optimizer, slots, states)
        _lp_from_masters(wrapper)
    scaler = getattr(wrapper, "loss_scaler", None)
    for key, value in (states.loss_scale or {}).items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, value)
    return filled


def _lp_from_masters(wrapper: Any) -> None:
    """The 16-bit weights copied from the loaded fp32 masters, and ZeRO 1/2's per-parameter views of
    the states rebuilt (as DeepSpeed's own loaders end)."""
    with torch.no_grad():
        if hasattr(wrapper, "single_partition_of_fp32_groups") and hasattr(wrapper, "bit16_groups"):
            for group in wrapper.bit16_groups:
                for lp in group:
                    if hp_mapping(lp) is not None:
                        hp_mapping(lp).update_lp()
            relink_hp_params(wrapper)
        elif hasattr(wrapper, "fp32_partitioned_groups_flat"):
            for j, fp32 in enumerate(wrapper.fp32_partitioned_groups_flat):
                if fp32.numel():
                    wrapper.fp16_partitioned_groups_flat[j].copy_(fp32)
                updated = wrapper.unflatten(wrapper.fp16_partitioned_groups_flat[j], wrapper.fp16_partitioned_groups[j])
                for partitioned, q in zip(wrapper.fp16_partitioned_groups[j], updated):
                    partitioned.data = q.data
        elif hasattr(wrapper, "fp32_groups_flat") and hasattr(wrapper, "fp16_groups"):
            for flat, group in zip(wrapper.fp32_groups_flat, wrapper.fp16_groups):
                _copy_flat_into(flat, group)
        elif hasattr(wrapper, "fp32_groups") and hasattr(wrapper, "fp16_groups"):
            for f32s, f16s in zip(wrapper.fp32_groups, wrapper.fp16_groups):
                for fp32, p in zip(f32s, f16s):
                    p.copy_(fp32)


def _copy_flat_into(flat: torch.Tensor, params: list) -> None:
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


__all__ = ["UnknownOptimizerError", "engine_slots", "load_engine_states"]
