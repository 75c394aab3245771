"""Plain DeepSpeed's checkpoint files read into `ParamStates` (read in deepspeed 0.19.8).

What each layout holds, in the tag folder:

* ZeRO 1/2 (any dtype): one ``[bf16_]zero_pp_rank_<R>_mp_rank_00_optim_states.pt`` per rank, whose
  ``optimizer_state_dict`` has per param group the rank's flat fp32 partition
  (``single_partition_of_fp32_groups``), the basic optimizer's state over it (``base_optimizer_state``)
  and where each parameter's fragment starts in it (``param_slice_mappings``, name → numel, start);
  fragments of one parameter follow each other in rank order.
* ZeRO 3: the same files with ``fp32_flat_groups`` and ``optimizer_state_dict``; each parameter is cut
  into ``ceil(numel / world)`` elements per rank, in the order of ``param_shapes`` in each rank's
  ``zero_pp_rank_<R>_mp_rank_00_model_states.pt`` (what ``zero_to_fp32.py`` reads).
* Stage 0: ``mp_rank_00_model_states.pt``'s ``optimizer``: the torch optimizer's state dict (fp32), or
  DeepSpeed's fp16/bf16 wrapper's (``optimizer_state_dict`` and the fp32 masters ``fp32_groups``),
  indexed by position in the param groups; the names come from the run's own parameter order.

Every rank reads every rank's file, as DeepSpeed's own elastic loading does; the files are
memory-mapped, so only the tensors used are read.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Any, Optional, Sequence

import torch

from xirang_ds.checkpoints.param_states import (
    LazyParams,
    ParamState,
    ParamStates,
    StateKindError,
    flat_state_keys,
    hyperparameters,
    state_step,
)
from xirang_ds.contributions import state_codes

MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def moment_range(state: dict, moment: str, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of a saved state's moment as fp32: a coded state decoded by its owner
    (`xirang_ds.contributions.StateCodes`), a ``torch.optim`` state's flat tensor sliced."""
    coded = state_codes()
    if coded is not None and coded.is_coded(state):
        return coded.moment_range(state, moment, start, end)
    return state[moment].reshape(-1)[start:end].float()


def torch_layout(state: Optional[dict], numel: int) -> dict:
    """A saved state of ``numel`` elements in ``torch.optim`` layout: a coded state decoded to fp32, flat, by
    its owner; another optimizer's as it is; ``{}`` for none."""
    if not state:
        return {}
    coded = state_codes()
    return coded.torch_layout(state, numel) if coded is not None and coded.is_coded(state) else state


class CheckpointReadError(ValueError):
    """The tag folder holds no optimizer state this reader understands; the message says what it holds."""


def load_states_file(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:  # saved in torch's legacy (non-zip) format: no memory map
        return torch.load(path, map_location="cpu", weights_only=False)


def optim_files(tag_dir: str) -> list[str]:
    """The ZeRO optimizer files of a tag folder, in rank order (empty: stage 0 or none)."""
    found = []
    for path in glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*_optim_states.pt")):
        match = _OPTIM.match(os.path.basename(path))
        if match:
            found.append((int(match.group(2)), path))
    return [p for _, p in sorted(found)]


def read_deepspeed_states(tag_dir: str, names: Sequence[str], shapes: dict[str, torch.Size]) -> ParamStates:
    """The optimizer state of a plain DeepSpeed checkpoint, per parameter.

    Args:
        tag_dir: ``<save_dir>/<tag>``.
        names: this run's trainable parameters in ``model.parameters()`` order (stage 0 indexes its
            state by position).
        shapes: their shapes.

    Raises:
        CheckpointReadError: no optimizer state, a stage-0 state whose parameters do not line up with
            this run's, or an optimizer state that cannot be split by element.
    """
    files = optim_files(tag_dir)
    if files:
        first = load_states_file(files[0])
        stage = int(first["optimizer_state_dict"]["zero_stage"])
        dtype = ds_config_dtype(first.get("ds_config"))
        if stage == 3:
            return read_zero3(tag_dir, files, dtype)
        return read_zero12(files, stage, dtype, shapes)
    path = os.path.join(tag_dir, MODEL_STATES)
    if not os.path.isfile(path):
        raise CheckpointReadError(f"{tag_dir} has neither {MODEL_STATES} nor ZeRO optimizer files")
    saved = load_states_file(path).get("optimizer")
    if saved is None:
        raise CheckpointReadError(f"{tag_dir} was saved without optimizer state ({MODEL_STATES} has none)")
    return _read_stage0(saved, names, shapes, ds_config_dtype(load_states_file(path).get("ds_config")))


def ds_config_dtype(ds_config: Optional[dict]) -> str:
    """The training dtype a ds_config names (``"?"`` when the file does not carry its ds_config)."""
    if not isinstance(ds_config, dict):
        return "?"
    for key in ("bf16", "fp16"):
        if (ds_config.get(key) or {}).get("enabled"):
            return key
    return "fp32"


def _loss_scale(osd: dict) -> Optional[dict]:
    """A ZeRO file's dynamic loss scaler, as the attributes grad_release's policy restores."""
    scaler = osd.get("loss_scaler")
    if scaler is None or not osd.get("dynamic_loss_scale"):
        return None
    return {k: getattr(scaler, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
            if hasattr(scaler, k)}


def _group_states(base: Any) -> tuple[list[dict], list[int], list[dict]]:
    """``(per-group state, the user's group each came from, the user's groups' hyperparameters)`` of a
    ZeRO file's basic-optimizer state: a torch state dict (one flat tensor per group) or DeepSpeed's
    elastic list of per-group states. optimizer_states splits the user's groups and marks each half
    with ``xirang_group``."""
    if not isinstance(base, dict):
        return list(base), list(range(len(base))), [{} for _ in base]
    groups = base["param_groups"]
    states = [base["state"].get(g["params"][0], {}) if g["params"] else {} for g in groups]
    origins = [int(g.get("xirang_group", i)) for i, g in enumerate(groups)]
    hyper: dict[int, dict] = {}
    for origin, group in zip(origins, groups):
        hyper.setdefault(origin, hyperparameters(group))
    return states, origins, [hyper.get(i, {}) for i in range(max(origins, default=-1) + 1)]


def read_zero12(files: list[str], stage: int, dtype: str, shapes: dict[str, torch.Size]) -> ParamStates:
    """Each parameter assembled, when asked for, from its fragments in rank order (`LazyParams`)."""
    index: dict[str, tuple[int, list]] = {}  # name → (group, [(file, group index, address)])
    steps: dict[int, int] = {}
    hyper: list[dict] = []
    loss_scale = None
    for path in files:
        osd = load_states_file(path)["optimizer_state_dict"]
        if "param_slice_mappings" not in osd:
            raise CheckpointReadError(f"{path} was written by DeepSpeed {osd.get('ds_version', '?')}, whose ZeRO files "
                                      "do not say where each parameter sits in them (param_slice_mappings); resume "
                                      "it once with plain DeepSpeed >= 0.10 and save, then add the block")
        states, origins, hyper = _group_states(osd["base_optimizer_state"])
        loss_scale = _loss_scale(osd)
        for g, (state, mapping) in enumerate(zip(states, osd["param_slice_mappings"])):
            if not mapping:
                continue
            keys = _keys(state, path)
            step = state.get("step", osd.get("base_optimizer_state_step"))
            steps[origins[g]] = None if step is None else int(step)
            for name, address in mapping.items():
                index.setdefault(name, (origins[g], []))[1].append((osd, g, state, keys, address))

    def build(name: str) -> ParamState:
        group, fragments = index[name]
        masters: list[torch.Tensor] = []
        parts: dict[str, list[torch.Tensor]] = {}
        for osd, g, state, keys, address in fragments:
            a, b = address.start, address.start + address.numel
            masters.append(osd["single_partition_of_fp32_groups"][g][a:b].float())
            for m in keys:
                parts.setdefault(m, []).append(moment_range(state, m, a, b))
        shape = shapes.get(name, torch.Size([sum(t.numel() for t in masters)]))
        whole = {k: (v[0] if len(v) == 1 else torch.cat(v)).view(shape) for k, v in parts.items()}
        return ParamState(master=torch.cat(masters).view(shape), moments=whole, step=steps[group], group=group)

    return ParamStates(f"DeepSpeed ZeRO-{stage} ({dtype})", LazyParams(index, build, lambda name: index[name][0]),
                       hyper, loss_scale)


def _keys(state: dict, where: str) -> tuple[str, ...]:
    """`flat_state_keys` of a group's state, refusing one that cannot be split by element."""
    try:
        return flat_state_keys(state)
    except StateKindError as e:
        raise CheckpointReadError(f"{where}: {e}") from None


def read_zero3(tag_dir: str, files: list[str], dtype: str, param_shapes: Optional[list] = None) -> ParamStates:
    """ZeRO-3 cuts each param group into sub-groups (``sub_group_size``), one flat partition each;
    ``param_shapes`` (default: rank 0's model-states file's) lists the parameters of each sub-group in
    order, each taking ``ceil(numel / world)`` elements of its sub-group's flat on every rank; the basic
    optimizer's state indexes the sub-groups in order, each param group's ``params`` naming its own."""
    world = len(files)
    if param_shapes is None:
        model_states = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")
        if not os.path.isfile(model_states):
            raise CheckpointReadError(f"{tag_dir}: ZeRO-3 optimizer files without {os.path.basename(model_states)}")
        param_shapes = load_states_file(model_states)["param_shapes"]
    osds = [load_states_file(p)["optimizer_state_dict"] for p in files]
    torch_sd = osds[0]["optimizer_state_dict"]
    origin_of_sub, hyper = {}, {}
    for g, group in enumerate(torch_sd["param_groups"]):
        origin = int(group.get("xirang_group", g))
        hyper.setdefault(origin, hyperparameters(group))
        origin_of_sub.update({j: origin for j in group["params"]})
    index: dict[str, tuple] = {}  # name → (shape, sub-group, offset in its flat, elements per rank)
    for j, sub_shapes in enumerate(param_shapes):
        offset = 0
        for name, shape in sub_shapes.items():
            part = -(-shape.numel() // world)
            index[name] = (shape, j, offset, part)
            offset += part
    states = {}  # (rank, sub-group) → (its state in torch layout over the whole flat, decoded lazily per range; keys)
    for rank, osd in enumerate(osds):
        for j in range(len(param_shapes)):
            state = osd["optimizer_state_dict"]["state"].get(j, {})
            states[rank, j] = (state, _keys(state, files[rank]))

    def build(name: str) -> ParamState:
        shape, j, offset, part = index[name]
        master = torch.cat([o["fp32_flat_groups"][j][offset:offset + part].float() for o in osds])
        state, keys = states[0, j]
        moments = {m: torch.cat([moment_range(states[r, j][0], m, offset, offset + part) for r in range(world)])
                   for m in keys}
        return ParamState(master=master[:shape.numel()].view(shape), step=state_step(state),
                          moments={k: v[:shape.numel()].view(shape) for k, v in moments.items()},
                          group=origin_of_sub.get(j, 0))

    return ParamStates(f"DeepSpeed ZeRO-3 ({dtype})",
                       LazyParams(index, build, lambda name: origin_of_sub.get(index[name][1], 0)),
                       [hyper.get(i, {}) for i in range(max(hyper, default=-1) + 1)], _loss_scale(osds[0]))


def _read_stage0(saved: dict, names: Sequence[str], shapes: dict[str, torch.Size], dtype: str) -> ParamStates:
    wrapped = "optimizer_state_dict" in saved  # DeepSpeed's fp16/bf16 optimizer at stage 0
    if wrapped and "fp32_groups_flat" in saved:
        saved = _unflatten_fused(saved, names, shapes)
    torch_sd = saved["optimizer_state_dict"] if wrapped else saved
    ids = [i for g in torch_sd["param_groups"] for i in g["params"]]
    group_of = {i: g for g, group in enumerate(torch_sd["param_groups"]) for i in group["params"]}
    if len(ids) != len(names):
        raise CheckpointReadError(f"the stage-0 optimizer state covers {len(ids)} parameters and this model has "
                                  f"{len(names)} trainable ones")
    masters = [t for group in saved.get("fp32_groups", []) for t in group] if wrapped else []
    params = {}
    for position, (i, name) in enumerate(zip(ids, names)):
        state = torch_sd["state"].get(i)
        if not state:
            continue
        shape = shapes[name]
        state = torch_layout(state, shape.numel())
        keys = _keys(state, f"parameter {position} ({name})")
        numel = next((state[k].numel() for k in keys), shape.numel())
        if numel != shape.numel():
            raise CheckpointReadError(f"the stage-0 optimizer state of parameter {position} has {numel} elements "
                                      f"and this run's {name} has {shape.numel()} (the checkpoint's parameter order "
                                      "is not this model's)")
        master = masters[position].float().view(shape) if masters else None
        params[name] = ParamState(master=master, moments={k: state[k].float().view(shape) for k in keys},
                                  step=state_step(state), group=group_of[i])
    scale = None
    if wrapped and saved.get("dynamic_loss_scale"):
        scale = {k: saved[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter") if k in saved}
    return ParamStates(f"DeepSpeed stage 0 ({dtype})", params, [hyperparameters(g) for g in torch_sd["param_groups"]],
                       scale)


def _unflatten_fused(saved: dict, names: Sequence[str], shapes: dict[str, torch.Size]) -> dict:
    """``FP16_Optimizer``'s entry (FusedAdam at stage 0: one flat master and one state per param group,
    ``runtime/fp16/fused_optimizer.py``) as the unfused wrapper's, per parameter: each group's flat holds
    the next parameters in ``model.parameters()`` order, unpadded, until its length is reached."""
    torch_sd = saved["optimizer_state_dict"]
    state, groups, masters, position = {}, [], [], 0
    for g, (group, flat) in enumerate(zip(torch_sd["param_groups"], saved["fp32_groups_flat"])):
        flat_state = torch_sd["state"].get(group["params"][0], {}) if group["params"] else {}
        ids, offset = [], 0
        while offset < flat.numel():
            if position == len(names):
                raise CheckpointReadError(f"the stage-0 fused optimizer's group {g} holds {flat.numel()} elements, "
                                          "more than this model's remaining parameters")
            numel = shapes[names[position]].numel()
            piece = slice(offset, offset + numel)
            state[position] = {k: (v[piece] if torch.is_tensor(v) and v.dim() == 1 else v)
                               for k, v in flat_state.items()}
            state[position].setdefault("step", group.get("step", 0))
            masters.append(flat[piece])
            ids.append(position)
            offset, position = offset + numel, position + 1
        if offset != flat.numel():
            raise CheckpointReadError(f"the stage-0 fused optimizer's group {g} ends inside a parameter of this "
                                      "model (the checkpoint's parameter order is not this model's)")
        groups.append({**group, "params": ids})
    return {**saved, "optimizer_state_dict": {"state": state, "param_groups": groups}, "fp32_groups": [masters]}


__all__ = ["CheckpointReadError", "MODEL_STATES", "moment_range", "optim_files", "read_deepspeed_states", "torch_layout"]
