"""`ParamStates` written as plain DeepSpeed's ZeRO 1/2 files (the layout deepspeed 0.19.8's
``runtime/zero/stage_1_and_2.py`` saves), so plain DeepSpeed, ``zero_to_fp32.py`` and
``ds_to_universal`` read a checkpoint that xirang's owners wrote.

The layout, per param group: the group's parameters flattened in order, padded at the end to a
multiple of ``2 * world`` elements (``nccl_start_alignment_factor``), cut into ``world`` equal
partitions. Rank ``r``'s file holds its partition of the fp32 masters without the padding
(``single_partition_of_fp32_groups``), the basic optimizer's torch state over the padded partition
(``base_optimizer_state``), the padding it holds (``group_paddings``) and where each parameter's
fragment starts (``param_slice_mappings``). The model-states file gets the ``param_shapes``,
``frozen_param_shapes`` and ``shared_params`` that ZeRO runs record and ``zero_to_fp32.py`` reads.
"""
from __future__ import annotations

import collections
import os
import shutil
from typing import Iterable, Optional, Sequence

import torch

from xirang_ds.checkpoints import save_atomically, update_saved
from xirang_ds.checkpoints.deepspeed_files import MODEL_STATES, load_states_file
from xirang_ds.checkpoints.param_states import ParamState, ParamStates

ALIGNMENT_FACTOR = 2
"""DeepSpeed ZeRO 1/2 pads each flat group to a multiple of this times the world size."""


def optim_file_name(rank: int, dtype: str) -> str:
    """DeepSpeed's name of rank ``rank``'s ZeRO file (bf16 runs prefix ``bf16_``)."""
    return f"{'bf16_' if dtype == 'bf16' else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def write_zero_files(tag_dir: str, states: ParamStates, groups: Sequence[Sequence[str]], numels: dict[str, int],
                     torch_groups: Sequence[dict], stage: int, dtype: str, world: int,
                     ranks: Optional[Iterable[int]] = None, ds_config: Optional[dict] = None,
                     fused: bool = False) -> list[str]:
    """Write ranks' ZeRO ``stage`` (1 or 2) files of ``states`` into ``tag_dir``; returns their paths.

    Args:
        groups: the names of each param group's trainable parameters, in the order DeepSpeed flattens
            them (the order the optimizer was given them).
        numels: their element counts (a rank reads only the parameters its partition holds).
        torch_groups: each group's torch param-group dict (hyperparameters and flags; ``params`` is
            replaced), as ``torch.optim.AdamW.state_dict()`` writes it.
        ranks: which ranks' files (default: all).
        ds_config: recorded in the files, as DeepSpeed records the run's.
        fused: the basic optimizer is FusedAdam (its steps are ints).

    Raises:
        ValueError: a stage other than 1 or 2, or a parameter without state.
    """
    from deepspeed import __version__ as ds_version
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    if stage not in (1, 2):
        raise ValueError(f"ZeRO files of stage {stage}: only stages 1 and 2 are written")
    _check_present(states, groups, numels)
    written = []
    for rank in (range(world) if ranks is None else ranks):
        masters, base_state, paddings, mappings, steps = [], {}, [], [], set()
        for g, names in enumerate(groups):
            sizes = [numels[n] for n in names]
            total = sum(sizes)
            alignment = ALIGNMENT_FACTOR * world
            padded = -(-total // alignment) * alignment
            part = padded // world
            lo, hi = rank * part, (rank + 1) * part
            flats = {k: torch.zeros(part, dtype=torch.float32) for k in ("master",) + state_keys(states, names)}
            mapping: collections.OrderedDict = collections.OrderedDict()
            offset = 0
            for name, numel in zip(names, sizes):
                a, b = max(lo, offset), min(hi, offset + numel)
                if a < b:
                    saved = states.params[name]
                    for key, flat in flats.items():
                        flat[a - lo:b - lo].copy_(_fp32(saved, key, name, numel).reshape(-1)[a - offset:b - offset])
                    mapping[name] = fragment_address(numel=b - a, start=a - lo)
                    steps.add(saved.step)
                offset += numel
            padding = max(0, min(part, hi - total))
            masters.append(flats.pop("master")[:part - padding].clone())
            base_state[g] = {**_step_entry(steps, fused), **flats}
            paddings.append(padding)
            mappings.append(mapping)
        param_groups = [_param_group(tg, states, g, [g]) for g, tg in enumerate(torch_groups)]
        osd = {
            "dynamic_loss_scale": False, "overflow": False,
            "base_optimizer_state": {"state": base_state, "param_groups": param_groups},
            "single_partition_of_fp32_groups": masters,
            "zero_stage": ZeroStageEnum.gradients if stage == 2 else ZeroStageEnum.optimizer_states,
            "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(names) for names in groups],
            "partition_count": [world] * len(groups),
            "ds_version": ds_version,
            "param_slice_mappings": mappings,
        }
        osd.update(_loss_scaler(states, ds_config))
        path = os.path.join(tag_dir, optim_file_name(rank, dtype))
        save_atomically({"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": ds_version}, path)
        written.append(path)
    return written


def stage0_entry(states: ParamStates, groups: Sequence[Sequence[str]], shapes: dict[str, torch.Size],
                 torch_groups: Sequence[dict], dtype: str, fused: bool = False,
                 ds_config: Optional[dict] = None) -> dict:
    """The model-states file's ``optimizer`` entry that plain DeepSpeed loads at stage 0 (0.19.8's
    ``runtime/engine.py`` ``_load_checkpoint``, L4690): in fp32 the basic optimizer's own torch state
    dict; in bf16/fp16 the state dict of the wrapper DeepSpeed puts around it: ``FP16_UnfusedOptimizer``
    (``runtime/fp16/unfused_optimizer.py``: a torch state per parameter, the fp32 masters per
    parameter) or, when the basic optimizer is FusedAdam (``fused``), ``FP16_Optimizer``
    (``runtime/fp16/fused_optimizer.py``: one flat fp32 master and one state per param group).

    Args:
        groups: the names of each param group's trainable parameters, in the optimizer's order.
        shapes: their shapes.
        torch_groups: each group's torch param-group dict, as for `write_zero_files`.

    Raises:
        ValueError: a parameter without state, or (bf16/fp16) without an fp32 master.
    """
    _check_present(states, groups)
    wrapped = dtype in ("bf16", "fp16")
    state: dict[int, dict] = {}
    masters: list[list[torch.Tensor]] = []
    steps: list[int] = []
    position = 0
    for names in groups:
        masters.append([])
        keys = state_keys(states, names)
        for name in names:
            saved, shape = states.params[name], shapes[name]
            if saved.moments or saved.step is not None:  # a parameter never stepped has no state, as in torch
                state[position] = {**_step_entry([saved.step], fused),
                                   **{m: _fp32(saved, m, name, shape.numel()).reshape(shape) for m in keys}}
            masters[-1].append(_fp32(saved, "master", name, shape.numel()).reshape(shape) if wrapped else None)
            steps.append(saved.step)
            position += 1
    ids = iter(range(position))
    params = [[next(ids) for _ in names] for names in groups]
    if fused and wrapped:  # one flat master and one state per group
        flat = [{k: torch.cat([(state[i][k] if i in state else torch.zeros(shapes[n])).reshape(-1)
                               for i, n in zip(group, names)]) for k in state_keys(states, names)}
                for group, names in zip(params, groups)]
        state = {g: {**_step_entry(steps, fused), **f} for g, f in enumerate(flat)}
        params = [[g] for g in range(len(groups))]
    optimizer = {"state": state, "param_groups": [_param_group(tg, states, g, params[g])
                                                  for g, tg in enumerate(torch_groups)]}
    if not wrapped:
        return optimizer
    entry = _wrapper_scale(states, dtype, fused, max((s for s in steps if s is not None), default=0), ds_config)
    entry["optimizer_state_dict"] = optimizer
    if fused:
        entry["fp32_groups_flat"] = [torch.cat([m.reshape(-1) for m in group]) for group in masters]
        from deepspeed.runtime.constants import GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT

        entry["clip_grad"] = float((ds_config or {}).get(GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT))
    else:
        entry["fp32_groups"] = masters
    return entry


def _check_present(states: ParamStates, groups: Sequence[Sequence[str]], numels: Optional[dict] = None) -> None:
    absent = [n for g in groups for n in g if n not in states.params or (numels is not None and n not in numels)]
    if absent:
        raise ValueError(f"no optimizer state for {absent[:3]}")


def state_keys(states: ParamStates, names: Sequence[str]) -> tuple[str, ...]:
    """The per-element state tensors the parameters ``names`` keep, in the order they name them (a
    parameter the optimizer never stepped keeps none: it gets zeros, as a fresh state)."""
    keys: dict[str, None] = {}
    for name in names:
        keys.update(dict.fromkeys(states.params[name].moments))
    return tuple(keys)


def _fp32(saved: ParamState, key: str, name: str, numel: int) -> torch.Tensor:
    """A parameter's saved ``master`` or per-element state, zeros for a state it does not hold yet (a
    checkpoint of fp32 training has no master)."""
    if key != "master":
        value = saved.moments.get(key)
        return value if value is not None else torch.zeros(numel)
    if saved.master is None:
        raise ValueError(f"{name} has no fp32 master in this checkpoint")
    return saved.master


def _param_group(torch_group: dict, states: ParamStates, g: int, params: list) -> dict:
    """Group ``g``'s torch param-group dict over ``params``, with the saved hyperparameters."""
    return {**{k: v for k, v in torch_group.items() if k != "params"},
            **(states.groups[g] if g < len(states.groups) else {}), "params": params}


def _step(step: int, fused: bool) -> object:
    """A parameter's step as its optimizer keeps it: torch's Adam/AdamW a float tensor, FusedAdam an int
    (its kernel takes the number)."""
    return int(step) if fused else torch.tensor(float(step))


def _step_entry(steps: Iterable[Optional[int]], fused: bool) -> dict:
    """``{"step": ...}`` of a flat state from its parameters' steps (the most taken), or nothing where the
    optimizer keeps no step count (torch's SGD)."""
    known = [s for s in steps if s is not None]
    return {"step": _step(max(known), fused)} if known else {}


def _wrapper_scale(states: ParamStates, dtype: str, fused: bool, step: int, ds_config: Optional[dict]) -> dict:
    """The loss-scale entries of DeepSpeed's stage-0 fp16/bf16 wrapper: the unfused one always writes
    them (bf16: scale 1, static), the fused one only when it scales (fp16)."""
    if dtype == "bf16":
        return {} if fused else {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": step}
    fp16 = (ds_config or {}).get("fp16") or {}
    saved = states.loss_scale or {}
    dynamic = float(fp16.get("loss_scale", 0)) == 0
    entry = {"dynamic_loss_scale": dynamic,
             "cur_scale": saved.get("cur_scale", 2.0 ** fp16.get("initial_scale_power", 16) if dynamic
                                    else float(fp16.get("loss_scale"))),
             "cur_iter": saved.get("cur_iter", step)}
    if dynamic:
        entry.update(last_overflow_iter=saved.get("last_overflow_iter", -1), scale_factor=2.0,
                     scale_window=int(fp16.get("loss_scale_window", 1000)))
    return entry


def write_zero3_files(tag_dir: str, states: ParamStates, groups: Sequence[Sequence[str]], numels: dict[str, int],
                      shapes: dict[str, torch.Size], torch_groups: Sequence[dict], dtype: str, world: int,
                      sub_group_size: int = int(1e9), ds_config: Optional[dict] = None,
                      fused: bool = False, ranks: Optional[Iterable[int]] = None) -> list[list[str]]:
    """Write ranks' (default: every rank's) ZeRO-3 files of ``states`` into ``tag_dir`` (``runtime/zero/stage3.py``'s
    layout): each param group cut into sub-groups as DeepSpeed cuts them (``ceil(numel / world)``
    elements per parameter per rank, a sub-group closed once it holds ``sub_group_size``), rank ``r``'s
    optimizer file holding its slice of every parameter in each sub-group's flat, and each rank's
    model-states file its ``param_shapes`` per sub-group. Returns the sub-groups' names."""
    from deepspeed import __version__ as ds_version
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    subs: list[tuple[int, list[str]]] = []
    for g, names in enumerate(groups):
        current, held = [], 0
        for i, name in enumerate(names):
            current.append(name)
            held += -(-numels[name] // world)
            if held >= sub_group_size or i == len(names) - 1:
                subs.append((g, current))
                current, held = [], 0
    param_groups = [_param_group(tg, states, g, [j for j, (sg, _) in enumerate(subs) if sg == g])
                    for g, tg in enumerate(torch_groups)]
    for rank in (range(world) if ranks is None else ranks):
        flats, state = [], {}
        for j, (_, names) in enumerate(subs):
            parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("master",) + state_keys(states, names)}
            steps = set()
            for name in names:
                saved, numel = states.params[name], numels[name]
                part = -(-numel // world)
                lo, hi = min(rank * part, numel), min((rank + 1) * part, numel)
                for key in parts:
                    piece = torch.zeros(part, dtype=torch.float32)
                    piece[:hi - lo].copy_(_fp32(saved, key, name, numel).reshape(-1)[lo:hi])
                    parts[key].append(piece)
                steps.add(saved.step)
            flats.append(torch.cat(parts.pop("master")))
            state[j] = {**_step_entry(steps, fused), **{m: torch.cat(v) for m, v in parts.items()}}
        scaler = _loss_scaler(states, ds_config) or {"loss_scaler": LossScaler(scale=1), "dynamic_loss_scale": False}
        osd = {"zero_stage": ZeroStageEnum.weights, **scaler, "overflow": False, "partition_count": world,
               "optimizer_state_dict": {"state": state, "param_groups": param_groups}, "fp32_flat_groups": flats}
        save_atomically({"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": ds_version},
              os.path.join(tag_dir, optim_file_name(rank, dtype)))
        update_saved(os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"),
                     param_shapes=[collections.OrderedDict((n, torch.Size(shapes[n])) for n in names)
                                   for _, names in subs])
    return [names for _, names in subs]


def _loss_scaler(states: ParamStates, ds_config: Optional[dict]) -> dict:
    """DeepSpeed's dynamic loss scaler at the saved fp16 scale, with the ds_config's fp16 settings (a
    loading run takes the saved object whole); nothing without a saved scale (the loading run keeps
    its own, as ``_load_global_state`` does for a missing key)."""
    if not states.loss_scale:
        return {}
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    fp16 = (ds_config or {}).get("fp16") or {}
    scaler = DynamicLossScaler(init_scale=float(states.loss_scale.get("cur_scale", 2.0 ** 16)),
                               scale_window=int(fp16.get("loss_scale_window", 1000)),
                               min_scale=float(fp16.get("min_loss_scale", 1)),
                               delayed_shift=int(fp16.get("hysteresis", 2)),
                               consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)))
    for key, value in states.loss_scale.items():
        if hasattr(scaler, key):
            setattr(scaler, key, value)
    return {"loss_scaler": scaler, "dynamic_loss_scale": True}


def zero_model_entries(groups: Sequence[Sequence[str]], shapes: dict[str, torch.Size],
                       frozen: Sequence[tuple[str, torch.Tensor]] = (), shared: Optional[dict] = None) -> dict:
    """What a ZeRO run's model-states file records about its parameters and ``zero_to_fp32.py`` reads:
    ``param_shapes`` per group, the frozen parameters (shapes and values) and the tied ones
    (``shared_params``: name not stored → the name holding the data)."""
    return {"param_shapes": [collections.OrderedDict((n, torch.Size(shapes[n])) for n in names) for names in groups],
            "frozen_param_shapes": collections.OrderedDict((n, p.shape) for n, p in frozen),
            "frozen_param_fragments": collections.OrderedDict((n, p.detach().cpu()) for n, p in frozen),
            "shared_params": dict(shared or {})}


def add_param_shapes(tag_dir: str, groups: Sequence[Sequence[str]], shapes: dict[str, torch.Size]) -> None:
    """`zero_model_entries` into a saved model-states file, keeping its other entries and any frozen
    or shared parameters it already records; written atomically."""
    path = os.path.join(tag_dir, MODEL_STATES)
    saved = load_states_file(path)
    update_saved(path, **{key: value for key, value in zero_model_entries(groups, shapes).items()
                          if key == "param_shapes" or saved.get(key) is None})


def copy_recovery_script(save_dir: str) -> str:
    """DeepSpeed's ``zero_to_fp32.py`` into ``save_dir``, as a ZeRO run's ``save_checkpoint`` puts it."""
    import deepspeed.utils.zero_to_fp32 as script

    target = os.path.join(save_dir, "zero_to_fp32.py")
    shutil.copyfile(script.__file__, target)
    os.chmod(target, 0o755)
    return target


__all__ = ["ALIGNMENT_FACTOR", "add_param_shapes", "copy_recovery_script", "optim_file_name", "stage0_entry",
           "zero_model_entries", "write_zero3_files", "write_zero_files"]
