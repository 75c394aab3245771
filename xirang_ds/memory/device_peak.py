"""One owner of an accelerator's peak counter (``max_memory_allocated``), read through windows.

The caching allocator keeps one peak per device and process, and ``reset_peak_memory_stats`` clears
it for everybody: a monitor that resets it after every step leaves the bench reading the resting
memory, and a reader that never resets reads an all-time peak. Here nobody resets the counter but
the owner, and it folds the counter into every open window before it does, so each window's peak is
the highest allocation since that window opened (or was last reset), whoever else reads:

    window = device_peak(accel).open()      # the monitor, the bench, comm_buffers, the planner
    ...
    window.peak_bytes                       # max(what was folded in, the counter now)
    window.reset()                          # restarts this window only

On CPU the live-storage tracker's windows (`MemoryTracker.open_window`) do the same with exact bytes;
`xirang_ds.session.Session.open_peak_window` returns whichever of the two applies.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol


class PeakCounter(Protocol):
    """What DeepSpeed's accelerator (and ``torch.cuda``) offer for the allocator's figures."""

    def memory_allocated(self) -> int: ...

    def max_memory_allocated(self) -> int: ...

    def reset_peak_memory_stats(self) -> None: ...


class DevicePeakWindow:
    """The highest device allocation since `open` or the last `reset` of this window."""

    def __init__(self, owner: "DevicePeak"):
        self._owner = owner
        self._folded = 0
        self.baseline_bytes = 0
        """Bytes allocated when the window began (as the tracker's `Window` has it)."""
        self.closed = False

    @property
    def peak_bytes(self) -> int:
        return max(self._folded, int(self._owner.counter.max_memory_allocated()))

    @property
    def live_bytes(self) -> int:
        """Bytes allocated now."""
        return int(self._owner.counter.memory_allocated())

    def reset(self) -> None:
        """Restart this window from what is allocated now; other windows keep their peaks."""
        self._owner._restart(self)

    def close(self) -> None:
        self._owner._close(self)


class DevicePeak:
    """The owner of one accelerator's peak counter; `device_peak` returns the process's one."""

    def __init__(self, counter: PeakCounter):
        self.counter = counter
        self._windows: "weakref.WeakSet[DevicePeakWindow]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self.resets = 0
        """How many times the counter was reset (one per window opened or reset)."""

    def open(self) -> DevicePeakWindow:
        """A window starting now."""
        window = DevicePeakWindow(self)
        self._restart(window)
        return window

    def _restart(self, window: DevicePeakWindow) -> None:
        with self._lock:
            current = int(self.counter.max_memory_allocated())
            for other in self._windows:  # everything up to now stays in the other windows' peaks
                other._folded = max(other._folded, current)
            self.counter.reset_peak_memory_stats()
            self.resets += 1
            window._folded = window.baseline_bytes = int(self.counter.memory_allocated())
            self._windows.add(window)

    def _close(self, window: DevicePeakWindow) -> None:
        with self._lock:
            window.closed = True
            self._windows.discard(window)


_OWNERS: dict[str, DevicePeak] = {}
_OWNERS_LOCK = threading.Lock()


def device_peak(accelerator: Any = None) -> DevicePeak:
    """The process's owner of the accelerator's peak counter (DeepSpeed's ``get_accelerator()`` by
    default). The counter is per process and device, so its owner is too: one per device name.

    Raises:
        ValueError: the accelerator is the CPU, which has no allocator peak (use the tracker's windows).
    """
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
    name = accelerator.current_device_name() if hasattr(accelerator, "current_device_name") else "device"
    if str(name).startswith("cpu"):
        raise ValueError("the CPU has no allocator peak counter; open a window on the live-storage tracker")
    with _OWNERS_LOCK:
        owner = _OWNERS.get(str(name))
        if owner is None:
            owner = _OWNERS[str(name)] = DevicePeak(accelerator)
        return owner


__all__ = ["DevicePeak", "DevicePeakWindow", "PeakCounter", "device_peak"]
