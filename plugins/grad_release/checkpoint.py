"""grad_release's part of a DeepSpeed checkpoint: one file per rank beside DeepSpeed's files.

DeepSpeed's ``client_state`` lands in the model-states file that rank 0 writes, but each rank holds
a different shard of master weights and optimizer states, so every rank writes its own file
``<save_dir>/<tag>/xirang_grad_release/rank<R>.pt`` before DeepSpeed writes its files (and its
``latest`` pointer). The module weights, the basic optimizer's hyperparameters, the LR scheduler
and the step counters stay in DeepSpeed's files.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from xirang_ds.checkpoints import save_atomically
from xirang_ds.checkpoints.param_states import (
    LazyParams,
    ParamState,
    ParamStates,
    elementwise_keys,
    hyperparameters,
    state_step,
)
from xirang_ds.plugins.grad_release.layout import BucketLayout
from xirang_ds.checkpoints import BASIC_GROUPS
from xirang_ds.checkpoints.deepspeed_files import MODEL_STATES, load_states_file, torch_layout
from xirang_ds.contributions import StateFiles, register_checkpoint

if TYPE_CHECKING:  # pragma: no cover
    from xirang_ds.checkpoints.param_states import ParamStates

FORMAT = 1
"""Version of the file layout."""
FOLDER = "xirang_grad_release"


def shard_path(tag_dir: str, rank: int) -> str:
    """Where rank ``rank``'s file of a checkpoint tag lives."""
    return os.path.join(tag_dir, FOLDER, f"rank{rank:05d}.pt")


def save_shard(path: str, payload: dict) -> None:
    """Write one rank's file (atomically: a partial file never has the final name)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_atomically({"format": FORMAT, **payload}, path)


def load_shard(path: str, mmap: bool = False) -> dict:
    """Read one rank's file (``mmap``: memory-mapped, for reading slices of it; the tensors are then
    backed by the file, not by allocations of their own).

    Raises:
        FileNotFoundError: the checkpoint has no grad_release file for this rank.
        ValueError: the file is of another format version.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    payload = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{path} has grad_release checkpoint format {payload.get('format')}; this version reads "
                         f"format {FORMAT}")
    return payload


def save_rank_state(tag_dir: str, rank: int, layout: dict, policy: Any, buckets: Sequence[Any]) -> None:
    """Write this rank's masters, optimizer states and policy state for a checkpoint tag.

    Args:
        tag_dir: ``<save_dir>/<tag>``.
        layout: the run's layout (world, stage, bucket fingerprints), checked again on load.
        policy: the `ReleasePolicy` (loss scale, previous norm).
        buckets: this rank's buckets.
    """
    save_shard(shard_path(tag_dir, rank), {**layout, "rank": rank, "policy": policy.state_dict(),
                                           "bucket_states": [b.state_dict() for b in buckets],
                                           "sources": [list(b.sources) for b in buckets]})


def load_rank_state(tag_dir: str, rank: int, layout: dict, policy: Any, buckets: Sequence[Any]) -> None:
    """Restore what `save_rank_state` wrote for this rank.

    Raises:
        RuntimeError: the tag has no grad_release file for this rank, or its layout differs from this
            run's; the message says how to load the weights alone.
    """
    path = shard_path(tag_dir, rank)
    try:
        saved = load_shard(path)
    except FileNotFoundError:
        raise RuntimeError(f"xirang.grad_release: the checkpoint {tag_dir} has no grad_release state for rank {rank} "
                           f"({path}); it was saved without grad_release or with fewer ranks. Fix: "
                           "load_checkpoint(..., load_optimizer_states=False) to start fresh optimizer states from "
                           "its weights") from None
    problems = mismatch(saved, layout)
    if problems:
        raise RuntimeError(f"xirang.grad_release: the checkpoint's optimizer shards do not fit this run: "
                           f"{'; '.join(problems)}. Fix: resume with the same world size, ZeRO stage, model and "
                           "bucket_size_numel, or load_checkpoint(..., load_optimizer_states=False)")
    for bucket, state in zip(buckets, saved["bucket_states"]):
        bucket.load_state_dict(state)
    policy.load_state_dict(saved["policy"])


def read_param_states(tag_dir: str, optimizer_groups: Optional[list] = None) -> "ParamStates":
    """Every rank's file of a checkpoint tag as whole per-parameter states (flat), for a run that
    resumes without grad_release or with another optimizer or layout, and for writing DeepSpeed's
    own files. The files are memory-mapped and each parameter is assembled when it is asked for
    (`LazyParams`), so a reader holds one whole parameter at a time.

    Args:
        optimizer_groups: the basic optimizer's param groups (default: read from DeepSpeed's model-states
            file, which at save is not written yet).

    Raises:
        FileNotFoundError: a rank's file is missing.
        ValueError: a file of another format, or one that does not say which param group each
            parameter's slice is in while its optimizer has several.
    """
    first = load_shard(shard_path(tag_dir, 0), mmap=True)
    files = [first] + [load_shard(shard_path(tag_dir, r), mmap=True) for r in range(1, int(first["world"]))]
    index: dict[str, list[tuple]] = {}  # name → (numel, group, [(file, bucket, piece, state id)])
    groups: dict[int, dict] = {}
    for b, fingerprint in enumerate(first["buckets"]):
        layout = BucketLayout.build(fingerprint["numels"], fingerprint["world"])
        for saved in files:
            opt = saved["bucket_states"][b]["optimizer"]
            if opt is None:
                continue  # this rank held no element of the bucket
            pieces = [p for p in layout.pieces(saved["rank"] if layout.world > 1 else 0) if p.numel > 0]
            sources = saved["sources"][b] if "sources" in saved else None
            if sources is None and len(opt["param_groups"]) > 1:
                raise ValueError(f"{tag_dir}: bucket {b} has {len(opt['param_groups'])} param groups and the file does "
                                 "not say which parameter is in which (written before xirang_ds recorded it)")
            sources = sources or [0] * len(fingerprint["names"])
            order = [(piece, src) for src in sorted({sources[p.index] for p in pieces})
                     for piece in pieces if sources[piece.index] == src]
            ids = [(i, k) for k, g in enumerate(opt["param_groups"]) for i in g["params"]]
            for (piece, src), (i, k) in zip(order, ids):
                name = fingerprint["names"][piece.index]
                entry = index.setdefault(name, (fingerprint["numels"][piece.index], src, []))
                entry[2].append((saved, b, piece, i))
                groups.setdefault(src, hyperparameters(opt["param_groups"][k]))
    # the buckets copied their hyperparameters before the last step; DeepSpeed's file has the basic
    # optimizer's groups as the LR scheduler left them for the next one. optimizer_states' DynamicAdamW
    # splits the user's groups and marks each half with xirang_group: states are grouped by the user's.
    origins: dict[int, int] = {}
    if optimizer_groups is None:
        optimizer_groups = saved_basic_groups(tag_dir)
    if optimizer_groups:
        saved_groups = optimizer_groups
        origins = {g: int(group.get("xirang_group", g)) for g, group in enumerate(saved_groups)}
        groups = {}
        for g, group in enumerate(saved_groups):
            groups.setdefault(origins[g], hyperparameters(group))

    def build(name: str) -> ParamState:
        numel, source, pieces = index[name]
        group = origins.get(source, source)
        master, moments, step = None, {}, None
        for saved, b, piece, i in pieces:
            bucket_state = saved["bucket_states"][b]
            state = torch_layout(bucket_state["optimizer"]["state"].get(i), piece.numel)
            if not state:
                continue
            span = slice(piece.start, piece.start + piece.numel)
            for m in elementwise_keys(state, piece.numel):
                moments.setdefault(m, torch.zeros(numel))[span].copy_(state[m].reshape(-1))
            step = state_step(state)
            if bucket_state["master"] is not None:
                if master is None:
                    master = torch.zeros(numel)
                master[span].copy_(bucket_state["master"][piece.offset:piece.offset + piece.numel])
        return ParamState(master=master, moments=moments, step=step, group=group)

    return ParamStates(f"xirang grad_release (ZeRO-{first['zero_stage']}, {first['world']} rank(s))",
                       LazyParams(index, build, lambda name: origins.get(index[name][1], index[name][1])),
                       [groups.get(g, {}) for g in range(max(groups, default=-1) + 1)],
                       (first.get("policy") or {}).get("loss_scaler"))


def basic_groups(model_states: dict) -> Optional[list[dict]]:
    """The basic optimizer's param groups a grad_release run's model-states file records: under
    `BASIC_GROUPS` when its ``optimizer`` entry is plain DeepSpeed's stage-0 one, else that entry's."""
    if model_states.get(BASIC_GROUPS) is not None:
        return model_states[BASIC_GROUPS]
    return (model_states.get("optimizer") or {}).get("param_groups")


def saved_basic_groups(tag_dir: Optional[str]) -> Optional[list[dict]]:
    """`basic_groups` of the tag's model-states file (memory-mapped); ``None`` without one."""
    path = os.path.join(tag_dir, MODEL_STATES) if tag_dir is not None else ""
    return basic_groups(load_states_file(path)) if os.path.isfile(path) else None


def mismatch(saved: dict, current: dict) -> list[str]:
    """Differences between the saved run's layout and this run's (empty: the shards fit)."""
    out = []
    for key in ("world", "zero_stage"):
        if saved.get(key) != current.get(key):
            out.append(f"{key} was {saved.get(key)}, is {current.get(key)}")
    saved_buckets, buckets = saved.get("buckets", []), current.get("buckets", [])
    if len(saved_buckets) != len(buckets):
        out.append(f"{len(saved_buckets)} buckets were saved, this run has {len(buckets)} "
                   "(same bucket_size_numel and model needed)")
    else:
        for i, (a, b) in enumerate(zip(saved_buckets, buckets)):
            if a != b:
                out.append(f"bucket {i} differs: saved {_brief(a)}, now {_brief(b)}")
                break
    return out


def _brief(fingerprint: Any) -> str:
    names = fingerprint.get("names", []) if isinstance(fingerprint, dict) else []
    return f"{names[:2]}{'...' if len(names) > 2 else ''} ({fingerprint.get('dtype')}, world {fingerprint.get('world')})"


def layout(tag_dir: str) -> tuple[int, int]:
    """The ZeRO stage and data-parallel ranks of the run that wrote the tag (from rank 0's file)."""
    shard = load_shard(shard_path(tag_dir, 0), mmap=True)
    return int(shard["zero_stage"]), int(shard["world"])


# the tag's readers find the state in these files (`xirang_ds.checkpoints.tags`)
register_checkpoint(StateFiles(
    "grad_release", FOLDER, read_param_states, basic_groups, layout, holder=f"grad_release's shards ({FOLDER}/)",
    tools="cannot read it (grad_release at stage 0, saved without plain files); `xirang-ds checkpoint export "
          "--stage 0` writes the entry plain DeepSpeed at stage 0 resumes, `--stage 2` ZeRO-2 files"))


__all__ = ["FORMAT", "layout", "load_rank_state", "load_shard", "mismatch", "read_param_states", "save_rank_state",
           "save_shard", "shard_path"]
