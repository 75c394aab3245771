"""The data-parallel collectives of grad_release, through ``deepspeed.comm`` so DeepSpeed's comms
logger sees them (under Megatron, where ``deepspeed.comm`` is not initialised, ``torch.distributed``).
A single rank (or a replicated bucket's gather) needs no collective: the methods then return
``None`` instead of a work handle.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class DataParallelComm:
    """Collectives over one data-parallel process group.

    Args:
        group: the process group (DeepSpeed's ``seq_data_parallel_group``, what ZeRO reduces over;
            Megatron's data- or tensor-parallel group); ``None`` with a single process.
        dist: the collectives module: ``deepspeed.comm`` (default) or ``torch.distributed``.

    Attributes:
        world: ranks in the group.
        rank: this process's rank in the group.
    """

    def __init__(self, group: Any, dist: Any = None) -> None:
        if dist is None:
            import deepspeed.comm as dist

        self.dist = dist
        self.group = group
        initialized = dist.is_initialized()
        self.world = dist.get_world_size(group=group) if initialized else 1
        self.rank = dist.get_rank(group=group) if initialized else 0

    def reduce_scatter(self, out: torch.Tensor, buffer: torch.Tensor) -> Optional[Any]:
        """Sum ``buffer`` (``[world * n]``) over ranks; this rank's ``n`` go to ``out``. Async."""
        if self.world == 1:
            out.copy_(buffer)
            return None
        return self.dist.reduce_scatter_tensor(out, buffer, op=self.dist.ReduceOp.SUM, group=self.group,
                                               async_op=True)

    def all_reduce(self, buffer: torch.Tensor, async_op: bool = True) -> Optional[Any]:
        """Sum ``buffer`` over ranks in place."""
        if self.world == 1:
            return None
        work = self.dist.all_reduce(buffer, op=self.dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return work if async_op else None

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Optional[Any]:
        """Concatenate every rank's ``shard`` into ``out`` (``[world * n]``). Async."""
        if self.world == 1:
            out.copy_(shard)
            return None
        return self.dist.all_gather_into_tensor(out, shard, group=self.group, async_op=True)


def wait(work: Optional[Any]) -> None:
    """Wait for a work handle (``None``: nothing in flight)."""
    if work is not None:
        work.wait()


__all__ = ["DataParallelComm", "wait"]
