"""Measurement windows over a tracker's records: a peak, its phase and breakdown, from a start point.

The monitor, the profiler and the bench each keep a window of their own (`MemoryTracker.open_window`),
so one resetting its peak does not disturb the others; the tracker raises every open window's peak as it
counts an allocation. `PeakReport` is a window's state at its peak.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xirang_ds.memory.categories import CATEGORIES, DEVICE_CATEGORIES, HOST
from xirang_ds.memory.storages import Record


@dataclass
class PeakReport:
    """The state of memory at the peak of a measurement window.

    Attributes:
        peak_bytes: device bytes live at the peak.
        by_category: device bytes per category at the peak (``host`` holds host-tier bytes).
        phase: phase in which the peak happened.
        phase_peaks: highest live device bytes in each phase.
        top: the largest live records at the peak.
        baseline_bytes: device bytes live when the window began.
    """

    peak_bytes: int
    by_category: dict[str, int]
    phase: str
    phase_peaks: dict[str, int]
    top: list[Record] = field(default_factory=list)
    baseline_bytes: int = 0

    def as_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "peak_by_category": dict(self.by_category),
            "peak_phase": self.phase,
            "phase_peaks": dict(self.phase_peaks),
            "baseline_bytes": self.baseline_bytes,
            "top_tensors": [
                {"nbytes": r.nbytes, "category": r.resolved_category(), "shape": list(r.shape),
                 "dtype": r.dtype, "module": r.module, "node": r.node, "op": r.op, "phase": r.phase}
                for r in self.top
            ],
        }


class Window:
    """Peak bookkeeping from a start point: bytes, phase, per-phase peaks (see `open_window`)."""

    def __init__(self, tracker: MemoryTracker):
        self.tracker = tracker
        self.reset()

    @property
    def live_bytes(self) -> int:
        """Bytes the tracker counts live now."""
        return self.tracker.live_bytes

    def reset(self) -> None:
        t = self.tracker
        with t._lock:
            self.start_clock = t.clock
            self.baseline_bytes = t.live_bytes
            self.peak_bytes = t.live_bytes
            self.besides_activations_peak = t.live_bytes - t.activations_live
            """The most device bytes live at once besides those of category ``activations`` (the
            activation planner's peak of everything else)."""
            self.peak_clock = t.clock
            self.peak_phase = t.phase
            self.phase_peaks: dict[str, int] = {}
            self.phase_peak_clocks: dict[str, int] = {}
            """The event clock of each phase's peak (`phase_peaks`)."""
            if t._windows:
                t._prune()

    @property
    def phases(self) -> list[tuple[int, str]]:
        """Phase changes seen in this window, starting with the phase at its start."""
        log = self.tracker.phase_log
        before = [p for p in log if p[0] <= self.start_clock]
        first = (self.start_clock, before[-1][1] if before else self.tracker.phase)
        return [first] + [p for p in log if p[0] > self.start_clock]

    def report(self, top: int = 10) -> PeakReport:
        """The window's peak with its breakdown by category, its phase and the largest tensors."""
        t = self.tracker
        at_peak = t.live_records(self.peak_clock)
        device = sorted((r for r in at_peak if not r.host), key=lambda r: r.nbytes, reverse=True)
        return PeakReport(peak_bytes=self.peak_bytes, by_category=t.by_category(at_peak), phase=self.peak_phase,
                          phase_peaks=dict(self.phase_peaks), top=device[:top], baseline_bytes=self.baseline_bytes)

    def category_peaks(self) -> dict[str, int]:
        """The highest live bytes of each category over the window, each at its own moment (the
        activations peak at the end of forward while the overall peak may be in the optimizer step);
        ``host`` holds the host tier's highest."""
        t = self.tracker
        live = {c: 0 for c in CATEGORIES}
        events = []
        with t._lock:
            for r in t.records:
                if r.freed is not None and r.freed <= self.start_clock:
                    continue
                c = HOST if r.host else r.resolved_category()
                if r.created <= self.start_clock:
                    live[c] += r.nbytes
                else:
                    events.append((r.created, r.nbytes, c))
                if r.freed is not None:
                    events.append((r.freed, -r.nbytes, c))
        peaks = dict(live)
        for _, delta, c in sorted(events):  # every allocation and free has its own clock value
            live[c] += delta
            if live[c] > peaks[c]:
                peaks[c] = live[c]
        return peaks

    def most_at_once(self) -> dict[str, int]:
        """Per device category, the most bytes of it alive at the same time in this window.

        The breakdown at the peak (`report`) shows each category at one moment; a category can be
        larger at another (gradients at the end of backward while the peak is at its start).
        Categories are resolved as they are now (roles given after creation count). The device
        part of `category_peaks`.
        """
        peaks = self.category_peaks()
        return {c: peaks[c] for c in DEVICE_CATEGORIES}

    def close(self) -> None:
        self.tracker.close_window(self)
