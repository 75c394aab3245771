"""Exact device-memory tracker: every live storage, its size, its category and its lifetime.

A ``TorchDispatchMode`` (`xirang_ds.memory.dispatch`) sees every tensor an op returns; each new storage
of the tracked device type gets a `Record` and a ``weakref.finalize`` that closes it when the storage
dies. Storages are keyed by their C++ ``StorageImpl`` (``_cdata``), so views (ZeRO's parameters are views
of one flat buffer) count once (`xirang_ds.memory.storages`). Tensors that existed before tracking
started are seeded explicitly. Peaks are kept per measurement window (`xirang_ds.memory.window`).

On CPU this is the measurement (DESIGN.md §4): the same step gives the same peak to the byte, run
after run. On CUDA the same records give categories, and `allocator_stats` adds the caching
allocator's own figures (allocated, reserved, fragmentation).

Categories (`categories.py`): a record's category is the strongest role anyone gave it
(`mark`, `scope`, `seed`). Without a role, a storage created in forward and still alive when
forward ends is an activation; everything else is a temporary.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from xirang_ds.compat.torch import (
    current_autograd_node,
    current_dispatch_mode,
    dispatch_mode_stack,
    is_traceable_wrapper_subclass,
    pop_mode_temporarily,
    storage_key,
)
from xirang_ds.memory.categories import ACTIVATIONS, CATEGORIES, HOST, PRIORITY
from xirang_ds.memory.dispatch import TrackingMode, returns_alias
from xirang_ds.memory.storages import SUBALLOCATIONS, Record, inner_tensors, storage_of, tensors_in
from xirang_ds.memory.window import PeakReport, Window

PHASES = ("setup", "forward", "backward", "optimizer_step", "idle")


class MemoryTracker:
    """Live-storage memory tracker with categories, phases and per-tensor records.

    Args:
        device_type: the device type whose memory is measured (``"cpu"``, ``"cuda"``); default:
            DeepSpeed's accelerator if deepspeed is imported, else CUDA if available, else CPU.
        record_uses: also record each storage's last use (for timelines; costs more per op).
        fake: track ``FakeTensor`` storages (the estimator traces a step without memory).

    Example:
        >>> tracker = MemoryTracker("cpu")
        >>> with tracker:
        ...     x = torch.empty(1024)          # 4096 bytes
        ...     y = torch.empty(256)
        >>> tracker.peak_bytes
        5120
    """

    def __init__(self, device_type: Optional[str] = None, record_uses: bool = False, fake: bool = False):
        self.device_type = device_type or default_device_type()
        self.record_uses = record_uses
        self.record_backward_uses = False
        """Record, for each storage an op reads in backward, the clock at which the autograd node running that op
        started (`Record.backward_uses`): when a saved tensor brought back on demand comes back (its node unpacks
        it as it starts), on the estimator's fake trace (`layer_temporaries.timeline`)."""
        self._node_running: Any = None
        self._node_start = 0
        self.fake = fake
        self.on_op: Optional[Callable[[Any, tuple, dict, Any], None]] = None
        """Called with every op the tracker sees, after it ran (``(func, args, kwargs, out)``): the fake
        trace's op tally (`xirang_ds.memory.device_profile.OpTally`)."""
        self._lock = threading.RLock()
        self._serial = itertools.count()
        self.clock = 0
        self._live: dict[int, Record] = {}  # StorageImpl address -> record
        self._finalizers: dict[int, Any] = {}
        self.records: list[Record] = []  # every record of the current window (alive or freed)
        self.live_bytes = 0
        self.host_bytes = 0
        self.activations_live = 0
        """Live device bytes whose category is ``activations`` now (given by a scope, a seed or a mark)."""
        self.phase = "setup"
        self.module_stack: list[str] = []
        self._scopes: list[str] = []
        self._host_depth = 0
        self._forward_start_serial: Optional[int] = None
        self._mode: Optional[TrackingMode] = None
        self._handles: list[Any] = []
        self.phase_log: list[tuple[int, str]] = [(0, "setup")]
        self._windows: list[Window] = []
        self.default = self.open_window()
        self.limit: Optional[int] = None
        """A hard cap on live device bytes (``monitor.enforce_budget``): an op whose new storage would
        take ``live_bytes`` past it raises ``torch.OutOfMemoryError``, as the caching allocator does
        when the device is full; the storage is never counted. None: no cap."""

    # ----------------------------------------------------------------------------------------
    # lifecycle
    def start(self) -> "MemoryTracker":
        """Begin tracking (enter the dispatch mode on this thread)."""
        if self._mode is None:
            self._mode = TrackingMode(self)
            self._mode.__enter__()
        return self

    def stop(self) -> None:
        """Stop tracking and remove the hooks this tracker installed."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        while self._handles:
            self._handles.pop().remove()

    @property
    def active(self) -> bool:
        return self._mode is not None

    @property
    def measuring(self) -> bool:
        """Started and not `paused`: what runs now is measured (another mode may sit above the tracker's)."""
        return self._mode is not None and any(m is self._mode for m in dispatch_mode_stack())

    def __enter__(self) -> "MemoryTracker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run a block untracked (the tracker's own bookkeeping, reports)."""
        if self._mode is None:
            yield
            return
        with pop_mode_temporarily():
            yield

    @contextlib.contextmanager
    def resumed(self) -> Iterator[None]:
        """Track a block run inside `paused` (what a compiled region's saved-tensor hooks allocate)."""
        if self._mode is None or current_dispatch_mode() is self._mode:
            yield
            return
        with self._mode:
            yield

    # ----------------------------------------------------------------------------------------
    # seeing storages
    def _key_and_storage(self, t: torch.Tensor):
        if t.device.type != self.device_type:
            return None, None
        st = storage_of(t)
        if st is None or (st.nbytes() == 0 if self.fake else st.data_ptr() == 0):
            return None, None
        return storage_key(st), st

    def _see(self, t: torch.Tensor, func: Any, category: Optional[str] = None, new: bool = True) -> Optional[Record]:
        if is_traceable_wrapper_subclass(t):  # torchao's quantized states, DTensor: the bytes are inside
            for inner in inner_tensors(t):
                self._see(inner, func, category, new)
            return None
        key, st = self._key_and_storage(t)
        if key is None:
            return None
        with self._lock:
            rec = self._live.get(key)
            if rec is None and not new:
                return None
            nbytes = st.nbytes()
            ptr = 0 if self.fake else st.data_ptr()
            if rec is not None:
                if rec.nbytes != nbytes or rec.ptr != ptr:  # resized in place
                    self._close(key)
                    rec = None
                else:
                    if category:
                        self._set_category(rec, category)
                    return rec
            host = self._host_depth > 0 or category == HOST
            if (self.limit is not None and func is not None and not host
                    and self.live_bytes + nbytes > self.limit):  # ops allocate; seeds only name what exists
                raise torch.OutOfMemoryError(
                    f"xirang: {func} tried to allocate {nbytes:,} bytes with {self.live_bytes:,} of the enforced "
                    f"memory budget {self.limit:,} in use (xirang.monitor.enforce_budget)")
            self.clock += 1
            scope = self._scopes[-1] if self._scopes else None
            rec = Record(serial=next(self._serial), nbytes=nbytes, created=self.clock, phase=self.phase,
                         category=HOST if host else (category or scope),
                         module=self.module_stack[-1] if self.module_stack else "", node=self._node(),
                         op=str(func) if func is not None else "seed", shape=tuple(t.shape),
                         dtype=str(t.dtype).replace("torch.", ""), ptr=ptr, host=host)
            self._live[key] = rec
            self.records.append(rec)
            self._finalizers[key] = weakref.finalize(st, self._on_free, key, rec.serial)
            if host:
                self.host_bytes += nbytes
            else:
                self.live_bytes += nbytes
                if rec.category == ACTIVATIONS:
                    self.activations_live += nbytes
                self._after_alloc()
            return rec

    def _node(self) -> str:
        """The autograd node running now (backward), else ``""``."""
        if self.phase == "backward":
            node = current_autograd_node()
            if node is not None:
                return node.name()
        return ""

    def _on_free(self, key: int, serial: int) -> None:
        with self._lock:
            rec = self._live.get(key)
            if rec is not None and rec.serial == serial:
                self._close(key)

    def _close(self, key: int) -> None:
        rec = self._live.pop(key)
        fin = self._finalizers.pop(key, None)
        if fin is not None:
            fin.detach()
        self.clock += 1
        rec.freed = self.clock
        if rec.host:
            self.host_bytes -= rec.nbytes
        else:
            self.live_bytes -= rec.nbytes
            if rec.category == ACTIVATIONS:
                self.activations_live -= rec.nbytes

    def _use(self, args: Any, kwargs: Any) -> None:
        clock = self.clock
        start = None
        if self.record_backward_uses and self.phase == "backward":
            node = current_autograd_node()  # the same object for all of one node's ops
            if node is not self._node_running:
                self._node_running, self._node_start = node, clock
            start = self._node_start
        for a in itertools.chain(args, (kwargs or {}).values()):
            items = a if isinstance(a, (list, tuple)) else (a,)
            for t in items:
                if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                    st = storage_of(t)
                    if st is not None:
                        rec = self._live.get(storage_key(st))
                        if rec is not None:
                            rec.last_used = clock
                            if start is not None:
                                if rec.backward_uses is None:
                                    rec.backward_uses = [start]
                                elif rec.backward_uses[-1] != start:
                                    rec.backward_uses.append(start)

    def _after_alloc(self) -> None:
        live, clock, phase = self.live_bytes, self.clock, self.phase
        besides = live - self.activations_live
        for w in self._windows:
            if besides > w.besides_activations_peak:
                w.besides_activations_peak = besides
            if live > w.phase_peaks.get(phase, 0):
                w.phase_peaks[phase] = live
                w.phase_peak_clocks[phase] = clock
            if live > w.peak_bytes:
                w.peak_bytes, w.peak_clock, w.peak_phase = live, clock, phase

    # ----------------------------------------------------------------------------------------
    # roles
    def _set_category(self, rec: Record, category: str) -> None:
        if rec.category is None or PRIORITY[category] > PRIORITY[rec.category]:
            was = not rec.host and rec.category == ACTIVATIONS
            if category == HOST and not rec.host:
                rec.host = True
                self.live_bytes -= rec.nbytes
                self.host_bytes += rec.nbytes
            rec.category = category
            self.activations_live += rec.nbytes * ((not rec.host and category == ACTIVATIONS) - was)

    def seed(self, tensors: Iterable[Any], category: str) -> int:
        """Register tensors that existed before tracking (or mark them if already seen).

        Returns the bytes newly registered (storages already known count zero).
        """
        added = 0
        for t in tensors_in(tensors):
            before = self.live_bytes + self.host_bytes
            self._see(t, None, category)
            added += self.live_bytes + self.host_bytes - before
        return added

    def mark(self, tensors: Iterable[Any], category: str) -> None:
        """Give the storages of ``tensors`` a role (the strongest role wins, see PRIORITY)."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; one of {CATEGORIES}")
        for t in tensors_in(tensors):
            key, st = self._key_and_storage(t)
            if key is None:
                continue
            rec = self._live.get(key)
            if rec is None:
                self._see(t, None, category)
            else:
                self._set_category(rec, category)

    @contextlib.contextmanager
    def scope(self, category: str) -> Iterator[None]:
        """Storages created inside the block get ``category`` (e.g. recomputed activations)."""
        self._scopes.append(category)
        try:
            yield
        finally:
            self._scopes.pop()

    def is_host(self, t: torch.Tensor) -> Optional[bool]:
        """Whether ``t``'s storage is host tier (``None``: the tracker does not know it)."""
        key, _ = self._key_and_storage(t)
        rec = self._live.get(key) if key is not None else None
        return None if rec is None else rec.host

    def category_of(self, t: torch.Tensor) -> Optional[str]:
        """The category of ``t``'s storage (``host`` for the host tier; ``None``: not tracked)."""
        key, _ = self._key_and_storage(t)
        rec = self._live.get(key) if key is not None else None
        return None if rec is None else (HOST if rec.host else rec.resolved_category())

    @property
    def scope_category(self) -> Optional[str]:
        """The category of the innermost `scope` open now (``None`` outside any)."""
        return self._scopes[-1] if self._scopes else None

    @contextlib.contextmanager
    def host_tier(self) -> Iterator[None]:
        """Storages created inside the block are host tier: counted as ``host``, not device.

        Plugins that move tensors off the device create the host copies inside this block; on CPU
        the host tier is accounted, not physically separate.
        """
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    # ----------------------------------------------------------------------------------------
    # phases and windows
    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase_log.append((self.clock, phase))
            if len(self.phase_log) > 4096:  # keep what open windows can see
                oldest = min(w.start_clock for w in self._windows)
                self.phase_log = [p for p in self.phase_log if p[0] >= oldest] or self.phase_log[-1:]
        if self.phase == "backward" and phase != "backward":
            self._node_running = None  # no autograd node held past its backward
        if phase == "forward" and self.phase != "forward":
            self._forward_start_serial = next(self._serial)
        elif self.phase == "forward" and phase != "forward":
            self._end_forward()
        self.phase = phase

    def _end_forward(self) -> None:
        """Storages created in this forward and still alive are activations unless marked."""
        start = self._forward_start_serial
        if start is None:
            return
        for rec in reversed(self.records):
            if rec.serial < start:
                break
            if rec.freed is None and rec.category is None and rec.phase == "forward":
                rec.category = ACTIVATIONS
        self._forward_start_serial = None

    def live_by_category(self) -> dict[str, int]:
        """Bytes live now per category (host-tier storages under ``host``)."""
        out: dict[str, int] = {}
        for rec in self._live.values():
            category = HOST if rec.host else rec.resolved_category()
            out[category] = out.get(category, 0) + rec.nbytes
        return out

    def open_window(self) -> "Window":
        """An independent measurement window starting now (the monitor, the profiler and the bench
        each keep one, so one resetting its peak does not disturb the others)."""
        with self._lock:
            w = Window(self)
            self._windows.append(w)
            return w

    def close_window(self, window: "Window") -> None:
        with self._lock:
            if window in self._windows and window is not self.default:
                self._windows.remove(window)
            self._prune()

    def _prune(self) -> None:
        """Forget freed records no open window can still see."""
        oldest = min(w.start_clock for w in self._windows)
        self.records = [r for r in self.records if r.freed is None or r.freed > oldest]

    def reset_peak(self) -> None:
        """Restart the default window: its peak restarts from what is live now."""
        self.default.reset()

    # the default window's figures
    @property
    def peak_bytes(self) -> int:
        return self.default.peak_bytes

    @property
    def peak_clock(self) -> int:
        return self.default.peak_clock

    @property
    def peak_phase(self) -> str:
        return self.default.peak_phase

    @property
    def phase_peaks(self) -> dict[str, int]:
        return self.default.phase_peaks

    @property
    def window_start_clock(self) -> int:
        return self.default.start_clock

    @property
    def baseline_bytes(self) -> int:
        return self.default.baseline_bytes

    def report(self, top: int = 10) -> "PeakReport":
        """Peak of the default window with its breakdown, phase and largest tensors."""
        return self.default.report(top)

    def live_records(self, at: Optional[int] = None) -> list[Record]:
        """Records alive at event clock ``at`` (default: now)."""
        if at is None:
            return list(self._live.values())
        return [r for r in self.records if r.created <= at and (r.freed is None or r.freed > at)]

    def by_category(self, records: Iterable[Record]) -> dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for r in records:
            out[HOST if r.host else r.resolved_category()] += r.nbytes
        return out

    # ----------------------------------------------------------------------------------------
    # module attribution
    def watch_module(self, model: torch.nn.Module) -> None:
        """Name the module that creates each storage in forward (costs two hooks per module)."""
        stack = self.module_stack

        def enter(label: str):
            def hook(module, args) -> None:
                stack.append(label)
            return hook

        def leave(module, args, output) -> None:
            if stack:
                stack.pop()

        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(enter(name or type(module).__name__)))
            self._handles.append(module.register_forward_hook(leave))


def default_device_type() -> str:
    """The device type memory is measured on: DeepSpeed's accelerator when loaded, else CUDA/CPU."""
    import sys

    if "deepspeed" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
        return "cpu" if name == "cpu" else torch.device(name).type
    return "cuda" if torch.cuda.is_available() else "cpu"


# The moved names stay importable from here (`xirang_ds.memory.pool` fills ``SUBALLOCATIONS``; the
# activations plugin's profile reads ``returns_alias``; the estimator's trace walks outputs with ``tensors_in``).
__all__ = ["PHASES", "SUBALLOCATIONS", "MemoryTracker", "PeakReport", "Record", "Window", "returns_alias", "tensors_in",
           "default_device_type"]
