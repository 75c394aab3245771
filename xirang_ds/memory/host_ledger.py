"""Host-tier buffers as the host really holds them: one ledger for every tier, and ``host_memory_budget``.

Every plugin that moves bytes off the device makes its host buffer here (`HostLedger.buffer`): activation
offload's pool, grad_release's parked optimizer states and stashed gradient shard, and a comm_buffers
arena's evictions. On an accelerator the buffer is pinned through DeepSpeed's accelerator, which on CUDA is
torch's caching host allocator, and that allocator does not hold what was asked for:

* a block is the request rounded up to the next power of two (a 1.25 MiB buffer pins 2 MiB;
  ``torch.cuda.host_memory_stats``: "Block sizes are rounded up to the next power of two");
* a dropped block stays pinned in the allocator's cache, to be handed to the next request of its size
  (only ``empty_cache`` of the host allocator, which training never calls, gives it back).

So dropping a buffer frees nothing, and a pool that trims its cache to stay under a budget keeps every
block it ever made. The ledger counts what the allocator holds: ``held_bytes`` grows by a block when no
cached block of that size is free, and a dropped pinned buffer moves its block to the cached ones instead
of lowering it. On the CPU (nothing pinned) a buffer is ordinary memory: it counts its own bytes and gives
them back when dropped. ``in_use_bytes`` is what live buffers hold either way.

``host_memory_budget`` (bytes) caps ``held_bytes``. A tier that can do without the host asks first
(`HostLedger.fits`): activation offload keeps a tensor on the device that would take the ledger over it.
A tier whose bytes must go somewhere (grad_release's states and stash, an eviction the lender needs) is
counted and says once, with the figures, that it went over. There is one ledger per process, as there is
one host allocator (`ledger`).
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from collections import Counter
from typing import Any, Callable, ContextManager, Optional

import torch

logger = logging.getLogger("xirang_ds")


def pinned_block(nbytes: int) -> int:
    """The block torch's caching host allocator pins for a request of ``nbytes``: the next power of two."""
    return 1 << max(int(nbytes) - 1, 0).bit_length()


def block_bytes(nbytes: int, pinned: bool) -> int:
    """What a host buffer of ``nbytes`` holds: its pinned block, or its own bytes."""
    return pinned_block(nbytes) if pinned else int(nbytes)


def pins(on_accelerator: bool, profile: Any = None) -> bool:
    """Whether host tiers pin their buffers in a run on an accelerator, or in an estimate priced by a GPU's
    ``profile`` (`xirang_ds.memory.device_profile.DeviceProfile`)."""
    return on_accelerator or bool(profile is not None and profile.accelerator)


class HostLedger:
    """The host bytes this process's host tiers hold (module docstring).

    Attributes:
        budget_bytes: ``host_memory_budget`` in bytes (``None``: no cap).
        held_bytes: what the host holds for the tiers: pinned blocks in use or cached, plain bytes in use.
        in_use_bytes: bytes of blocks (pinned) or buffers (plain) alive now.
        high_water_bytes: the most ``held_bytes`` seen.
        by_tier: ``held_bytes`` by the tier that first made each block (pinned) or buffer (plain).
        over_budget: tiers that went over the budget (each said so once).
    """

    def __init__(self, budget_bytes: Optional[int] = None):
        self.budget_bytes = budget_bytes
        self.held_bytes = 0
        self.in_use_bytes = 0
        self.high_water_bytes = 0
        self.by_tier: Counter = Counter()
        self.over_budget: set[str] = set()
        self._cached: Counter = Counter()  # pinned block size -> blocks the allocator keeps free

    def cost(self, nbytes: int, pinned: bool) -> int:
        """What a new buffer of ``nbytes`` adds to ``held_bytes``: nothing where a cached block of its size is
        free, else its block (pinned) or its bytes (plain)."""
        block = block_bytes(nbytes, pinned)
        return 0 if pinned and self._cached[block] else block

    def fits(self, nbytes: int, pinned: bool) -> bool:
        """Whether a new buffer of ``nbytes`` keeps ``held_bytes`` within ``budget_bytes``."""
        return self.budget_bytes is None or self.held_bytes + self.cost(nbytes, pinned) <= self.budget_bytes

    def buffer(self, shape: torch.Size, dtype: torch.dtype, pin: bool, tier: str,
               host_tier: Optional[Callable[[], ContextManager]] = None) -> torch.Tensor:
        """A new host buffer (pinned through the accelerator with ``pin``), made inside ``host_tier`` (the
        tracker's host-tier context) and counted for ``tier``."""
        with (host_tier or contextlib.nullcontext)():
            out = torch.empty(shape, dtype=dtype, device="cpu")
            if pin:
                from deepspeed.accelerator import get_accelerator

                out = get_accelerator().pin_memory(out)
        self.account(out, pin, tier)
        return out

    def account(self, t: torch.Tensor, pinned: bool, tier: str) -> None:
        """Count the host buffer ``t`` (made elsewhere) until its storage is freed."""
        nbytes = t.untyped_storage().nbytes()
        size = pinned_block(nbytes) if pinned else nbytes
        if pinned and self._cached[size]:
            self._cached[size] -= 1
        else:
            self.held_bytes += size
            self.by_tier[tier] += size
        self.in_use_bytes += size
        self.high_water_bytes = max(self.high_water_bytes, self.held_bytes)
        weakref.finalize(t.untyped_storage(), self._freed, size, pinned, tier)
        if self.budget_bytes is not None and self.held_bytes > self.budget_bytes and tier not in self.over_budget:
            self.over_budget.add(tier)
            logger.warning("host_memory_budget: %s took the host tiers to %s bytes held, over the budget of %s "
                           "(%s); raise xirang.host_memory_budget, or give the device more room so that it "
                           "keeps them", tier, f"{self.held_bytes:,}", f"{self.budget_bytes:,}",
                           ", ".join(f"{k} {v:,}" for k, v in sorted(self.by_tier.items())))

    def _freed(self, size: int, pinned: bool, tier: str) -> None:
        self.in_use_bytes -= size
        if pinned:  # the allocator keeps the block for the next request of its size
            self._cached[size] += 1
        else:
            self.held_bytes -= size
            self.by_tier[tier] -= size

    def figures(self) -> dict:
        """The ledger as plain data (the bench's figures); on CUDA with torch's own count beside it
        (``allocator_held_bytes``: every pinned block the process holds, its other users' included)."""
        out = {"held_bytes": self.held_bytes, "in_use_bytes": self.in_use_bytes,
               "high_water_bytes": self.high_water_bytes, "budget_bytes": self.budget_bytes,
               "by_tier": {k: v for k, v in sorted(self.by_tier.items()) if v},
               "cached_blocks": {str(k): v for k, v in sorted(self._cached.items()) if v}}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["allocator_held_bytes"] = torch.cuda.host_memory_stats().get("allocated_bytes.current")
        return out


_LEDGER = HostLedger()


def ledger() -> HostLedger:
    """This process's ledger (one host allocator per process)."""
    return _LEDGER


__all__ = ["HostLedger", "ledger", "pinned_block"]
