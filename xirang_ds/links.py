"""What one collective costs on a link, and the bucket size at which that cost is mostly transfer.

A ring reduce-scatter (or all-gather) of ``n`` elements of ``b`` bytes over ``p`` ranks costs about
``(p-1)*alpha + (p-1)/p * n*b/beta`` (latency ``alpha``, bandwidth ``beta``). At ``n*b = 9*p*alpha*beta``
the fixed cost is 1/9 of the transfer (10% of the total), so the collective runs at >= 90% of link
bandwidth; smaller buckets pay mostly latency. ``p`` is capped at `RING_RANKS_MAX` (larger groups use
trees). comm_buffers sizes ZeRO's buckets with it and grad_release floors its ``auto`` bucket at it.
"""
from __future__ import annotations

LINKS = {"nccl": (30e-6, 100e9), "gloo": (50e-6, 2e9), "hccl": (30e-6, 50e9), "ccl": (50e-6, 10e9)}
"""Backend → (latency s, bandwidth bytes/s) used when the config leaves them ``auto``."""

RING_RANKS_MAX = 8
"""Beyond this many ranks NCCL reduces with trees and hierarchies, not one flat ring."""


def efficient_numel(elem_bytes: int, ranks: int, latency_s: float, bandwidth: float) -> int:
    """Elements of ``elem_bytes`` bytes at which one collective over ``ranks`` ranks runs at >= 90% of
    link bandwidth: ``9*p*alpha*beta / b``."""
    p = max(1, min(int(ranks), RING_RANKS_MAX))
    return int(9 * p * latency_s * bandwidth / elem_bytes)


def backend_link() -> tuple[str, float, float]:
    """The collective backend in use (the default process group's, else the accelerator's) and its
    `LINKS` entry (NCCL's for a backend not listed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())  # the group Megatron (or the user) already built
    else:
        from deepspeed.accelerator import get_accelerator

        backend = get_accelerator().communication_backend_name()
    latency, bandwidth = LINKS.get(backend, LINKS["nccl"])
    return backend, latency, bandwidth


__all__ = ["LINKS", "RING_RANKS_MAX", "backend_link", "efficient_numel"]
