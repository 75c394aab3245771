"""grad_release's part of a DeepSpeed checkpoint: one file per rank beside DeepSpeed's files.

DeepSpeed's ``client_state`` lands in the model-states file that rank 0 writes, but each rank holds
a different shard of master weights and optimizer states, so every rank writes its own file
``<save_dir>/<tag>/xirang_grad_release/rank<R>.pt`` before DeepSpeed writes its files (and its
``latest`` pointer). The module weights, the basic optimizer's hyperparameters, the LR scheduler
and the step counters stay in DeepSpeed's files.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Sequence

import torch

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
    tmp = path + ".tmp"
    torch.save({"format": FORMAT, **payload}, tmp)
    os.replace(tmp, path)


def load_shard(path: str) -> dict:
    """Read one rank's file.

    Raises:
        FileNotFoundError: the checkpoint has no grad_release file for this rank.
        ValueError: the file is of another format version.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    payload = torch.load(path, map_location="cpu", weights_only=False)
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


def read_param_states(tag_dir: str) -> "ParamStates":
    """Every rank's file of a checkpoint tag read into whole per-parameter states (flat), for a run
    that resumes without grad_release or with another optimizer.

    Raises:
        FileNotFoundError: a rank's file is missing.
        ValueError: a file of another format, or one that does not say which param group each
            parameter's slice is in while its optimizer has several.
    """
    from xirang_ds.checkpoints.param_states import ParamState, ParamStates, hyperparameters
    from xirang_ds.plugins.grad_release.layout import BucketLayout
    from xirang_ds.plugins.optimizer_states.export import torch_layout

    first = load_shard(shard_path(tag_dir, 0))
    files = [first] + [load_shard(shard_path(tag_dir, r)) for r in range(1, int(first["world"]))]
    whole: dict[str, dict] = {}
    groups: dict[int, dict] = {}
    for b, fingerprint in enumerate(first["buckets"]):
        layout = BucketLayout.build(fingerprint["numels"], fingerprint["world"])
        for saved in files:
            state, opt = saved["bucket_states"][b], saved["bucket_states"][b]["optimizer"]
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
                name, numel = fingerprint["names"][piece.index], fingerprint["numels"][piece.index]
                entry = whole.setdefault(name, {"master": None, "exp_avg": torch.zeros(numel),
                                                "exp_avg_sq": torch.zeros(numel), "step": 0, "group": src})
                torch_state = torch_layout(opt["state"].get(i), piece.numel)
                if not torch_state:
                    continue
                groups.setdefault(src, hyperparameters(opt["param_groups"][k]))
                span = slice(piece.start, piece.start + piece.numel)
                for m in ("exp_avg", "exp_avg_sq"):
                    entry[m][span].copy_(torch_state[m].reshape(-1))
                entry["step"] = int(torch_state["step"])
                if state["master"] is not None:
                    if entry["master"] is None:
                        entry["master"] = torch.zeros(numel)
                    entry["master"][span].copy_(state["master"][piece.offset:piece.offset + piece.numel])
    params = {name: ParamState(master=e["master"], exp_avg=e["exp_avg"], exp_avg_sq=e["exp_avg_sq"], step=e["step"],
                               group=e["group"]) for name, e in whole.items()}
    # the buckets copied their hyperparameters before the last step; DeepSpeed's file has the basic
    # optimizer's groups as the LR scheduler left them for the next one
    model_states = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    if os.path.isfile(model_states):
        basic = torch.load(model_states, map_location="cpu", weights_only=False, mmap=True).get("optimizer") or {}
        for g, group in enumerate(basic.get("param_groups", [])):
            groups[g] = hyperparameters(group)
    return ParamStates(f"xirang grad_release (ZeRO-{first['zero_stage']}, {first['world']} rank(s))", params,
                       [groups.get(g, {}) for g in range(max(groups, default=-1) + 1)],
                       (first.get("policy") or {}).get("loss_scaler"))


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


__all__ = ["FORMAT", "load_rank_state", "load_shard", "mismatch", "read_param_states", "save_rank_state", "save_shard",
           "shard_path"]
