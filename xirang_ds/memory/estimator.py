"""Predict a rank's peak device memory before anything runs, with its breakdown by category.

Two parts:

* The model's own activations, temporaries and gradients come from a *fake trace*: one forward and
  backward of the real model under ``FakeTensorMode`` (no memory, no compute; a few hundred
  milliseconds whatever the model size) measured by the same live-storage tracker that measures real
  runs. DeepSpeed's gradient handling is emulated during that trace by gradient hooks that allocate
  what the engine allocates when it allocates it: the reduction bucket at the first gradient
  (ZeRO 1/2), ZeRO-2's gradient partition at the first bucket reduction, gradients moved out of
  ``param.grad`` (ZeRO 2). So the activation term is exact for any architecture, and the
  Korthikanti et al. formula is reported beside it for reference.
* Model states and the optimizer step are analytic, by ZeRO stage and dtype, following DeepSpeed's
  buffers (flat 16-bit parameters, fp32 partitions, states over the partition, fp32 gradient
  partitions at the step) and the optimizer implementation's temporaries (torch's single-tensor Adam
  on CPU, foreach on CUDA, none for fused kernels).

The peak is the largest of the phases: forward, backward, optimizer step. ``recalibrate`` compares a
measured `PeakReport` with the estimate and returns per-category correction factors.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from xirang_ds.memory.categories import (
    ACTIVATIONS,
    CATEGORIES,
    COMM_BUFFERS,
    GRADIENTS,
    OPTIMIZER_STATES,
    PARAMETERS,
    TEMPORARIES,
)

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DEFAULT_REDUCE_BUCKET = int(5e8)
DEFAULT_ALLGATHER_BUCKET = int(5e8)
DEFAULT_PREFETCH_BUCKET = int(5e7)
DEFAULT_PERSISTENCE_THRESHOLD = int(1e5)
DEFAULT_MAX_REUSE_DISTANCE = int(1e9)


def partition_numel(total: int, world_size: int) -> int:
    """One rank's share of ``total`` elements in ZeRO's flat buffers (padded to 2 x ranks)."""
    n = max(world_size, 1)
    return int(math.ceil(total / (2 * n)) * 2 * n) // n


class EstimateError(ValueError):
    """The ds_config or model cannot be estimated (the message says why)."""


# ------------------------------------------------------------------------------------------------
# ds_config facts


@dataclass(frozen=True)
class RunShape:
    """What the estimate needs from a ds_config, with DeepSpeed's defaults applied."""

    micro_batch: int
    grad_accum: int
    world_size: int
    stage: int
    dtype: torch.dtype
    reduce_bucket: int
    allgather_bucket: int
    overlap_comm: bool
    contiguous_gradients: bool
    prefetch_bucket: int
    persistence_threshold: int
    max_reuse_distance: int
    offloaded: tuple[str, ...]  # the zero_optimization offload sections with a device other than none
    optimizer: str
    adam_impl: str  # "single_tensor" | "foreach" | "fused"
    device: str
    shared_masters: bool = False  # ZeRO 1/2's fp32 partition is a view of fp32 parameters, not a copy
    groups: Optional[tuple[tuple[int, ...], ...]] = None
    """DeepSpeed's parameter groups as indices into the trainable parameters, when a plugin splits them
    (optimizer_states keeps fp32 states in groups of their own); ZeRO 1/2 flattens and partitions each
    group on its own. ``None``: one group."""

    @classmethod
    def from_ds_config(cls, ds: dict, world_size: int = 1, device: str = "cpu") -> "RunShape":
        gas = int(ds.get("gradient_accumulation_steps", 1) or 1)
        micro = ds.get("train_micro_batch_size_per_gpu")
        if micro in (None, "auto"):
            total = ds.get("train_batch_size")
            if total in (None, "auto"):
                raise EstimateError("ds_config sets neither train_micro_batch_size_per_gpu nor train_batch_size")
            micro = int(total) // (gas * world_size)
        zero = ds.get("zero_optimization", {}) or {}
        stage = int(zero.get("stage", 0))
        if ds.get("bf16", {}).get("enabled") in (True, "true"):
            dtype = torch.bfloat16
        elif ds.get("fp16", {}).get("enabled") in (True, "true"):
            dtype = torch.float16
        else:
            dtype = torch.float32
        opt = ds.get("optimizer", {}) or {}
        params = opt.get("params", {}) or {}
        name = str(opt.get("type", "AdamW"))
        if params.get("torch_adam"):
            impl = "foreach" if device == "cuda" else "single_tensor"
        else:
            impl = "fused"  # DeepSpeed's FusedAdam (GPU) / CPUAdam: no step temporaries
        return cls(micro_batch=int(micro), grad_accum=gas, world_size=world_size, stage=stage, dtype=dtype,
                   reduce_bucket=int(float(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET))),
                   allgather_bucket=int(float(zero.get("allgather_bucket_size", DEFAULT_ALLGATHER_BUCKET))),
                   overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
                   contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
                   prefetch_bucket=int(float(zero.get("stage3_prefetch_bucket_size", DEFAULT_PREFETCH_BUCKET))),
                   persistence_threshold=int(float(zero.get("stage3_param_persistence_threshold",
                                                            DEFAULT_PERSISTENCE_THRESHOLD))),
                   max_reuse_distance=int(float(zero.get("stage3_max_reuse_distance", DEFAULT_MAX_REUSE_DISTANCE))),
                   offloaded=tuple(k for k in ("offload_optimizer", "offload_param")
                                   if str((zero.get(k) or {}).get("device", "none")) != "none"),
                   optimizer=name, adam_impl=impl, device=device)

    @property
    def lp_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


# ------------------------------------------------------------------------------------------------
# the fake trace


@dataclass
class Trace:
    """Bytes above the resident parameters during one fake forward and backward.

    Attributes:
        forward_peak: highest live bytes (above parameters and inputs) in forward.
        activations: bytes alive when forward ends (saved for backward, the loss).
        backward_peak: highest live bytes in backward, with the engine's gradient handling emulated.
        backward_by_category: the breakdown at the backward peak.
        backward_start_by_category: the breakdown at the highest point of backward before its first
            gradient is ready (all activations and the loss's gradient, none of the engine's
            buffers): where the peak moves when a plugin takes the buffers away.
        forward_by_category: the breakdown at the forward peak.
        inputs: bytes of the batch tensors.
        param_numels: numel of each trainable parameter.
        accumulates: the phases are the larger of two micro-steps of one accumulation window, so
            they hold what the engine carries from one micro-step to the next.
        loss_outside: the forward returned no loss; a stand-in was traced, and what the run's own
            loss keeps for backward is not in the activations.
    """

    forward_peak: int
    activations: int
    backward_peak: int
    backward_by_category: dict
    forward_by_category: dict
    inputs: int
    backward_start_by_category: dict = field(default_factory=dict)
    param_numels: list[int] = field(default_factory=list)
    accumulates: bool = False
    loss_outside: bool = False


class _EngineEmulation:
    """Gradient hooks that allocate what DeepSpeed's ZeRO 1/2 allocate, when they allocate it."""

    def __init__(self, shape: RunShape, params: list[torch.nn.Parameter], tracker: Any):
        self.shape = shape
        self.params = params
        self.tracker = tracker
        self.keep: list[torch.Tensor] = []
        self.bucket_fill = 0
        self.started = False
        self.micro_step = 0
        self.pending: list[torch.Tensor] = []
        self.backward_start: Any = None  # a tracker window opened as backward starts
        self.backward_starts: list[Any] = []  # its report at the micro-step's first gradient
        rank = _fullest_rank(shape, [p.numel() for p in params])
        self.partition_numel = rank.numel
        self.in_partition = {id(params[i]) for i in rank.params}

    def hook(self, param: torch.Tensor) -> None:
        shape = self.shape
        if self.backward_start is not None:  # the first gradient: what backward held before the engine acts
            self.backward_starts.append(self.backward_start.report())
            self.backward_start = None
        if shape.stage in (1, 2) and shape.contiguous_gradients and not self.started:
            self.started = True
            buffers = 2 if shape.overlap_comm else 1
            with self.tracker.scope(COMM_BUFFERS):
                for _ in range(buffers):
                    self.keep.append(torch.empty(shape.reduce_bucket, dtype=shape.dtype))
        if shape.stage == 2:
            numel = param.numel()
            if self.bucket_fill + numel > shape.reduce_bucket and self.bucket_fill:
                self._reduce()
                self.bucket_fill = 0
            self.bucket_fill += numel
            if self.micro_step and id(param) in self.in_partition:
                # accumulating: ``param.grad`` was a view of the partition, so autograd summed into
                # a new tensor, which stays until the epilogue clears the gradients
                self.pending.append(param)
            else:
                param.grad = None  # copied into the bucket; the bucket is the gradient now
        elif shape.stage == 3:
            param.grad = None  # reduced into the resident bucket and partition (`_stage3_working_set`)

    def end_micro_step(self) -> None:
        """What the engine frees between two micro-steps of one accumulation window: ZeRO 2's
        epilogue releases the reduction buckets (the gradient partition stays); ZeRO 1 keeps its
        bucket and ZeRO 0/1 the gradients in ``param.grad`` until the boundary."""
        self.micro_step += 1
        if self.shape.stage == 2:
            self.keep = [t for t in self.keep if getattr(t, "_xirang_partition", False)]
            self.started = False
            self.bucket_fill = 0

    def _reduce(self) -> None:
        if not any(getattr(t, "_xirang_partition", False) for t in self.keep):
            with self.tracker.scope(GRADIENTS):
                t = torch.empty(self.partition_numel, dtype=self.shape.dtype)
            t._xirang_partition = True  # type: ignore[attr-defined]
            self.keep.append(t)

    def end_backward(self) -> None:
        """ZeRO 2's epilogue: the last bucket is reduced into the partition, the gradients cleared."""
        if self.shape.stage == 2 and self.bucket_fill:
            self._reduce()
            self.bucket_fill = 0
        for p in self.pending:
            p.grad = None
        self.pending.clear()


@dataclass(frozen=True)
class _Partition:
    numel: int
    params: tuple[int, ...]
    by_group: tuple[int, ...] = ()  # the numel it keeps whole in each group


def _fullest_rank(shape: RunShape, numels: list[int]) -> _Partition:
    """The rank whose ZeRO 1/2 gradient partition is largest: each group's flat 16-bit buffer is split
    evenly in parameter order, and a rank keeps the gradients of every parameter that reaches into its
    range whole (stage_1_and_2.py ``params_in_partition``; ``grads_in_partition`` is their sum), in
    every group."""
    n = max(shape.world_size, 1)
    groups = shape.groups or (tuple(range(len(numels))),)
    best = _Partition(0, (), (0,) * len(groups))
    for r in range(n):
        inside, sizes = [], []
        for group in groups:
            part = partition_numel(sum(numels[i] for i in group), n)
            lo, hi = r * part, (r + 1) * part
            start, kept = 0, 0
            for i in group:
                if start < hi and start + numels[i] > lo:
                    inside.append(i)
                    kept += numels[i]
                start += numels[i]
            sizes.append(kept)
        if sum(sizes) > best.numel:
            best = _Partition(sum(sizes), tuple(inside), tuple(sizes))
    return best


def _fake_model(build: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
    model = build()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


Inputs = Callable[[], tuple[tuple, dict]]
"""Makes one micro-batch's ``(args, kwargs)`` for ``model(*args, **kwargs)``, called under the trace's
``FakeTensorMode`` (`xirang_ds.memory.calibration.InputSignature.fake`)."""


def loss_of(output: Any) -> Optional[torch.Tensor]:
    """The scalar loss in a forward's output: the output itself, its ``loss`` attribute or key (HF
    models), or its first element; ``None`` when there is none (the loss is computed outside)."""
    for candidate in (output, getattr(output, "loss", None),
                      output.get("loss") if isinstance(output, dict) else None,
                      output[0] if isinstance(output, (tuple, list)) and output else None):
        if isinstance(candidate, torch.Tensor) and candidate.dim() == 0:
            return candidate
    return None


def _stand_in_loss(output: Any) -> torch.Tensor:
    """A loss for a forward whose output holds none: the sum of its floating tensors (what a loss
    computed outside the model keeps for backward is not traced)."""
    from xirang_ds.memory.tracker import _tensors

    floats = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise EstimateError("the model's forward returns no loss and no tensor that needs a gradient")
    return sum(t.sum() for t in floats)


def trace_model(build: Callable[[], torch.nn.Module], shape: RunShape, seq: Optional[int] = None,
                vocab: Optional[int] = None, inputs: Optional[Inputs] = None, session: Any = None) -> Trace:
    """Run one fake forward/backward of ``build()`` and measure it (see the module docstring).

    The batch is ``(input_ids, labels)`` of ``shape.micro_batch`` x ``seq`` tokens below ``vocab``, or
    what ``inputs`` makes (a run's own batch: `xirang_ds.memory.calibration`); then a forward whose
    output holds no loss is traced with a stand-in (`Trace.loss_outside`). The ``session``'s plugins
    apply what they change in forward and backward to the fake model meanwhile (`Plugin.trace_context`)."""
    from xirang_ds.compat.torch import fake_tensor_mode
    from xirang_ds.memory.tracker import MemoryTracker, _tensors

    # a live model's copy may keep plain tensor attributes (a cached mask): fakified on first use
    mode = fake_tensor_mode(allow_non_fake_inputs=inputs is not None)
    outside = False
    with mode:
        model = _fake_model(build, shape.dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        if inputs is None:
            x = torch.randint(0, vocab, (shape.micro_batch, seq))
            y = torch.randint(0, vocab, (shape.micro_batch, seq))
            args, kwargs = (x, y), {}
        else:
            args, kwargs = inputs()
        batch = list(_tensors((args, kwargs)))
        tracker = MemoryTracker("cpu", fake=True)
        tracker.seed(model.parameters(), PARAMETERS)
        tracker.seed(batch, TEMPORARIES)
        base = tracker.live_bytes
        applied = contextlib.ExitStack()
        for plugin in (session.plugins if session is not None else ()):
            context = plugin.trace_context(model, tracker)
            if context is not None:
                applied.enter_context(context)
        emu = _EngineEmulation(shape, params, tracker)
        handles = [p.register_post_accumulate_grad_hook(emu.hook) for p in params]
        micro_steps = 2 if shape.grad_accum > 1 else 1  # the second carries the first's gradients
        fwd_report = bwd_report = None
        with applied, tracker:
            for micro in range(micro_steps):
                if micro:
                    emu.end_micro_step()
                    tracker.mark([p.grad for p in params if p.grad is not None], GRADIENTS)
                fwd = tracker.open_window()
                tracker.set_phase("forward")
                output = model(*args, **kwargs)
                loss = loss_of(output)
                if loss is None and inputs is None:
                    raise EstimateError("the model's forward(input_ids, labels) must return a scalar loss")
                held = None
                if loss is None:  # the caller holds the output while its loss runs and backward
                    outside = True
                    loss, held = _stand_in_loss(output), output
                del output
                tracker.set_phase("backward")
                report = fwd.report()
                if micro == 0:
                    activations = tracker.live_bytes - base
                if fwd_report is None or report.peak_bytes >= fwd_report.peak_bytes:
                    fwd_report = report
                bwd = tracker.open_window()
                emu.backward_start = tracker.open_window()
                loss.backward()
                emu.end_backward()
                del loss, held
                report = bwd.report()
                if bwd_report is None or report.peak_bytes >= bwd_report.peak_bytes:
                    bwd_report = report
        for h in handles:
            h.remove()
    batch_bytes = sum(t.numel() * t.element_size() for t in batch if t.device.type == "cpu")
    param_bytes = fwd_report.by_category[PARAMETERS]

    def above(report) -> dict:
        out = dict(report.by_category)
        out[PARAMETERS] -= param_bytes
        out[TEMPORARIES] -= batch_bytes
        return out

    start = max(emu.backward_starts, key=lambda r: r.peak_bytes) if emu.backward_starts else bwd_report
    return Trace(forward_peak=fwd_report.peak_bytes - base, activations=activations,
                 backward_peak=bwd_report.peak_bytes - base, backward_by_category=above(bwd_report),
                 backward_start_by_category=above(start), forward_by_category=above(fwd_report), inputs=batch_bytes,
                 param_numels=[p.numel() for p in params], accumulates=micro_steps > 1, loss_outside=outside)


# ------------------------------------------------------------------------------------------------
# model states and the step


@dataclass
class Estimate:
    """A predicted per-rank peak and its breakdown.

    Attributes:
        predicted_peak_bytes: the largest phase.
        by_category: bytes per category at the predicted peak.
        peak_phase: ``forward``, ``backward`` or ``optimizer_step``.
        phases: each phase's total and breakdown.
        notes: what the estimate assumed.
        korthikanti_activations: the paper's formula for a standard transformer, for reference.
    """

    predicted_peak_bytes: int
    by_category: dict[str, int]
    peak_phase: str
    phases: dict[str, dict[str, int]]
    notes: list[str]
    korthikanti_activations: Optional[int] = None

    def as_dict(self) -> dict:
        return {"predicted_peak_bytes": self.predicted_peak_bytes, "by_category": dict(self.by_category),
                "peak_phase": self.peak_phase,
                "phases": {k: dict(v) for k, v in self.phases.items()}, "notes": list(self.notes),
                "korthikanti_activations": self.korthikanti_activations}


def _cat(**parts: int) -> dict[str, int]:
    out = {c: 0 for c in CATEGORIES}
    for k, v in parts.items():
        out[k] += int(v)
    return out


def _add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {c: a.get(c, 0) + b.get(c, 0) for c in CATEGORIES}


def model_states(shape: RunShape, numels: list[int]) -> dict[str, int]:
    """Resident bytes between steps: parameters (16-bit and fp32 master) and optimizer states."""
    total = sum(numels)
    lp = shape.lp_bytes
    part = partition_numel(total, shape.world_size)
    padded = part * shape.world_size
    groups = 1
    if shape.stage == 0:
        master = 4 * total if shape.dtype != torch.float32 else 0
        return _cat(parameters=lp * total + master, optimizer_states=8 * total + 4 * len(numels))
    if shape.stage in (1, 2):
        master = 0 if shape.shared_masters else 4 * part
        return _cat(parameters=lp * padded + master, optimizer_states=8 * part + 4 * groups)
    # ZeRO 3: 16-bit partition, fp32 partition, states over the partition
    return _cat(parameters=lp * part + 4 * part, optimizer_states=8 * part + 4 * groups)


def _adam_temporaries(shape: RunShape, tensors: list[int]) -> int:
    """Peak temporaries of one Adam step over tensors of these numels (fp32)."""
    if shape.adam_impl == "fused" or not tensors:
        return 0
    if shape.adam_impl == "foreach":
        return 4 * sum(tensors)  # _foreach_sqrt of every exp_avg_sq, then in-place ops
    return 2 * 4 * max(tensors)  # sqrt() and its quotient, one tensor at a time


def estimate_run(build: Callable[[], torch.nn.Module], ds_config: dict, seq: Optional[int] = None,
                 vocab: Optional[int] = None, world_size: int = 1, device: str = "cpu",
                 inputs: Optional[Inputs] = None) -> Estimate:
    """Estimate one rank's peak for ``build()`` trained with ``ds_config`` on ``world_size`` ranks, on
    ``seq`` tokens below ``vocab`` per sample or on the batch ``inputs`` makes (`trace_model`).

    With a ``"xirang"`` block, the enabled plugins first edit the ds_config as they would at
    ``initialize`` (bucket sizes), then adjust the phases (`Plugin.adjust_estimate`).
    """
    session = _session_for(build, ds_config, world_size)
    shape = _plugin_shape(session, ds_config, world_size, device)
    if shape.stage not in (0, 1, 2, 3):
        raise EstimateError(f"zero_optimization.stage must be 0-3; got {shape.stage}")
    trace = trace_model(build, shape, seq, vocab, inputs, session)
    est = _estimate(session, shape, trace)
    if trace.loss_outside:
        est.notes.append("the forward returns no loss: what the loss computed outside it keeps is not traced")
    return est


def estimate_states(model: torch.nn.Module, ds_config: dict, world_size: int = 1, device: str = "cpu") -> Estimate:
    """`estimate_run` without activations: model states, gradients, buffers and the optimizer step
    of ``model`` (its parameters' sizes only: it may live on the meta device), for what no forward
    can be traced for (``"preset": "auto"`` at initialize, which has the model but not its inputs).

    The trace is replaced by what backward leaves without activations: every gradient at ZeRO 0/1,
    the reduced partition and the reduction buckets at ZeRO 2 (`_EngineEmulation`).
    """
    session = _session_for(lambda: model, ds_config, world_size, fake=False)
    shape = _plugin_shape(session, ds_config, world_size, device)
    if shape.stage not in (0, 1, 2, 3):
        raise EstimateError(f"zero_optimization.stage must be 0-3; got {shape.stage}")
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    total = sum(numels)
    backward = _cat()
    if shape.stage in (0, 1):
        backward = _cat(gradients=shape.lp_bytes * total)
    elif shape.stage == 2:
        buffers = (2 if shape.overlap_comm else 1) if shape.contiguous_gradients else 0
        backward = _cat(gradients=shape.lp_bytes * _fullest_rank(shape, numels).numel,
                        comm_buffers=buffers * shape.reduce_bucket * shape.lp_bytes)
    trace = Trace(forward_peak=0, activations=0, backward_peak=sum(backward.values()), backward_by_category=backward,
                  forward_by_category=_cat(), inputs=0, param_numels=numels)
    return _estimate(session, shape, trace)


def _plugin_shape(session: Any, ds_config: dict, world_size: int, device: str) -> "RunShape":
    shape = RunShape.from_ds_config(ds_config, world_size, device)
    if session is not None:
        # Buckets as the plugins sized them; stage, precision and the optimizer as the user asked
        # (a plugin that takes a part over, like grad_release, hands DeepSpeed stage 0 in fp32 and
        # models its own layout in adjust_estimate).
        edited = RunShape.from_ds_config(session.ds_config, world_size, device)
        shape = dataclasses.replace(shape, reduce_bucket=edited.reduce_bucket, allgather_bucket=edited.allgather_bucket,
                                    prefetch_bucket=edited.prefetch_bucket, overlap_comm=edited.overlap_comm)
        for plugin in session.plugins:
            shape = plugin.estimate_shape(shape)
    return shape


STEP_PREPARE = "step_prepare"
"""The part of ``engine.step()`` before the basic optimizer's update, a phase of its own while
plugins adjust the estimate (`Plugin.adjust_estimate`), then merged into ``optimizer_step``."""
BACKWARD_START = "backward_start"
"""Backward until its first gradient is ready (`Trace.backward_start_by_category`), a phase of its
own while plugins adjust the estimate, then merged into ``backward``: the larger is backward's peak."""


def _estimate(session: Any, shape: "RunShape", trace: Trace) -> Estimate:
    """The phases from a trace (or what stands for one), the step, and the plugins' adjustments."""
    numels = trace.param_numels
    total = sum(numels)
    n, lp = shape.world_size, shape.lp_bytes
    states = model_states(shape, numels)
    notes = [f"ZeRO {shape.stage}, {str(shape.dtype).replace('torch.', '')}, micro-batch {shape.micro_batch}, "
             f"{n} rank(s), {total:,} parameters", f"optimizer step temporaries: {shape.adam_impl}"]
    notes += [f"zero_optimization.{k}: host offload is not modelled (the estimate keeps on the device what "
              "it moves to the host); measure with xirang-ds bench" for k in shape.offloaded]
    inputs = _cat(temporaries=trace.inputs)
    accum = _cat()  # gradients carried into the next micro-step's forward (unless the trace holds them)
    if shape.grad_accum > 1 and not trace.accumulates:
        if shape.stage in (0, 1):
            accum = _cat(gradients=lp * total)
        elif shape.stage == 2:
            accum = _cat(gradients=lp * _fullest_rank(shape, numels).numel)
    fwd = _add(_add(states, inputs), _add(accum, trace.forward_by_category))
    bwd = _add(_add(states, inputs), trace.backward_by_category)
    start = _add(_add(states, inputs), trace.backward_start_by_category or trace.backward_by_category)
    if shape.stage == 2:
        bwd, start = _add(bwd, accum), _add(start, accum)
    if shape.stage == 0:
        # engine.allreduce_gradients at the boundary (buffered_allreduce_fallback): every gradient
        # alive plus a flattened copy of up to 5e8 elements (engine.py allreduce_and_copy), after
        # the activations are gone; it runs even on one rank.
        flat = min(total, int(5e8))
        reduce = _add(_add(states, inputs), _cat(gradients=lp * total, temporaries=lp * flat))
        if sum(reduce.values()) > sum(bwd.values()):
            bwd = reduce
    if shape.stage == 3:
        fwd, bwd = _stage3_working_set(shape, numels, fwd, bwd)
        start = _stage3_working_set(shape, numels, start, start)[0]
    step, prepare = _optimizer_step(shape, states, numels)
    phases = {"forward": fwd, "backward": bwd, "optimizer_step": step, BACKWARD_START: start}
    if prepare is not None:
        phases[STEP_PREPARE] = prepare
    if session is not None:
        notes += session.summary_left_out()
    phases = _apply_plugins(session, phases, shape, numels, notes)
    for part, whole in ((STEP_PREPARE, "optimizer_step"), (BACKWARD_START, "backward")):
        cats = phases.pop(part, None)  # both are inside the same call; the larger is its peak
        if cats is not None and sum(cats.values()) > sum(phases[whole].values()):
            phases[whole] = cats
    totals = {k: sum(v[c] for c in CATEGORIES if c != "host") for k, v in phases.items()}
    peak_phase = max(totals, key=totals.__getitem__)
    return Estimate(predicted_peak_bytes=totals[peak_phase], by_category=phases[peak_phase], peak_phase=peak_phase,
                    phases={k: {**v, "total": totals[k]} for k, v in phases.items()}, notes=notes)


def _optimizer_step(shape: RunShape, states: dict, numels: list[int]) -> tuple[dict, Optional[dict]]:
    """``engine.step()`` at the boundary: the wrapper's preparation of the gradients (``None`` where
    it allocates nothing), then the basic optimizer's update.

    ZeRO 1-3 (stage_1_and_2.py / stage3.py ``step``): the reduced 16-bit gradient partition is
    flattened into a copy, the copy upcast to the fp32 gradient of the master partition, then the
    16-bit gradients are freed before the update. ZeRO 0 in 16 bits with DeepSpeed's fused Adam
    (``FP16_Optimizer``): every gradient upcast one by one, then flattened into one fp32 gradient.
    ZeRO 0 with torch's Adam (``FP16_UnfusedOptimizer``) upcasts into each master's ``.grad``.
    """
    total = sum(numels)
    lp = shape.lp_bytes
    part = partition_numel(total, shape.world_size)
    sixteen = shape.dtype != torch.float32
    if shape.stage == 0:
        grads = lp * total + (4 * total if sixteen else 0)
        update = _add(states, _cat(gradients=grads, temporaries=_adam_temporaries(shape, numels)))
        prepare = None
        if sixteen and shape.adam_impl == "fused":
            prepare = _add(states, _cat(gradients=lp * total + 4 * total, temporaries=4 * total))
        return update, prepare
    resident = _cat()
    if shape.stage == 3:  # the 16-bit gradient partition and the reduction bucket stay allocated
        resident = _cat(gradients=lp * part, comm_buffers=lp * shape.reduce_bucket)
        prepare = _add(_add(states, resident), _cat(gradients=4 * part if sixteen else 0, temporaries=lp * part))
    else:
        # group by group: its 16-bit gradients flattened and upcast, then freed before the next group's
        rank = _fullest_rank(shape, numels)
        parts = [partition_numel(sum(numels[i] for i in g), shape.world_size)
                 for g in (shape.groups or (tuple(range(len(numels))),))]
        points = [_cat(gradients=lp * sum(rank.by_group[g:]) + (4 * sum(parts[:g + 1]) if sixteen else 0),
                       temporaries=lp * parts[g]) for g in range(len(parts))]
        prepare = _add(states, max(points, key=lambda c: sum(c.values())))
    update = _add(_add(states, resident), _cat(gradients=4 * part, temporaries=_adam_temporaries(shape, [part])))
    return update, prepare


def _session_for(build: Callable[[], torch.nn.Module], ds_config: dict, world_size: int, fake: bool = True) -> Any:
    """A session over a fake copy of the model (``fake``; else over ``build()`` itself) whose plugins
    have edited a copy of the ds_config."""
    import copy

    from xirang_ds.compat.torch import fake_tensor_mode
    from xirang_ds.config.fit import fit_block
    from xirang_ds.config.loader import BLOCK_KEY
    from xirang_ds.session import Session

    if BLOCK_KEY not in ds_config:
        return None
    fitted = fit_block(ds_config[BLOCK_KEY], ds_config)  # what initialize would run (a preset fits the ds_config)
    session = Session(fitted.config, copy.deepcopy(ds_config), world_size=world_size, left_out=fitted.left_out)
    with fake_tensor_mode() if fake else contextlib.nullcontext():
        session.model = build()
        session.prepare_ds_config()
    return session


def _apply_plugins(session: Any, phases: dict, shape: RunShape, numels: list[int], notes: list[str]) -> dict:
    """Let each enabled plugin of the block adjust the phases (`Plugin.adjust_estimate`)."""
    if session is None:
        return phases
    for plugin in session.plugins:
        adjusted = plugin.adjust_estimate(phases, shape, numels)
        if adjusted is None:
            notes.append(f"{plugin.section}: its effect on memory is not modelled; measure with xirang-ds bench")
        else:
            phases = adjusted
    return phases


def _stage3_working_set(shape: RunShape, numels: list[int], fwd: dict, bwd: dict) -> tuple[dict, dict]:
    """ZeRO 3: parameters live as partitions; the trace counted them whole, gathered. Replace the
    whole 16-bit parameters by the gathered working set and add the persistent reduction buffers.

    The working set at the end of forward, where activations peak, is what the parameter coordinator
    keeps (partitioned_param_coordinator.py ``__params_to_release``, once the trace is complete, from
    the second step): a parameter released after its forward is kept gathered when its next use (in
    backward) comes within ``stage3_max_reuse_distance`` elements of fetches, about twice the
    parameters after it in forward; with DeepSpeed's default (1e9) every model under 5e8
    parameters stays gathered from forward to backward. Beside them: the prefetch bucket and the
    module in use, and the persistent small parameters (``stage3_param_persistence_threshold``).
    On one rank the partition is the whole parameter and nothing is gathered."""
    lp = shape.lp_bytes
    total = sum(numels)
    persistent = sum(x for x in numels if x <= shape.persistence_threshold)
    released = [x for x in numels if x > shape.persistence_threshold]
    kept, after = 0, 0
    for x in reversed(released):  # parameters in forward order: the last ones are reused soonest
        if 2 * after < shape.max_reuse_distance:
            kept += x
        after += x
    largest = max(numels)
    gathered = min(sum(released), kept + max(shape.prefetch_bucket, largest) + largest) + persistent
    if shape.world_size == 1:
        gathered = 0  # one rank's partition is the whole parameter: gathering allocates nothing
    extra = _cat(parameters=lp * gathered,
                 comm_buffers=lp * shape.reduce_bucket,
                 gradients=lp * partition_numel(total, shape.world_size))
    return _add(fwd, extra), _add(bwd, extra)


def korthikanti_activations(layers: int, seq: int, batch: int, hidden: int, heads: int) -> int:
    """Activation bytes of a standard 16-bit transformer without recomputation (Korthikanti et al.
    2022, eq. 1 with t = 1): s·b·h·(34 + 5·a·s/h) per layer."""
    return int(layers * seq * batch * hidden * (34 + 5 * heads * seq / hidden))


def estimate_spec(model: Union[str, Any], ds_config: dict, world_size: int = 1, device: str = "cpu") -> Estimate:
    """`estimate_run` for a ``--model`` spec (built-in name, ``gpt:...`` or ``module:factory``);
    ``"preset": "auto"`` is resolved first (`xirang_ds.config.auto`), its choice a note."""
    from xirang_ds.config.auto import choose_for_spec
    from xirang_ds.models import ModelSpec, build_model, parse_model_spec

    ds_config, choice = choose_for_spec(ds_config, model, world_size, device)
    spec = parse_model_spec(model) if isinstance(model, str) else model
    if isinstance(spec, ModelSpec):
        build = lambda: build_model(spec)  # noqa: E731
        seq, vocab = spec.seq, spec.vocab
    else:
        build = spec
        probe = None
        seq = int(getattr(probe, "seq", 128))
        vocab = 256
    est = estimate_run(build, ds_config, seq, vocab, world_size, device)
    if choice:
        est.notes.append(choice)
    if isinstance(spec, ModelSpec):
        shape = RunShape.from_ds_config(ds_config, world_size, device)
        est.korthikanti_activations = korthikanti_activations(spec.layers, spec.seq, shape.micro_batch,
                                                              spec.hidden, spec.heads)
    return est


def recalibrate(estimate: Estimate, measured_by_category: dict[str, int], measured_peak: int) -> dict:
    """Compare with a measured peak: the error and a factor per category (measured / predicted)."""
    factors = {}
    for c in CATEGORIES:
        p = estimate.by_category.get(c, 0)
        m = measured_by_category.get(c, 0)
        if p:
            factors[c] = m / p
    return {"predicted_peak_bytes": estimate.predicted_peak_bytes, "measured_peak_bytes": measured_peak,
            "error": (estimate.predicted_peak_bytes - measured_peak) / measured_peak, "factors": factors}


def format_estimate(est: Estimate) -> str:
    """The estimate as a table: each phase's total and the breakdown at the predicted peak."""
    from xirang_ds.config.types import format_bytes

    lines = ["predicted per-rank peak: " + format_bytes(est.predicted_peak_bytes) +
             f" ({est.predicted_peak_bytes:,} bytes) in {est.peak_phase}"]
    lines += ["  " + n for n in est.notes]
    lines.append(f"{'category':<18}{'forward':>12}{'backward':>12}{'optimizer_step':>16}")
    for c in CATEGORIES:
        vals = [est.phases[p].get(c, 0) for p in ("forward", "backward", "optimizer_step")]
        if any(vals):
            lines.append(f"{c:<18}" + "".join(f"{format_bytes(v):>{w}}" for v, w in zip(vals, (12, 12, 16))))
    totals = [est.phases[p]["total"] for p in ("forward", "backward", "optimizer_step")]
    lines.append(f"{'total':<18}" + "".join(f"{format_bytes(v):>{w}}" for v, w in zip(totals, (12, 12, 16))))
    if est.korthikanti_activations is not None:
        lines.append(f"(Korthikanti et al. formula for 16-bit activations of a standard transformer: "
                     f"{format_bytes(est.korthikanti_activations)}; the trace measured this model's own)")
    return "\n".join(lines)
