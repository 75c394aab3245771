"""`MemoryReport`: this rank's device-memory peak and what it was made of, as ``engine.xirang.memory()``
returns it to a user's own script."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from xirang_ds.memory.categories import DEVICE_CATEGORIES, HOST
from xirang_ds.memory.window import PeakReport


@dataclass(frozen=True)
class MemoryReport:
    """This rank's highest device memory over the optimizer steps measured so far.

    Attributes:
        peak_bytes: device bytes live at the peak.
        by_category: device bytes per category at the peak (``parameters``, ``gradients``,
            ``optimizer_states``, ``activations``, ``comm_buffers``, ``memory_pool``, ``temporaries``);
            they add up to ``peak_bytes``. Empty where only the allocator's peak counter is read (CUDA).
        host_bytes: bytes the plugins held in host memory at that moment (offloaded activations or states;
            not part of ``peak_bytes``).
        phase: ``forward``, ``backward`` or ``optimizer_step`` where it is known, else ``""``.
        step: the optimizer step whose window held the peak (0: before the first check).
        budget_bytes: the monitor's per-rank budget (``xirang.memory_budget``).
    """

    peak_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    phase: str = ""
    step: int = 0
    budget_bytes: int = 0

    @classmethod
    def of(cls, peak_bytes: int, report: Optional[PeakReport], step: int, budget_bytes: int) -> "MemoryReport":
        """From a window's peak and, where the tracker measured it, its breakdown."""
        if report is None:
            return cls(peak_bytes, step=step, budget_bytes=budget_bytes)
        return cls(peak_bytes, {c: report.by_category.get(c, 0) for c in DEVICE_CATEGORIES},
                   report.by_category.get(HOST, 0), report.phase, step, budget_bytes)

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "by_category": dict(self.by_category), "host_bytes": self.host_bytes,
                "phase": self.phase, "step": self.step, "budget_bytes": self.budget_bytes}


__all__ = ["MemoryReport"]
