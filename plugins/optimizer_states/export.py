"""States decoded to fp32 in ``torch.optim.AdamW``/``Adam`` layout: for removing the plugin and
for reading a checkpoint without it."""
from __future__ import annotations

from typing import Any, Optional

import torch

from xirang_ds.contributions import StateCodes, register_checkpoint
from xirang_ds.plugins.optimizer_states.formats import MOMENTS, format_of, make_format


class StateLoadError(ValueError):
    """A checkpoint's optimizer states cannot be loaded into this optimizer (the message says why
    and what to do)."""


def decode_state(state: dict, param: torch.Tensor) -> dict:
    """One parameter's state as ``torch.optim.AdamW`` keeps it: ``step``, ``exp_avg``, ``exp_avg_sq``
    (fp32, shaped like ``param``)."""
    name = format_of(state)
    size = state.get("block_size") or 0
    fmt = make_format(name, int8_block_size=size or 256, int4_block_size=size or 128)
    out = {"step": state["step"].clone()}
    for moment in MOMENTS:
        buffers = {k: state[k] for k in fmt.keys(moment)}
        out[moment] = fmt.decode(moment, buffers, 0, param.numel()).clone().view_as(param)
    return out


def moment_range(state: dict, moment: str, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of a saved state's moment as fp32, from DynamicAdamW's codes (only the
    blocks they touch are decoded) or from a ``torch.optim`` state's flat tensor."""
    if "format" not in state:
        return state[moment].reshape(-1)[start:end].float()
    size = state.get("block_size") or 0
    fmt = make_format(format_of(state), int8_block_size=size or 256, int4_block_size=size or 128)
    # a view into the decoded blocks (at most two blocks more than asked): the callers copy it once
    return fmt.decode(moment, {k: state[k] for k in fmt.keys(moment)}, start, end)


def torch_layout(state: Optional[dict], numel: int) -> dict:
    """A saved state of ``numel`` elements in ``torch.optim`` layout: DynamicAdamW's (its ``format``
    key) decoded to fp32, flat; another optimizer's as it is; ``{}`` for none."""
    if not state:
        return {}
    return decode_state(state, torch.empty(numel, device="meta")) if "format" in state else state


def to_torch_optimizer(opt: Any, into: Optional[torch.optim.Optimizer] = None) -> torch.optim.Optimizer:
    """A ``torch.optim`` Adam/AdamW continuing where ``opt`` (a `DynamicAdamW`) is: same param-group dicts (so learning
    rate schedulers holding either keep working), states decoded to fp32.

    Args:
        into: an existing Adam/AdamW object to fill (the client's original), else a new one.

    Raises:
        ValueError: a group without bias correction (torch's Adam always corrects).
    """
    if any(not g["bias_correction"] for g in opt.param_groups):
        raise ValueError("cannot hand states to torch.optim: a param group has bias_correction=False")
    decoupled = all(g["adam_w_mode"] for g in opt.param_groups)
    if into is None:
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        into = cls([{"params": list(g["params"])} for g in opt.param_groups])
    template = dict(into.defaults)
    for group in opt.param_groups:
        for key, value in template.items():
            group.setdefault(key, value)
        group["decoupled_weight_decay"] = bool(group["adam_w_mode"])
    into.param_groups = opt.param_groups
    into.state.clear()
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state.get(p):
                into.state[p] = decode_state(opt.state[p], p)
    return into


def checkpoint_to_torch(optimizer_state_dict: dict, params: list[torch.Tensor]) -> dict:
    """A saved `DynamicAdamW` state dict rewritten as a ``torch.optim.AdamW`` state dict (for a run
    resumed without the plugin); ``params`` gives each saved index its element count and shape."""
    out = {k: v for k, v in optimizer_state_dict.items() if k in ("state", "param_groups")}
    ids = [i for g in optimizer_state_dict["param_groups"] for i in g["params"]]
    out["state"] = {i: decode_state(optimizer_state_dict["state"][i], p)
                    for i, p in zip(ids, params) if optimizer_state_dict["state"].get(i)}
    return out


# DynamicAdamW's codes in a checkpoint: beside plain DeepSpeed files, decoded by the readers (`xirang_ds.checkpoints`)
register_checkpoint(StateCodes("optimizer_states", marker="optimizer_states_codes", folder="xirang_optimizer_states",
                               codes="optimizer_states' int8/int4 codes", is_coded=lambda state: "format" in state,
                               moment_range=moment_range, torch_layout=torch_layout))


def reencode_v1(state: dict) -> None:
    """An int8 state saved with version 1's second-moment map, re-encoded in today's: each value
    decoded with the old map and rounded to the nearest code of the new one (the block scales stay)."""
    from xirang_ds.plugins.optimizer_states.qmaps import SECOND_MOMENT_8BIT, SECOND_MOMENT_8BIT_V1

    codes = state.get("exp_avg_sq_codes")
    if codes is None or format_of(state) != "int8":
        return
    values = SECOND_MOMENT_8BIT_V1.decode(codes)
    new = SECOND_MOMENT_8BIT.encode(values)
    codes.copy_(new.to(codes.dtype))


def check_numel(state: dict, p: torch.Tensor, index: int) -> None:
    """A saved state (``state``) of parameter ``index`` holds ``p``'s element count.

    Raises:
        StateLoadError: it does not (another world size or set of parameters).
    """
    name = format_of(state)
    fmt = make_format(name, state.get("block_size") or 256, state.get("block_size") or 128)
    key = fmt.keys("exp_avg")[0]
    if key not in state:
        return
    expected = fmt.zeros("exp_avg", p.numel(), torch.device("meta"))[key].numel()
    if state[key].numel() != expected:
        raise StateLoadError(
            f"optimizer state of parameter {index} holds {state[key].numel()} {name} elements of {key!r} but the "
            f"parameter has {p.numel()} elements (the states would need {expected}). Under ZeRO each rank keeps "
            f"the states of its own partition, so a checkpoint saved with another data-parallel world size, other "
            f"ZeRO-3 sub-groups (zero_optimization.sub_group_size) or another set of parameters cannot be matched "
            f"element by element. Resume with the world size and sub_group_size the checkpoint was saved with, or "
            f"load with load_optimizer_states=False to restart the moments.")


__all__ = ["StateLoadError", "check_numel", "checkpoint_to_torch", "decode_state", "moment_range", "reencode_v1",
           "to_torch_optimizer", "torch_layout"]
