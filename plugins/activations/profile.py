"""Profiling passes: what each candidate module saves for backward, what its ops cost, and what
each option would make of it.

During a profiling pass (the first ``profile_steps`` forward/backward passes of training):

* one `PackContext` around the whole forward sees every tensor saved for backward; it attributes
  each storage to every candidate module running at that moment (``blocks.3`` and
  ``blocks.3.mlp``), once per module call, and counts the bytes of storages it could pack
  (eligible) and of the small ones it leaves;
* a ``TorchDispatchMode`` counts every op and remembers which op produced which storage, so the
  profile knows which saved tensors are outputs of expensive ops (what selective recompute keeps,
  by SAC's per-op index) and what the recomputed rest costs;
* each eligible storage is priced once for every encoding (lossless always, lossy ones for modules
  marked tolerant) at the size it has whatever its values (`planned_bytes`): a size only the data can
  tell (zeros after a ReLU, values that happen to fit a narrower dtype) is planned at its bound, the
  dense size, so the plan is the same on any data, a fake trace's included; on real data a lossy
  encoding also runs once, for its measured error against the stated bound;
* the storage is then offloaded to host memory, so a profiling pass keeps at most what the
  running module holds on the device (results are unchanged: offload is exact).

The passes run on real tensors during training, or on a ``FakeTensorMode`` trace (no memory, no data)
before it (`estimate.trace_plan`): the figures are the same.

Times are counted, not measured: each op's FLOPs and bytes moved, and each encoding's bytes, priced
by the run's device profile (`xirang_ds.memory.device_profile`), so the same model, config and
profile give the same plan on any machine, and the passes never wait for the device. Only a
compiled region, whose ops no dispatch mode sees, is timed (`record_compiled`).
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from xirang_ds.compat.torch import TorchDispatchMode, cast_ops, sac_ignored_ops
from xirang_ds.memory.device_profile import DeviceProfile, op_seconds
from xirang_ds.memory.dispatch import returns_alias
from xirang_ds.plugins.activations.codecs import Trial, trial, trial_bytes
from xirang_ds.plugins.activations.handlers import OffloadHandler
from xirang_ds.plugins.activations.recompute import op_key
from xirang_ds.plugins.activations.saved import Eligibility, PackContext, StorageIds, storage_flat
from xirang_ds.plugins.activations.saved_nodes import NodeSpans, host_buffers, restore_peak
from xirang_ds.plugins.activations.storage import PayloadStorage

ROOT = ""
"""Name of the whole model in a profile (everything saved in forward)."""


@dataclass
class ModuleProfile:
    """One module over one profiling pass (all its calls summed).

    Attributes:
        saved_bytes: storages saved for backward that options can pack.
        largest_bytes: the largest of them.
        restore_bytes: the most of them an on-demand restore holds at once in backward (`saved_nodes`).
        host_bytes, pinned_host_bytes: what offloading them takes on the host: each storage's packed part
            (`saved.storage_flat`) in its buffer, `storage.host_size_class` plain, its block pinned.
        input_host_bytes, input_pinned_host_bytes: the same for its tensor inputs (``*_offload`` recompute).
        small_bytes: saved storages below ``min_tensor_bytes`` or otherwise left as they are.
        input_bytes: storages of tensor inputs (what recompute keeps).
        time_s: forward time (sum of op times).
        selective_bytes: outputs of expensive ops that backward saved (what selective keeps).
        selective_time_s: time of the other ops (what selective recomputes).
        must_save: ``(op name, index)`` of the expensive ops whose outputs are kept.
        compress_bytes, quantize_bytes, sparsify_bytes: eligible bytes after each encoding.
        compress_time_s, quantize_time_s, sparsify_time_s: encode+decode time of each.
        quantize_error, sparsify_error: worst measured error as a fraction of the stated bound.
        order: position of the module's first call in forward (the planner's sequence).
        before_bytes: (root only) bytes saved before the first candidate ran.
        chunk_calls: (output heads) calls whose logits reached ``cross_entropy`` (`head_loss`); the
            profile then covers the head and its loss.
        chunk_bytes: bytes the chunked head and loss keep (the head's input and the targets).
        chunk_tokens: rows (tokens) of one call's logits.
        chunk_rows: the largest slice the planner may choose (``chunk_tokens`` of the section, or
            `head_loss.auto_tokens`), and the only one when ``chunk_fixed``.
        chunk_row_bytes: what one row of a slice holds while its backward runs.
        chunk_forward_row_bytes: what one row of a slice holds while its forward runs (its logits in the head's
            dtype and the loss's at once, or the loss's and its log-probabilities).
        chunk_vocab, chunk_hidden, chunk_head_bytes, chunk_loss_bytes: the head's output and input width and a
            logit's bytes in the head's dtype and the loss's: what a backward by weight rows holds
            (`head_rows.round_bytes`).
        keep_transient_bytes: (output heads) the most the whole head and loss hold besides what they
            save: the logits in forward, their gradient in backward.
        compiled: 1 for a torch.compile'd module (`compiled.py`): timed as one call, its saved
            tensors all back at once when its one backward node runs.
    """

    name: str
    calls: int = 0
    order: int = -1
    saved_bytes: int = 0
    largest_bytes: int = 0
    restore_bytes: int = 0
    host_bytes: int = 0
    pinned_host_bytes: int = 0
    input_host_bytes: int = 0
    input_pinned_host_bytes: int = 0
    small_bytes: int = 0
    input_bytes: int = 0
    time_s: float = 0.0
    selective_bytes: int = 0
    selective_time_s: float = 0.0
    must_save: set = field(default_factory=set)
    compress_bytes: int = 0
    compress_time_s: float = 0.0
    quantize_bytes: int = 0
    quantize_time_s: float = 0.0
    quantize_error: float = 0.0
    sparsify_bytes: int = 0
    sparsify_time_s: float = 0.0
    sparsify_error: float = 0.0
    before_bytes: int = 0
    chunk_calls: int = 0
    chunk_bytes: int = 0
    chunk_tokens: int = 0
    chunk_rows: int = 0
    chunk_fixed: int = 0
    chunk_row_bytes: int = 0
    chunk_forward_row_bytes: int = 0
    chunk_vocab: int = 0
    chunk_hidden: int = 0
    chunk_head_bytes: int = 0
    chunk_loss_bytes: int = 0
    keep_transient_bytes: int = 0
    compiled: int = 0

    @property
    def keep_bytes(self) -> int:
        """Device bytes of its saved tensors when nothing is done."""
        return self.saved_bytes + self.small_bytes

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "must_save"}
        out["must_save"] = sorted([list(x) for x in self.must_save])
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ModuleProfile":
        data = dict(data)
        data["must_save"] = {tuple(x) for x in data.get("must_save", [])}
        return cls(**data)


CODEC_LAUNCHES = {"compress": 8, "quantize": 12, "sparsify": 10}
"""Kernels one encode and decode of a storage launch, counted on the eager codecs (`codecs.py`)."""
QUANTIZE_WORK_BYTES = 12
"""Bytes per element the int8 encoder's fp32 working copies move (`codecs.trial_bytes`)."""


NARROWING_CASTS = {torch.float32: (torch.bfloat16, torch.float16), torch.float64: (torch.float32,)}
"""A cast's output of the key dtype from one of these holds values the narrower dtype holds exactly."""


def planned_bytes(kind: str, flat: torch.Tensor, narrowable: bool, block_size: int) -> int:
    """Bytes ``kind`` stores ``flat`` in whatever its values (`codecs`): ``compress`` packs bools 8 per
    byte and stores a storage a cast made from a narrower float (``narrowable``) in that dtype;
    ``quantize`` stores each block of a float tensor in int8 with one fp32 scale (as `codecs.encode_int8`
    carves it); anything else, sparsify's share of dropped values included, is the dense size: what the
    data gives beyond it is headroom, never planned on."""
    n, dense = flat.numel(), flat.numel() * flat.element_size()
    if kind == "compress":
        if flat.dtype == torch.bool:
            return (n + 7) // 8
        return n * NARROWING_CASTS[flat.dtype][-1].itemsize if narrowable else dense
    if kind == "quantize" and flat.is_floating_point():
        blocks = math.ceil(n / block_size)
        if blocks * (block_size + 4) < dense:
            return -(-4 * blocks // 16) * 16 + blocks * block_size  # the scales, aligned, then the values
    return dense


def codec_seconds(profile: DeviceProfile, kind: str, dtype: torch.dtype, dense_bytes: int, payload_bytes: int) -> float:
    """One encode and decode of a storage: the dense bytes read and written back, the payload written
    and read, the int8 encoder's fp32 working copies, and the codec's launches, priced by ``profile``."""
    moved = 2 * (dense_bytes + payload_bytes)
    if kind == "quantize":
        moved += QUANTIZE_WORK_BYTES * dense_bytes // max(1, torch.empty((), dtype=dtype).element_size())
    return profile.op_seconds(0, moved) + (CODEC_LAUNCHES[kind] - 1) * profile.launch_s


@dataclass
class _Op:
    key: str
    index: int
    seconds: float
    heavy: bool
    outputs: list


class _Frame:
    """One call of one module during a profiling pass."""

    def __init__(self, profile: ModuleProfile, tolerant: bool):
        self.profile = profile
        self.tolerant = tolerant
        self.counter: dict[str, int] = defaultdict(int)
        self.ops: list[_Op] = []
        self.produced: dict[int, int] = {}
        self.saved: set = set()
        self.inputs: set = set()
        self.selected: set[int] = set()
        self.selected_storages: set = set()
        self.spans: dict[int, list[int]] = {}
        """``{storage: [first, last, bytes]}``: the autograd nodes (by position) that saved each eligible storage."""

    def close(self) -> None:
        p = self.profile
        p.restore_bytes = max(p.restore_bytes, restore_peak(self.spans.values()))
        p.calls += 1
        p.time_s += sum(op.seconds for op in self.ops)
        p.selective_time_s += sum(op.seconds for i, op in enumerate(self.ops) if i not in self.selected)
        p.must_save.update((self.ops[i].key, self.ops[i].index) for i in self.selected)


class _OpTimer(TorchDispatchMode):
    def __init__(self, profiler: "Profiler"):
        super().__init__()
        self.profiler = profiler

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        prof = self.profiler
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if prof.in_hook:
            return out
        prof.nodes.op_ran(func, args, kwargs, out)
        if func in _CASTS and isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor) \
                and args[0].dtype in NARROWING_CASTS.get(out.dtype, ()):
            prof.narrowable.add(prof.ids(out.untyped_storage()))
        if len(prof.stack) >= 2 and func not in prof.ignored:
            prof.record_op(func, out, op_seconds(prof.device_profile, func, args, kwargs, out))
        return out


_CASTS = cast_ops()


class _ProfilePack(PackContext):
    """The pass-wide pack context: records every saved tensor before packing (offloading) it."""

    def __init__(self, profiler: "Profiler", handler: OffloadHandler):
        super().__init__(handler, profiler.eligible)
        self.profiler = profiler

    def pack(self, t: torch.Tensor) -> Any:
        prof = self.profiler
        prof.in_hook = True
        try:
            prof.record_saved(t)
            return super().pack(t)
        finally:
            prof.in_hook = False


class Profiler:
    """Runs profiling passes and keeps one `ModuleProfile` per candidate and pass.

    Args:
        eligible: which saved tensors options may pack.
        handler: the offload handler that holds saved tensors during profiling.
        storage: payload storage for the encoding trials (plain allocations).
        tolerant: names of modules whose tensors may be stored lossily.
        lossy_kinds: lossy encodings to try on tolerant modules (``quantize``, ``sparsify``).
        block_size, threshold: settings of the lossy encodings.
        device_profile: prices ops and encodings (`xirang_ds.memory.device_profile`).
    """

    def __init__(self, eligible: Eligibility, handler: OffloadHandler, storage: PayloadStorage,
                 tolerant: frozenset, lossy_kinds: tuple[str, ...], block_size: int, threshold: float,
                 device_profile: DeviceProfile):
        self.eligible = eligible
        self.handler = handler
        self.storage = storage
        self.tolerant = tolerant
        self.lossy_kinds = lossy_kinds
        self.block_size = block_size
        self.threshold = threshold
        self.device_profile = device_profile
        self.trial_stretch: Optional[Callable[[bool], None]] = None
        """Begins (True) and ends (False) a stretch the planner's measured peak leaves out: the trials
        are this pass's own transient, which no planned step pays (`pricing.OtherPeak.exclude`)."""
        self.trial_room: Optional[Callable[[], int]] = None
        """Device bytes ``memory_budget`` leaves now; a trial that might not fit runs on a host copy."""
        self.host_tier: Callable[[], Any] = contextlib.nullcontext
        """What host-tier allocations run under (the session tracker's ``host_tier`` on CPU)."""
        self.ignored = sac_ignored_ops()
        self.passes: list[dict[str, ModuleProfile]] = []
        self.stack: list[_Frame] = []
        self.in_hook = False
        self.nodes = NodeSpans()
        """Which autograd node saved each storage (`saved_nodes`)."""
        self.ids = StorageIds()
        self.narrowable: set[int] = set()
        """Storages a cast made from a narrower float in this pass (`planned_bytes`)."""
        self._trials: dict[int, dict[str, Any]] = {}

    # passes --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def run_pass(self) -> Iterator[None]:
        """One profiled forward (the saved tensors stay offloaded until backward needs them)."""
        current: dict[str, ModuleProfile] = {ROOT: ModuleProfile(ROOT)}
        self.passes.append(current)
        self.stack = [_Frame(current[ROOT], False)]
        self._trials = {}
        timer = _OpTimer(self)
        self.nodes = NodeSpans()
        with _ProfilePack(self, self.handler), timer:
            try:
                yield
            finally:
                self.nodes.flush()
                self.stack[0].close()
                self.stack = []
                self._trials = {}
                self.narrowable = set()
                self.ids.clear()

    @contextlib.contextmanager
    def frame(self, name: str, args: tuple, kwargs: dict) -> Iterator[None]:
        """A candidate module's call inside a pass."""
        if not self.stack:  # a forward outside a pass (no grad, or evaluation)
            yield
            return
        profile = self.profile(name)
        frame = _Frame(profile, name in self.tolerant)
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, torch.Tensor) and self.eligible(value):
                st = value.untyped_storage()
                ident = self.ids(st)
                if ident not in frame.inputs:
                    frame.inputs.add(ident)
                    profile.input_bytes += st.nbytes()
                    self.in_hook = True  # its views are no op of the model's
                    try:
                        plain, pinned = host_buffers(value)
                    finally:
                        self.in_hook = False
                    profile.input_host_bytes += plain
                    profile.input_pinned_host_bytes += pinned
        self.stack.append(frame)
        try:
            yield
        finally:
            self.nodes.flush()
            self.stack.pop()
            frame.close()

    def profile(self, name: str) -> ModuleProfile:
        """Module ``name``'s profile in the current pass (made at its first call: its order)."""
        current = self.passes[-1]
        if name not in current:
            current[name] = ModuleProfile(name, order=len(current))
        return current[name]

    # recording -----------------------------------------------------------------------------------
    def record_op(self, func: Any, out: Any, seconds: float) -> None:
        key, heavy = op_key(func)
        outputs = []
        if not returns_alias(func):
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == self.eligible.device_type:
                    st = t.untyped_storage()
                    outputs.append((self.ids(st), st.nbytes()))
        for frame in self.stack[1:]:
            index = frame.counter[key]
            frame.counter[key] = index + 1
            frame.ops.append(_Op(key, index, seconds, heavy, outputs))
            for ident, _ in outputs:
                frame.produced[ident] = len(frame.ops) - 1

    def record_compiled(self, seconds: float) -> None:
        """A compiled call (no op timer inside it) counts as one op of every module running now."""
        for frame in self.stack[1:]:
            frame.ops.append(_Op("<compiled>", frame.counter["<compiled>"], seconds, False, []))
            frame.counter["<compiled>"] += 1

    def record_saved(self, t: torch.Tensor) -> None:
        """Attribute one saved tensor to every module running now."""
        if not self.eligible.plain(t):
            return
        st = t.untyped_storage()
        if self.eligible.storage_id(st) in self.eligible.model_storages or not (self.eligible.fake or st.data_ptr()):
            return
        key, nbytes = self.ids(st), st.nbytes()
        eligible = self.eligible(t)
        results = self._trial(t, key) if eligible else {}
        host = host_buffers(t) if eligible else (0, 0)
        if eligible:  # the node saving it, for `saved_nodes.restore_peak`
            self.nodes.saved(st, key, nbytes, self.stack)
        for frame in self.stack:
            if key in frame.saved:
                continue
            frame.saved.add(key)
            p = frame.profile
            if len(self.stack) == 1 and len(self.passes[-1]) == 1:  # before any candidate ran
                p.before_bytes += nbytes
            if not eligible:
                p.small_bytes += nbytes
                continue
            p.saved_bytes += nbytes
            p.largest_bytes = max(p.largest_bytes, nbytes)
            p.host_bytes += host[0]
            p.pinned_host_bytes += host[1]
            for kind, r in results.items():
                if kind == "compress" or frame.tolerant:
                    setattr(p, f"{kind}_bytes", getattr(p, f"{kind}_bytes") + r.nbytes)
                    seconds = codec_seconds(self.device_profile, kind, t.dtype, nbytes, r.nbytes)
                    setattr(p, f"{kind}_time_s", getattr(p, f"{kind}_time_s") + seconds)
                    if kind != "compress":
                        setattr(p, f"{kind}_error", max(getattr(p, f"{kind}_error"), r.error_ratio))
            self._select(frame, key)

    def _select(self, frame: _Frame, key: int) -> None:
        """Selective recompute keeps a saved storage iff an expensive op in this module made it."""
        index = frame.produced.get(key)
        if index is None or index in frame.selected or not frame.ops[index].heavy:
            return
        frame.selected.add(index)
        for ident, nbytes in frame.ops[index].outputs:  # SAC caches every output of the op
            if ident not in frame.selected_storages:
                frame.selected_storages.add(ident)
                frame.profile.selective_bytes += nbytes

    def _trial(self, t: torch.Tensor, key: int) -> dict[str, Any]:
        """Each encoding's planned bytes for ``t``'s storage (`planned_bytes`) and, on real data, each lossy
        one's measured error (one encode and decode; ``trial_room`` decides whether it runs on a host copy)."""
        known = self._trials.get(key)
        if known is not None:
            return known
        flat, _ = storage_flat(t)
        lossy = self.lossy_kinds if any(f.tolerant for f in self.stack) else ()
        errors = self._errors(flat, lossy) if lossy and not self.eligible.fake else {}
        results = {kind: Trial(planned_bytes(kind, flat, key in self.narrowable, self.block_size), 0.0,
                               errors.get(kind, 0.0)) for kind in ("compress",) + lossy}
        self._trials[key] = results
        return results

    def _errors(self, flat: torch.Tensor, kinds: tuple[str, ...]) -> dict[str, float]:
        on_host = self.trial_room is not None and self.trial_room() < trial_bytes(flat, kinds)
        if self.trial_stretch is not None:
            self.trial_stretch(True)
        try:
            with torch.no_grad(), (self.host_tier() if on_host else contextlib.nullcontext()):
                source = flat.to("cpu", copy=True) if on_host else flat  # on CPU too: a host-tier copy
                errors = {kind: trial(kind, source, self.storage, self.block_size, self.threshold).error_ratio
                          for kind in kinds}
                del source
        finally:
            if self.trial_stretch is not None:
                self.trial_stretch(False)
        return errors

    # results -------------------------------------------------------------------------------------
    def combined(self) -> dict[str, ModuleProfile]:
        """Bytes of the last pass, times of the fastest pass (counted, so equal but for compiled
        regions), per module."""
        if not self.passes:
            return {}
        last = self.passes[-1]
        out = {}
        for name, p in last.items():
            runs = [run[name] for run in self.passes if name in run]
            best = min(runs, key=lambda r: r.time_s)
            q = ModuleProfile(**{**p.__dict__, "must_save": set(p.must_save)})
            q.time_s, q.selective_time_s = best.time_s, best.selective_time_s
            for kind in ("compress", "quantize", "sparsify"):
                setattr(q, f"{kind}_time_s", min(getattr(r, f"{kind}_time_s") for r in runs))
            out[name] = q
        return out
