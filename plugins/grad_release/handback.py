"""Give the training state back to the engine when grad_release is removed.

After removal DeepSpeed's engine (built at stage 0 without a precision wrapper, `ds_config.py`)
steps its basic optimizer over the whole parameters again. For it to continue where grad_release
stopped, each rank gets the full optimizer state of every parameter: the slices are all-gathered
(sharded buckets) and put into ``basic_optimizer.state[param]``. With fp32 parameters the engine
then continues exactly; 16-bit parameters have no fp32 master in that engine, so the states are
cast to the parameter dtype and the masters are dropped (the parameters already hold them rounded).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from xirang_ds.plugins.grad_release.bucket import Bucket
from xirang_ds.plugins.grad_release.comm import wait


def hand_back(buckets: list[Bucket]) -> None:
    """Put every bucket's optimizer state, whole, into the state of the optimizer it was cloned from
    (``bucket.basic``: DeepSpeed's basic optimizer, or under Megatron the torch optimizer inside
    Megatron's); collective when sharded."""
    for bucket in buckets:
        bucket.fetch_states()  # states kept on the host go back to the device, where the engine steps them
        optimizer = bucket.basic
        for param, state in _full_states(bucket).items():
            optimizer.state[param] = {k: (v.to(param.dtype) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                      for k, v in state.items()}


def _local_state(optimizer: Optional[torch.optim.Optimizer], view: torch.Tensor) -> dict:
    """The optimizer's state of ``view`` in ``torch.optim`` layout: an optimizer that stores its
    states otherwise (optimizer_states' quantized codes) converts them with ``torch_state``."""
    if optimizer is None:
        return {}
    convert = getattr(optimizer, "torch_state", None)
    return convert(view) if convert is not None else optimizer.state.get(view, {})


def _full_states(bucket: Bucket) -> dict[torch.Tensor, dict[str, Any]]:
    local = {piece.index: _local_state(bucket.optimizer, view) for piece, view in zip(bucket.pieces, bucket.views)}
    if not bucket.sharded:
        return {bucket.params[i]: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                for i, s in local.items() if s}
    keys, scalars = _agree(bucket, local)
    # one tensor per parameter: optimizers count steps in place (torch's AdamW: ``step_t += 1``)
    out: dict[torch.Tensor, dict[str, Any]] = {
        p: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()} for p in bucket.params}
    device = bucket.params[0].device
    for key in keys:
        shard = torch.zeros(bucket.layout.shard_numel, dtype=torch.float32, device=device)
        for piece in bucket.pieces:
            value = local.get(piece.index, {}).get(key)
            if value is not None:
                shard[piece.offset:piece.offset + piece.numel].copy_(value.reshape(-1))
        full = torch.empty(bucket.layout.numel, dtype=torch.float32, device=device)
        wait(bucket.comm.all_gather(full, shard))
        for i, param in enumerate(bucket.params):
            whole = torch.empty(param.numel(), dtype=torch.float32, device=device)
            bucket.layout.read(full, i, whole)
            out[param][key] = whole.view(param.shape)
    return out


def _agree(bucket: Bucket, local: dict[int, dict]) -> tuple[list[str], dict[str, Any]]:
    """The element-shaped state keys and the scalar states, the same on every rank."""
    mine_keys: set[str] = set()
    mine_scalars: dict[str, Any] = {}
    for state in local.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                mine_keys.add(key)
            elif key not in mine_scalars:
                mine_scalars[key] = value.clone() if isinstance(value, torch.Tensor) else value
    gathered: list[Optional[tuple]] = [None] * bucket.comm.world
    bucket.comm.dist.all_gather_object(gathered, (sorted(mine_keys), mine_scalars), group=bucket.comm.group)
    keys: set[str] = set()
    scalars: dict[str, Any] = {}
    for their_keys, their_scalars in gathered:
        keys.update(their_keys)
        for key, value in their_scalars.items():
            scalars.setdefault(key, value)
    return sorted(keys), scalars


__all__ = ["hand_back"]
