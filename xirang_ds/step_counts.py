"""What one training step asks of the device, counted rather than timed.

A CPU hides what dominates a GPU step beside its arithmetic: a kernel launch, a host sync and a host
copy cost next to nothing there. So the bench and the GPU check count them for one step, the same
counts on any machine for the same program:

* ``kernels``: ATen ops that compute (views, size queries and allocations that write nothing, ``empty``,
  left out; off a CPU, ops on host tensors alone too), seen by a dispatch mode: what
  an eager step launches. A compiled region runs eagerly under the mode (Dynamo declines to trace
  under one), so it counts its ops, not its one graph call; except where the code runs it through
  `compiled_call` (optimizer_states' fused update): the counters, and a memory tracker beside them,
  are lifted for the call and each counter counts it as one kernel. On CUDA the profiler's count of
  kernels really launched is ``device_kernels`` beside it.
* ``host_syncs``: ops whose result the host must read before it goes on (``aten._local_scalar_dense``
  behind ``.item()``, ``float(t)`` and ``bool(t)``; ``Tensor.tolist`` of a CPU tensor on a CPU run, which
  reads memory with no ATen op, seen by a function mode; ``is_nonzero``, ``equal``; ops whose output
  shape is data (``nonzero``, ``masked_select``, ``unique``...); a blocking copy into the host
  tier). On CUDA ``device_syncs`` is what ``torch.cuda.set_sync_debug_mode`` reports beside it.
* ``host_reads``: reads of scalars a GPU run keeps in host memory, which wait for nothing there: a
  torch optimizer's ``step`` counter outside capturable and fused groups (torch keeps it on the CPU,
  ``torch/optim/adam.py`` ``_init_group``; single-tensor AdamW reads it once per parameter). On a
  CPU every tensor is on the device, so these are told apart by what they are, not where they lie.
* ``link_bytes``: bytes copied between the device and the host tier, by what moves: the tracker's
  scope at the copy, else the category of the device-side storage (``activations``: offload;
  ``optimizer_states``, ``gradients``: grad_release's host tiers). Off a CPU, host memory is the
  CPU's; on a CPU the tracker's host tier tells (without a tracker there is one tier: 0).
* ``optimizer_kernels``: ``kernels`` inside any ``torch.optim.Optimizer.step`` (grad_release's
  bucket steps in backward included), through torch's global step hooks.
* ``kernels_by_source``: ``kernels`` by the code that launched them (`source_of`): a plugin's section name
  (``optimizer_states``, ``grad_release``...), ``deepspeed``, ``xirang_ds`` (the package's core: the bench's
  loop and data), or ``model`` (the model's forward and backward, recomputation included, the built-in
  models', and any other code).

Example:
    counts = count_step(lambda: optimizer_step(engine, data), engine.device, engine.xirang.tracker)
    counts.as_dict()   # {"kernels": 691, "host_syncs": 4, "link_bytes": {}, "optimizer_kernels": 52, ...}
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from xirang_ds.compat.torch import (
    TorchDispatchMode,
    copy_ops,
    dispatch_mode_stack,
    function_mode_stack,
    host_read_ops,
    op_schema,
    pop_function_mode_temporarily,
    pop_mode_temporarily,
)
from xirang_ds.memory.dispatch import TrackingMode
from xirang_ds.memory.storages import tensors_in

_aten = torch.ops.aten
_SIZE_OPS = {_aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default, _aten.sym_storage_offset.default,
             _aten.is_same_size.default}
_SYNC_PACKETS = host_read_ops()
_COPY_INTO, _COPY_NEW = copy_ops()
_FREE: dict[Any, bool] = {}


_ALLOCATE_ONLY = frozenset(getattr(_aten, name) for name in
                           ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_"))
"""Ops that allocate and write nothing: the caching allocator hands out memory, no kernel runs."""


def launches_nothing(func: Any) -> bool:
    """Views (outputs alias an input without writing it), ops on sizes alone, allocations that write nothing
    (``empty``), metadata (``prim``: a tensor's device) and the profiler's annotations (``record_function``'s
    enter and exit, around every optimizer step) compute nothing."""
    known = _FREE.get(func)
    if known is None:
        schema = op_schema(func)
        aliases = schema is not None and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        known = bool(aliases or func in _SIZE_OPS or getattr(func, "overloadpacket", None) in _ALLOCATE_ONLY
                     or getattr(func, "namespace", "") in ("profiler", "prim"))
        _FREE[func] = known
    return known


_BACKWARD = {("torch.autograd", "backward"), ("torch._tensor", "backward"), ("torch.autograd", "grad")}
"""Where torch enters autograd's engine from Python: an op whose innermost caller outside torch is reached
through one of these is the model's backward, not the code that called it."""


_INSTRUMENTS = ("xirang_ds.memory.", "xirang_ds.step_counts", "xirang_ds.compat.")
"""Modules whose frames pass an op on rather than launch it: the measuring dispatch modes and their helpers."""


def source_of(frame: Any) -> str:
    """Who launched an op whose innermost Python frame is ``frame`` (module docstring's ``kernels_by_source``):
    the innermost frame outside torch (and outside the measuring modes) decides by its module, unless autograd's
    engine was entered on the way."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(_INSTRUMENTS):  # a dispatch mode passing the op on (the tracker's, this counter's)
            frame = frame.f_back
            continue
        if name == "torch" or name.startswith("torch."):
            if (name, frame.f_code.co_name) in _BACKWARD:
                return "model"
            frame = frame.f_back
            continue
        if name.startswith("xirang_ds.plugins."):
            return name.split(".")[2]
        if name == "deepspeed" or name.startswith("deepspeed."):
            return "deepspeed"
        return "xirang_ds" if name.startswith("xirang_ds.") and name != "xirang_ds.models" else "model"
    return "model"


class _Counter(TorchDispatchMode):
    def __init__(self, device_type: str = "cpu", tracker: Any = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.tracker = tracker
        self.by_source: dict[str, int] = {}
        self.kernels = self.host_syncs = self.host_reads = self.optimizer_kernels = 0
        self.host_counters: set[int] = set()  # data_ptrs of optimizers' host-side step counters
        self.link_bytes: dict[str, int] = {}
        self.in_step = 0

    def _host(self, t: torch.Tensor) -> bool:
        """Off a CPU, host memory is the CPU's; on one, the tracker's host tier (one tier without it)."""
        if self.device_type != "cpu":
            return t.device.type == "cpu"
        return bool(self.tracker is not None and self.tracker.is_host(t))

    def _category(self, host_side: torch.Tensor, device_side: torch.Tensor) -> str:
        """What moves: the tracker's open scope, else the device-side storage's category."""
        if self.tracker is None:
            return "other"
        found = self.tracker.scope_category or self.tracker.category_of(device_side)
        return found if found and found != "host" else "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if launches_nothing(func):
            return out
        # off a CPU, an op on host tensors alone (a torch optimizer's step counter) launches nothing on the device,
        # and reading one waits for nothing there
        on_device = self.device_type == "cpu" or any(t.device.type != "cpu" for t in tensors_in((args, kwargs, out)))
        if on_device:
            self._count(inspect.currentframe().f_back)
        packet = getattr(func, "overloadpacket", None)
        if packet in _SYNC_PACKETS:
            if args and isinstance(args[0], torch.Tensor) and args[0].data_ptr() in self.host_counters:
                self.host_reads += 1
            elif on_device:
                self.host_syncs += 1
        elif packet is _COPY_INTO or packet is _COPY_NEW:
            self._copy(packet, args, kwargs, out)
        return out

    def _count(self, frame: Any) -> None:
        self.kernels += 1
        self.optimizer_kernels += self.in_step > 0
        source = source_of(frame)
        self.by_source[source] = self.by_source.get(source, 0) + 1

    def count_compiled_call(self, frame: Any) -> None:
        """One call of a compiled graph, run outside the mode (`compiled_call`), from ``frame``."""
        self._count(frame)

    def _copy(self, packet: Any, args: tuple, kwargs: dict, out: Any) -> None:
        src, dst = (args[1], args[0]) if packet is _COPY_INTO else (args[0], out)
        if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
            return
        into_host = self._host(dst)
        if into_host == self._host(src):
            return
        category = self._category(dst if into_host else src, src if into_host else dst)
        self.link_bytes[category] = self.link_bytes.get(category, 0) + dst.numel() * dst.element_size()
        blocking = not (kwargs.get("non_blocking") or (packet is _COPY_INTO and len(args) > 2 and args[2]))
        if into_host and blocking:
            self.host_syncs += 1  # the host waits for the copy to land


def only_counters_active() -> bool:
    """Every active dispatch mode is a step counter (none at all counts too), or a memory tracker while a
    counter counts: a compiled region may run through `compiled_call` and be counted as what it is, one
    graph call. The tracker (the bench's instrument, not the user's program) steps aside for the counted
    step's compiled calls, so the step counted is the program a run without it takes; the bench reads
    its memory figures before that step (`bench.bench_rank`)."""
    modes = dispatch_mode_stack()
    counting = any(isinstance(mode, _Counter) for mode in modes)
    return all(isinstance(mode, _Counter) or (counting and isinstance(mode, TrackingMode)) for mode in modes)


@contextlib.contextmanager
def compiled_call() -> Iterator[None]:
    """Run the body (one call of a compiled graph) with the active step counters (and a memory tracker
    beside them) lifted, since Dynamo does not trace under a dispatch mode, and count it as one kernel
    in each counter. Only where `only_counters_active`; with no counter it does nothing."""
    modes = dispatch_mode_stack()
    counters = [mode for mode in modes if isinstance(mode, _Counter)]
    readers = [mode for mode in function_mode_stack() if isinstance(mode, _ListReads)]
    with contextlib.ExitStack() as lifted:
        for _ in modes if counters else ():  # every mode is a counter or a tracker
            lifted.enter_context(pop_mode_temporarily())
        for _ in readers:  # count_ops enters them innermost
            lifted.enter_context(pop_function_mode_temporarily())
        yield
    caller = inspect.currentframe().f_back.f_back  # past contextlib's frame: the code that made the call
    for mode in counters:
        mode.count_compiled_call(caller)


class _ListReads(torch.overrides.TorchFunctionMode):
    """``Tensor.tolist`` of a CPU tensor on a CPU run, one host sync: it reads the memory in C++ with no
    ATen op for `_Counter` to see (on a GPU the copy to the host it makes is counted there)."""

    def __init__(self, counter: _Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.Tensor.tolist and self.counter.device_type == "cpu" and args
                and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"):
            self.counter.host_syncs += 1
        return func(*args, **(kwargs or {}))


@dataclass
class StepCounts:
    """One step's launches, waits and host-link bytes (`count_step`); the ``device_`` figures are
    ``None`` where no CUDA device reports them."""

    kernels: Optional[int]
    host_syncs: Optional[int] = None
    host_reads: Optional[int] = None
    link_bytes: dict[str, int] = field(default_factory=dict)
    optimizer_kernels: Optional[int] = None
    kernels_by_source: dict[str, int] = field(default_factory=dict)
    device_kernels: Optional[int] = None
    device_memcpys: Optional[int] = None
    device_syncs: Optional[int] = None

    @property
    def link_bytes_total(self) -> int:
        return sum(self.link_bytes.values())

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "link_bytes_total": self.link_bytes_total}


def count_ops(fn: Callable[[], Any], device: torch.device | str = "cpu", tracker: Any = None) -> tuple[Any, _Counter]:
    """Run ``fn`` under the counting dispatch mode for a run on ``device`` (with ``tracker``: the host
    tier and scope of each copy); its result and the counter."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    mode = _Counter(torch.device(device).type, tracker)

    def enter(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        mode.in_step += 1
        mode.host_counters.update(_host_step_counters(optimizer))

    def leave(*_: Any) -> None:
        mode.in_step -= 1

    hooks = [register_optimizer_step_pre_hook(enter), register_optimizer_step_post_hook(leave)]
    try:
        with mode, _ListReads(mode):
            out = fn()
    finally:
        for h in hooks:
            h.remove()
    return out, mode


def _host_step_counters(optimizer: torch.optim.Optimizer) -> set[int]:
    """Where ``optimizer``'s 0-d ``step`` counters lie, for those torch keeps in host memory on an
    accelerator too (groups neither capturable nor fused)."""
    host_groups = [g for g in optimizer.param_groups if not g.get("capturable") and not g.get("fused")]
    params = {id(p) for g in host_groups for p in g["params"]}
    out = set()
    for p, state in optimizer.state.items():
        step = state.get("step") if isinstance(state, dict) and id(p) in params else None
        if isinstance(step, torch.Tensor) and step.dim() == 0:
            out.add(step.data_ptr())
    return out


def _device_events(fn: Callable[[], Any]) -> tuple[int, int]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = memcpys = 0
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        if event.name.startswith(("Memcpy", "Memset")):
            memcpys += 1
        else:
            kernels += 1
    return kernels, memcpys


def _device_syncs(fn: Callable[[], Any]) -> int:
    """Synchronizing calls in ``fn``: debug mode 1 makes each one warn (c10's ``warn_or_error_on_sync``)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(1 for w in caught if "synchronizing" in str(w.message))


def count_step(step: Callable[[], Any], device: torch.device | str = "cpu", tracker: Any = None) -> StepCounts:
    """Counts for ``step``, which is run once per count: under the dispatch mode, then on CUDA once
    under the profiler and once in sync debug mode. Each run is a real training step: count after
    the steps that are measured. A step that cannot run under a dispatch mode leaves the mode's
    counts ``None``."""
    try:
        _, mode = count_ops(step, device, tracker)
        counts = StepCounts(kernels=mode.kernels, host_syncs=mode.host_syncs, host_reads=mode.host_reads,
                            link_bytes=dict(mode.link_bytes), optimizer_kernels=mode.optimizer_kernels,
                            kernels_by_source=dict(sorted(mode.by_source.items(), key=lambda kv: -kv[1])))
    except Exception:  # a compiled region refused under the mode: the device's counts alone
        counts = StepCounts(kernels=None)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        counts.device_kernels, counts.device_memcpys = _device_events(step)
        counts.device_syncs = _device_syncs(step)
    return counts


__all__ = ["StepCounts", "compiled_call", "count_ops", "count_step", "launches_nothing", "only_counters_active",
           "source_of"]
