"""One checkpoint tag folder: which block wrote it, its optimizer state per parameter whoever owns
it, and DeepSpeed's own ZeRO files written beside xirang's (`export_deepspeed_files`), so plain
DeepSpeed, ``zero_to_fp32.py`` and ``ds_to_universal`` read every xirang checkpoint."""
from __future__ import annotations

import json
import os
from typing import Iterable, Optional, Sequence

import torch

from xirang_ds.checkpoints.param_states import ParamStates

MARKER = "xirang_block.json"
"""Written into each checkpoint's tag folder: the xirang_ds version, the preset and the sections that
ran, and (``deepspeed_files``) the layout of the plain ZeRO files written beside them."""

GRAD_RELEASE_FOLDER = "xirang_grad_release"


def resolve_tag(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The tag folder ``engine.load_checkpoint(load_dir, tag)`` reads (``latest`` when no tag), or
    ``None`` when there is none (DeepSpeed then says so itself)."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    tag_dir = os.path.join(load_dir, str(tag))
    return tag_dir if os.path.isdir(tag_dir) else None


def read_marker(tag_dir: str) -> dict:
    """The tag's `MARKER` (``{}`` for a plain DeepSpeed checkpoint; grad_release's folder alone means a
    checkpoint written before the marker existed)."""
    path = os.path.join(tag_dir, MARKER)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    if os.path.isdir(os.path.join(tag_dir, GRAD_RELEASE_FOLDER)):
        return {"sections": ["grad_release"]}
    return {}


def write_marker(tag_dir: str, marker: dict) -> None:
    """`MARKER` written to a temporary name and renamed (atomic where the folder is shared)."""
    os.makedirs(tag_dir, exist_ok=True)
    path = os.path.join(tag_dir, MARKER)
    temporary = f"{path}.{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=2)
    os.replace(temporary, path)


def state_owners(marker: dict) -> set[str]:
    """The sections that own the tag's optimizer state: grad_release (its shards) and optimizer_states
    (DynamicAdamW's codes in DeepSpeed's files) unless plain ZeRO files replaced those."""
    sections = set(marker.get("sections", []))
    owners = sections & {"grad_release", "optimizer_states"}
    if "grad_release" not in owners and marker.get("deepspeed_files"):
        owners.discard("optimizer_states")  # DeepSpeed's files were rewritten in plain layout
    return owners


def read_states(tag_dir: str, marker: dict, names: Sequence[str], shapes: dict[str, torch.Size]) -> ParamStates:
    """The tag's optimizer state per parameter, from whichever owner wrote it.

    Args:
        names, shapes: the trainable parameters in ``model.parameters()`` order (a stage-0 DeepSpeed
            state is indexed by position).
    """
    from xirang_ds.checkpoints.deepspeed_files import read_deepspeed_states
    from xirang_ds.plugins.grad_release.checkpoint import read_param_states

    if "grad_release" in state_owners(marker):
        return read_param_states(tag_dir)
    return read_deepspeed_states(tag_dir, names, shapes)


def export_deepspeed_files(save_dir: str, tag: Optional[str] = None, ranks: Optional[Iterable[int]] = None,
                           stage: Optional[int] = None, world: Optional[int] = None,
                           ds_config: Optional[dict] = None) -> list[str]:
    """Write plain DeepSpeed's ZeRO files of a xirang checkpoint into its own tag folder (rank files,
    ``param_shapes`` in the model-states file, ``zero_to_fp32.py`` in ``save_dir``) and record them in
    the marker. xirang's own files stay: a run with the same block still resumes from them exactly.

    Args:
        ranks: which ranks' files to write (default: all; at save each rank writes its own).
        stage, world: the ZeRO stage and data-parallel size to write for (default: the run's).
        ds_config: the run's ds_config as written (recorded in the files; its fp16 section shapes the
            saved loss scaler).

    Returns:
        the paths written ([] when the tag's optimizer state already is in DeepSpeed's own layout).

    Raises:
        ValueError: a stage or layout these files cannot express, with what to do instead.
    """
    from xirang_ds.checkpoints.deepspeed_files import MODEL_STATES, _load
    from xirang_ds.checkpoints.deepspeed_writer import add_param_shapes, copy_recovery_script, write_zero_files

    tag_dir = resolve_tag(save_dir, tag)
    if tag_dir is None:
        raise ValueError(f"{save_dir} has no checkpoint tag {tag!r} (no 'latest' file or no such folder)")
    marker = read_marker(tag_dir)
    owners = state_owners(marker)
    if not owners:
        return []
    model = _load(os.path.join(tag_dir, MODEL_STATES))
    module, buffers = model["module"], set(model.get("buffer_names") or [])
    layout = _layout(tag_dir, owners, module)
    stage = layout["stage"] if stage is None else stage
    world = layout["world"] if world is None else world
    if stage not in (1, 2):
        raise ValueError(f"{tag_dir} was written for ZeRO stage {stage}; plain ZeRO files are written for stages 1 "
                         "and 2 (stage 0 keeps its optimizer state inside the model-states file, which xirang's own "
                         "resume reads, and ZeRO-3 files are not written yet). Fix: export with stage=1 or 2, "
                         "or convert with DeepSpeed's ds_to_universal after a stage-1/2 export")
    names = [n for n in module if n not in buffers]
    states = read_states(tag_dir, marker, names, {n: module[n].shape for n in names})
    names = [n for n in names if n in states.params]
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(states.params[n].group, []).append(n)
    ordered = [groups[g] for g in sorted(groups)]
    torch_groups = _torch_groups(model.get("optimizer"), states, len(ordered))
    written = write_zero_files(tag_dir, states, ordered, torch_groups, stage, layout["dtype"], world, ranks=ranks,
                               ds_config=ds_config if ds_config is not None else layout.get("ds_config"))
    if ranks is None or 0 in set(ranks):
        add_param_shapes(tag_dir, ordered, {n: module[n].shape for n in names})
        copy_recovery_script(save_dir)
        write_marker(tag_dir, {**marker, "deepspeed_files": {"stage": stage, "world": world, "dtype": layout["dtype"]}})
    return written


def _layout(tag_dir: str, owners: set[str], module: dict) -> dict:
    """The stage, world size and dtype the run that wrote the tag asked for."""
    from xirang_ds.checkpoints.deepspeed_files import _dtype, _load, optim_files
    from xirang_ds.plugins.grad_release.checkpoint import load_shard, shard_path

    if "grad_release" in owners:
        shard = load_shard(shard_path(tag_dir, 0), mmap=True)
        dtypes = {t.dtype for t in module.values() if torch.is_tensor(t) and t.is_floating_point()}
        dtype = "bf16" if torch.bfloat16 in dtypes else "fp16" if torch.float16 in dtypes else "fp32"
        return {"stage": int(shard["zero_stage"]), "world": int(shard["world"]), "dtype": dtype}
    files = optim_files(tag_dir)
    if not files:
        return {"stage": 0, "world": 1, "dtype": "fp32"}
    first = _load(files[0])
    return {"stage": int(first["optimizer_state_dict"]["zero_stage"]), "world": len(files),
            "dtype": _dtype(first.get("ds_config")), "ds_config": first.get("ds_config")}


def _torch_groups(saved_optimizer: Optional[dict], states: ParamStates, count: int) -> list[dict]:
    """Each group's ``torch.optim.AdamW`` param-group dict for the plain files: the basic optimizer's
    own (grad_release runs save it), else AdamW's defaults under the saved hyperparameters."""
    groups = list((saved_optimizer or {}).get("param_groups") or [])
    if len(groups) == count and all("amsgrad" in g for g in groups):
        return [{k: v for k, v in g.items() if k != "params"} for g in groups]
    template = {k: v for k, v in torch.optim.AdamW([torch.zeros(1)]).param_groups[0].items() if k != "params"}
    template["bias_correction"] = True  # DeepSpeed's FusedAdam reads it
    return [dict(template, **(states.groups[g] if g < len(states.groups) else {})) for g in range(count)]


__all__ = ["GRAD_RELEASE_FOLDER", "MARKER", "export_deepspeed_files", "read_marker", "read_states", "resolve_tag",
           "state_owners", "write_marker"]
