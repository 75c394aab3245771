"""Codes beside plain DeepSpeed files, so every checkpoint of a ZeRO 1-3 run whose DeepSpeed optimizer
keeps its states as codes (the plugin registered as `xirang_ds.contributions.StateCodes`: optimizer_states'
`DynamicAdamW` without grad_release, every preset at ZeRO-3, an explicit section at ZeRO 1/2) is also a
plain DeepSpeed checkpoint.

With ``deepspeed_files`` (the default), DeepSpeed's own write of each rank's ZeRO file (int8/int4 codes
over optimizer_states' param groups) goes to the tag's ``<StateCodes.folder>/rank<R>.pt`` instead,
the same dict; once every rank's is on disk each rank writes its plain ZeRO file under DeepSpeed's name
(fp32 moments over the user's groups, `tags.write_deepspeed_files`), all before DeepSpeed writes
``latest``. A run with optimizer_states resumes from the codes (DeepSpeed's own load, pointed at them:
nothing is decoded or taken over); plain DeepSpeed, ``zero_to_fp32.py``, ``ds_to_universal`` and the
other owners read the plain files. The codes' file names do not start with DeepSpeed's ZeRO prefixes,
so DeepSpeed's checkpoint tools, which walk the tag folder, do not take them for ZeRO files.

DeepSpeed internals used (deepspeed 0.19.8 ``runtime/engine.py``; `test_resume` fails when they move):
``save_checkpoint`` (L4869) calls ``_save_zero_checkpoint`` (L4935) after the model-states files and
before ``latest`` (L4960); ``_save_zero_checkpoint`` (L5549) names its file with ``_get_zero_ckpt_name``
(L4331); ``_load_zero_checkpoint`` (L4733) reads the files ``_get_all_zero_checkpoint_names`` (L4785)
names; ``_get_zero_param_shapes`` is what the model-states files record as ``param_shapes``.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from xirang_ds.checkpoints import save_atomically
from xirang_ds.checkpoints.deepspeed_files import (
    CheckpointReadError,
    ds_config_dtype,
    load_states_file,
    read_zero12,
    read_zero3,
)
from xirang_ds.checkpoints.deepspeed_writer import add_param_shapes
from xirang_ds.checkpoints.param_states import ParamStates
from xirang_ds.compat.deepspeed import around_zero_file_names, around_zero_save, redirect_zero_files, zero_param_shapes
from xirang_ds.contributions import state_codes, state_files

PARAM_SHAPES = "param_shapes.pt"
"""ZeRO-3's ``param_shapes`` of the codes' sub-groups (the model-states files get the plain ones)."""

_RANK = re.compile(r"^rank(\d+)\.pt$")


def folder() -> str:
    """The tag's folder of the codes, one DeepSpeed ZeRO file per rank (`StateCodes.folder`; ``""`` when no
    plugin keeps codes)."""
    owner = state_codes()
    return owner.folder if owner is not None else ""


def mark(marker: dict) -> None:
    """Record in ``marker`` that the codes sit beside plain files (`in_marker`)."""
    owner = state_codes()
    marker[owner.marker] = owner.folder


def path(tag_dir: str, rank: int) -> str:
    """Rank ``rank``'s file of codes in ``tag_dir``."""
    return os.path.join(tag_dir, folder(), f"rank{rank:05d}.pt")


def files(tag_dir: str) -> list[str]:
    """The codes' files of a tag folder, in rank order (empty: none)."""
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(tag_dir, folder(), "rank*.pt"))
             if (m := _RANK.match(os.path.basename(p)))]
    return [p for _, p in sorted(found)]


def in_marker(marker: dict) -> bool:
    """Whether the checkpoint's marker says the codes sit beside plain files."""
    owner = state_codes()
    return owner is not None and marker.get(owner.marker) == owner.folder


def read_codes(tag_dir: str, names: Sequence[str], shapes: dict[str, torch.Size]) -> ParamStates:
    """The optimizer state per parameter, from the codes (cheaper to read than the plain files, and
    there before them while a save writes them)."""
    found = files(tag_dir)
    if not found:
        raise CheckpointReadError(f"{tag_dir}: no {folder()}/rank*.pt although its marker names them")
    first = load_states_file(found[0])
    stage = int(first["optimizer_state_dict"]["zero_stage"])
    dtype = ds_config_dtype(first.get("ds_config"))
    if stage == 3:
        shapes_file = os.path.join(tag_dir, folder(), PARAM_SHAPES)
        return read_zero3(tag_dir, found, dtype, param_shapes=load_states_file(shapes_file))
    return read_zero12(found, stage, dtype, shapes)


def resumes_own(engine: Any, sections: set[str], marker: dict) -> bool:
    """Whether a run with ``sections`` resumes the codes of a checkpoint with ``marker`` as its own: its
    codes' owner (optimizer_states) steps inside DeepSpeed's optimizer (no `StateFiles` owner: grad_release) at
    the ZeRO stage and world size
    that saved them, and at ZeRO-3 with the same sub-groups (``sub_group_size``, which optimizer_states'
    ``masters`` sets; a checkpoint that does not record them is taken over). Elsewhere the codes are
    taken over, whole parameters."""
    import deepspeed.comm as dist

    own = state_files()
    if not in_marker(marker) or state_codes().section not in sections or (own is not None and own.section in sections):
        return False
    layout = marker.get("deepspeed_files") or {}
    if layout.get("stage") != engine.zero_optimization_stage() or layout.get("stage") not in (1, 2, 3):
        return False
    if layout["stage"] == 3 and layout.get("sub_groups") != zero3_sub_groups(engine):
        return False
    return layout.get("world") == dist.get_world_size(group=engine.optimizer.dp_process_group)


def zero3_sub_groups(engine: Any) -> Optional[list[int]]:
    """The elements of each ZeRO-3 sub-group on a rank (its 16-bit partitions'), else ``None``."""
    weights = getattr(engine.optimizer, "fp16_partitioned_groups_flat", None)
    return None if weights is None else [int(w.numel()) for w in weights]


@contextlib.contextmanager
def saving_beside(engine: Any, tag_dir: str, marker: dict, facts: Any,
                  write_deepspeed_files: Callable[..., tuple[Any, list]]) -> Iterator[None]:
    """While DeepSpeed's ``save_checkpoint`` runs: its ZeRO file goes to `path` (rank 0 adds ZeRO-3's
    ``param_shapes``), then, after a barrier, this rank writes its plain files for ``facts``
    (`tags.RunFacts`) with ``write_deepspeed_files`` (`tags.write_deepspeed_files`), before DeepSpeed
    writes ``latest``."""
    import deepspeed.comm as dist

    rank = dist.get_rank(group=engine.optimizer.dp_process_group)

    def write_plain() -> None:
        _, groups = write_deepspeed_files(tag_dir, marker, facts, ranks=[rank])
        if facts.stage in (1, 2) and engine.save_non_zero_checkpoint:  # ZeRO-3's went into each rank's own
            add_param_shapes(tag_dir, groups, facts.params)

    def save_zero(original: Callable, save_path: str, tag: Any) -> Any:
        os.makedirs(os.path.join(tag_dir, folder()), exist_ok=True)
        if rank == 0 and engine.zero_optimization_stage() == 3:
            save_atomically(zero_param_shapes(engine), os.path.join(tag_dir, folder(), PARAM_SHAPES))
        name = redirect_zero_files(engine, lambda: path(tag_dir, rank))
        try:
            result = original(save_path, tag)
        finally:
            name.remove()
        dist.barrier()  # every rank's codes are on disk
        write_plain()
        return result

    handle = around_zero_save(engine, save_zero)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def loading(engine: Any, tag_dir: str) -> Iterator[None]:
    """While DeepSpeed's ``load_checkpoint`` runs: its ZeRO files are the codes beside the plain ones."""
    def names(original: Callable, load_dir: str, tag: Any, bf16_mode: bool) -> list[str]:
        return [path(tag_dir, r) for r in range(len(original(load_dir, tag, bf16_mode)))]

    handle = around_zero_file_names(engine, names)
    try:
        yield
    finally:
        handle.remove()


__all__ = ["PARAM_SHAPES", "files", "folder", "in_marker", "loading", "mark", "path", "read_codes", "resumes_own",
           "saving_beside", "zero3_sub_groups"]
