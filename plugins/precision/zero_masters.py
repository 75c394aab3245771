"""ZeRO 1/2 in fp32: let each rank's fp32 master partition be its slice of the model's weights.

In fp32 mode DeepSpeed's ZeRO 1/2 optimizer still clones the rank's partition of the flat weight
buffer into ``single_partition_of_fp32_groups`` (the "master"), steps that clone, and copies it
back into the flat buffer before the all-gather. When both are fp32 the clone is a second copy of
the same numbers: 4/N bytes per parameter. Here the master is made a view of the flat buffer's
partition instead (same tensor object, so optimizer states and param groups keep pointing at it),
and the fp32 fragments that ``link_hp_params`` made from the clone are made again from the view.
The optimizer then updates the model's weights in place; DeepSpeed's copy back is a copy onto
itself, and its all-gather hands the other ranks their slices as before. Results are identical.

DeepSpeed lines this relies on (0.19.8, ``runtime/zero/stage_1_and_2.py``): ``__init__``
"weights_partition = self.parallel_partitioned_bit16_groups[i][partition_id].detach().clone()",
``_link_all_hp_params``, ``step`` "bit16_partitions[partition_id].data.copy_(fp32_partition.data)".
``tests/precision/test_deepspeed.py`` fails (bytes or losses) if a release changes them.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from xirang_ds.compat.deepspeed import can_relink_hp_params, relink_hp_params

logger = logging.getLogger("xirang_ds")

_NEEDED = ("single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups", "real_dp_process_group",
           "cpu_offload")


def share_fp32_masters(optimizer: Any) -> Optional[str]:
    """Make each fp32 master partition a view of the model's flat weights.

    Args:
        optimizer: DeepSpeed's ZeRO 1/2 optimizer (``engine.optimizer``) holding fp32 weights.

    Returns:
        ``None`` when done, else why it was left as it is (offload, 16-bit weights, another
        DeepSpeed layout); the run is then correct, with DeepSpeed's extra copy.
    """
    import deepspeed.comm as dist

    missing = [n for n in _NEEDED if not hasattr(optimizer, n)] + ([] if can_relink_hp_params(optimizer) else
                                                                   ["the per-parameter views of the fp32 partition"])
    if missing:
        return f"the ZeRO optimizer lacks {', '.join(missing)} (a DeepSpeed layout this was not built for)"
    if optimizer.cpu_offload:
        return "the fp32 masters are offloaded to the host"
    pairs = []
    for i, master in enumerate(optimizer.single_partition_of_fp32_groups):
        part = optimizer.parallel_partitioned_bit16_groups[i][dist.get_rank(group=optimizer.real_dp_process_group[i])]
        if master.dtype != torch.float32 or part.dtype != torch.float32 or master.shape != part.shape \
                or master.device != part.device:
            return f"group {i}: master {master.dtype}{tuple(master.shape)} and weights {part.dtype}{tuple(part.shape)} differ"
        pairs.append((master, part))
    for master, part in pairs:
        if master.data_ptr() != part.data_ptr():
            master.data = part.detach()  # same tensor object: the optimizer's param groups and states keep it
    relink_hp_params(optimizer)  # fp32 fragments of each parameter, remade as views of the shared memory
    return None


__all__ = ["share_fp32_masters"]
