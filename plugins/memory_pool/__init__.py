"""The ``memory_pool`` plugin: one reservation serving other plugins' tensors (`xirang_ds.memory.pool`).

Clients find the pool through ``session.pool()`` (``None`` when the section is off) at their own
``attach``; this plugin's order (25) puts it before them:

* activations (30): the plain allocations of compressed payloads (``PayloadStorage.allocator``),
  transient blocks; a storage provider that lends memory (comm_buffers) is still asked first;
* optimizer_states (40): the codes and scales of int8/int4 states, persistent blocks.

A client calls `MemoryPoolPlugin.add_client` to declare the persistent bytes it will hold at once
and, if its requests are not representative yet (the activations planner profiling), when it is.

``size: auto``: until the end of the first optimizer step that began with every client ready,
requests are plain allocations and only measured; then one reservation is made of the most
transient bytes live at once plus the declared persistent bytes, and clients move their warm-up
blocks in (``MemoryPool.on_reserved``). A fixed ``size`` is reserved at attach.

Memory accounting: the reservation is one storage, counted once in the tracker's ``memory_pool``
category (it outranks the roles its views would give it; see `xirang_ds.memory.categories`);
fallback allocations are ordinary storages with their ordinary roles.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from xirang_ds.config.types import format_bytes
from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import MEMORY_POOL
from xirang_ds.memory.pool import MemoryPool, PoolTooSmall, align_up
from xirang_ds.plugins.memory_pool.config import MemoryPoolConfig
from xirang_ds.registry import SHARED_POOL, Plugin, register_plugin

logger = logging.getLogger("xirang_ds")


@register_plugin(MemoryPoolConfig, section="memory_pool", order=25,
                 summary="Pooled allocation for plugin tensors.")
class MemoryPoolPlugin(Plugin):
    """Owns the `MemoryPool` of the run (see the module docstring). Under Megatron-core it attaches to
    the integration's ``MegatronRun`` the same way (its ``step`` is Megatron's ``optimizer.step()``).

    Attributes:
        pool: the pool once attached, else ``None``.
        declared_bytes: persistent bytes clients said they will hold at once.
    """

    provides = frozenset({SHARED_POOL})
    time_neutral = True  # where the bytes live, not what runs (the predicted step counts bytes, not buckets)

    frameworks = ("deepspeed", "megatron")
    preset_frameworks = ("deepspeed",)
    """Presets leave it off under Megatron: its benefit is the CUDA allocator's fragmentation, not
    measured there (no GPU); on CPU it only holds its region all step. Named in the block it runs."""

    def __init__(self, config: MemoryPoolConfig, session: Any):
        super().__init__(config, session)
        self.pool: Optional[MemoryPool] = None
        self.declared_bytes = 0
        self._ready: list[Callable[[], bool]] = []
        self._steady: Optional[bool] = None
        self._engine: Any = None

    def attach(self, engine: Any) -> None:
        self._engine = engine
        size = None if self.config.size == "auto" else int(self.config.size)
        self.pool = MemoryPool(torch.device(engine.device), size, self.config.use_torch_mempool)
        self.pool.on_reserved.append(self._on_reserved)
        self.keep(self.session.add_memory_roles(self._roles))
        self.keep(wrap_method(engine, "step", self._step))
        if size is not None:
            self._on_reserved(self.pool)

    def add_client(self, name: str, persistent_bytes: int = 0, largest_bytes: int = 0,
                   ready: Optional[Callable[[], bool]] = None) -> None:
        """Declare a client of the pool.

        Args:
            name: the client's section (for messages).
            persistent_bytes: the most persistent bytes it will hold at once (``auto`` reserves them).
            largest_bytes: its largest single persistent block (a fixed ``size`` must hold it).
            ready: returns True once its requests are those of every later step.

        Raises:
            PoolTooSmall: a fixed ``size`` is smaller than ``largest_bytes``.
        """
        self.declared_bytes += align_up(persistent_bytes)
        if ready is not None:
            self._ready.append(ready)
        if self.pool is not None and not self.pool.warmup and largest_bytes > self.pool.size:
            raise PoolTooSmall(align_up(largest_bytes), self.pool.size, f"{name} (its largest tensor)")

    # ------------------------------------------------------------------------------------------
    def _roles(self) -> list:
        buf = self.pool.buffer if self.pool is not None else None
        return [(MEMORY_POOL, [buf] if buf is not None else [])]

    def _on_reserved(self, pool: MemoryPool) -> None:
        tracker = self.session.tracker
        if pool.buffer is not None and tracker.active:  # else the role provider marks it when tracking starts
            tracker.mark([pool.buffer], MEMORY_POOL)
        if getattr(self._engine, "global_rank", 0) != 0:
            return
        if pool.size:
            logger.info("xirang memory_pool: reserved %s on %s%s", format_bytes(pool.size), pool.device,
                        " (torch.cuda.MemPool)" if pool.mempool is not None else "")
        else:
            logger.info("xirang memory_pool: the warm-up made no pooled request; nothing reserved (later "
                        "requests are plain allocations, counted as fallbacks)")

    def _step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        engine = self._engine
        if self._steady is None:  # the first step: steady when every client is ready already
            self._steady = all(r() for r in self._ready)
        before = engine.global_steps
        result = original(*args, **kwargs)
        if engine.global_steps != before:
            if self.pool.warmup and self._steady:
                self.pool.reserve_measured(self.declared_bytes)
            self.pool.end_step()
            self._steady = all(r() for r in self._ready)
        return result

    def remove(self) -> None:
        """Stop serving; later requests are plain allocations (live blocks stay valid)."""
        super().remove()
        if self.pool is not None:
            self.pool.close()

    # ------------------------------------------------------------------------------------------
    def adjust_estimate(self, phases: dict, shape: Any, numels: list) -> Optional[dict]:
        """``size: auto`` reserves what its clients requested during the warm-up, and they move those
        blocks in: the bytes their own models count (optimizer_states' codes and scales, which it
        models; compressed activations, which the activations plugin models only when it keeps
        everything, with nothing to pool). A fixed ``size`` is held whatever the clients use: not
        modelled."""
        return phases if self.config.size == "auto" else None

    def describe(self) -> str:
        if self.pool is None:
            return "not attached"
        s = self.pool.stats()
        if self.pool.warmup:
            return f"measuring (size auto): {s['warmup_allocations']} plain allocation(s) so far"
        return (f"{format_bytes(s['reserved_bytes'])} reserved, {format_bytes(s['in_use_bytes'])} in use "
                f"({format_bytes(s['persistent_bytes'])} persistent), high-water {format_bytes(s['high_water_bytes'])}; "
                f"{s['pooled_allocations']} pooled, {s['fallbacks']} fallback allocation(s)")

    def figures(self) -> dict:
        """The pool's `MemoryPool.stats` (reserved, in use, high-water, pooled and fallback counts)."""
        return self.pool.stats() if self.pool is not None else {}

    def state_dict(self) -> dict:
        """The reserved size, so a resumed ``auto`` run reserves at once instead of measuring again."""
        return {"reserved_bytes": self.pool.size if self.pool is not None and not self.pool.warmup else None}

    def load_state_dict(self, state: dict) -> None:
        size = state.get("reserved_bytes")
        if self.pool is not None and self.pool.warmup and size is not None:
            self.pool.reserve(int(size))
