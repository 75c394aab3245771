"""The fake trace: the model's own activations, temporaries and gradients, measured without memory.

One forward and backward of the real model under ``FakeTensorMode`` (no memory, no compute; a few hundred
milliseconds whatever the model size) measured by the same live-storage tracker that measures real runs
(`xirang_ds.memory.tracker`). DeepSpeed's gradient handling is emulated during that trace by gradient hooks
that allocate what the engine allocates when it allocates it: the reduction bucket at the first gradient
(ZeRO 1/2), ZeRO-2's gradient partition at the first bucket reduction, gradients moved out of
``param.grad`` (ZeRO 2). So the activation term is exact for any architecture (the estimate reports the
Korthikanti et al. formula beside it for reference: `xirang_ds.planning.estimator`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from xirang_ds.compat.torch import fake_tensor_mode
from xirang_ds.memory.device_profile import OpTally
from xirang_ds.memory.categories import COMM_BUFFERS, GRADIENTS, PARAMETERS, TEMPORARIES
from xirang_ds.memory.run_shape import EstimateError, RunShape, fullest_rank
from xirang_ds.memory.storages import tensors_in
from xirang_ds.memory.sweep import Sweep, most_beside, record_sweep
from xirang_ds.roles import ChangesTrace


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
        layer_temporaries: the most temporaries alive at once in backward from its first gradient on (the
            gradients of the layers' activations as autograd passes them down, beside what they saved; the
            loss's gradient comes before): what stays with a plan that moves the backward's worst point
            from the loss into a layer.
        layer_buffers: the most bytes of the engine's communication buffers alive from backward's first gradient on
            (ZeRO 1 and 2's reduction buckets, made as it is taken): what a layer's backward has beside it where
            the backward's worst point with every activation kept comes before them.
        accumulates: the phases are the larger of two micro-steps of one accumulation window, so
            they hold what the engine carries from one micro-step to the next.
        loss_outside: the forward returned no loss; a stand-in was traced, and what the run's own
            loss keeps for backward is not in the activations.
        ops: the ops of one micro-step's forward and backward (the engine's emulated gradient handling
            included), counted to be priced by a device profile (`xirang_ds.planning.step_time`).
        backward_ops: those of them in its backward (what a second backward of the micro-step runs again).
        grad_arrivals: per micro-step, ``(clock, index)`` of each gradient hook on the tracker's clock, in the
            order autograd finished them (``index`` into ``param_numels``): where in backward each gradient
            was taken, so that a plugin that holds gradients its own way can say what it holds at any point.
        backward_clocks: the tracker's clock as each micro-step's backward started.
        backward_sweeps: per micro-step, its backward's own bytes step by step (`xirang_ds.memory.sweep`).
        forward_calls: ``(clock, indices)`` of each module called in the first micro-step's forward, in order, with
            the parameters (into ``param_numels``) it owns itself: where ZeRO 3 fetches
            (`xirang_ds.memory.zero3_fetch`; recorded at ZeRO 3 on several ranks, or with ``offload_param``).
        forward_sweep: that forward's own bytes step by step (with ``forward_calls`` only).
        backward_calls: ``(clock, indices)`` of each module as its backward starts in the first micro-step (the
            first gradient of one of its outputs), in order, with the parameters it owns itself.
        unreleased_in_backward: the parameters of those modules whose inputs need no gradient (a token
            embedding): DeepSpeed's post-backward function, applied to a module's inputs, never runs for them, so
            ZeRO 3 does not release them after their backward.
    """

    forward_peak: int
    activations: int
    backward_peak: int
    backward_by_category: dict
    forward_by_category: dict
    inputs: int
    backward_start_by_category: dict = field(default_factory=dict)
    param_numels: list[int] = field(default_factory=list)
    layer_temporaries: int = 0
    layer_buffers: int = 0
    accumulates: bool = False
    loss_outside: bool = False
    ops: Optional[OpTally] = None
    backward_ops: Optional[OpTally] = None
    grad_arrivals: list[list[tuple[int, int]]] = field(default_factory=list)
    backward_clocks: list[int] = field(default_factory=list)
    backward_sweeps: list[Sweep] = field(default_factory=list)
    forward_calls: list[tuple[int, list[int]]] = field(default_factory=list)
    forward_sweep: Optional[Sweep] = None
    backward_calls: list[tuple[int, list[int]]] = field(default_factory=list)
    unreleased_in_backward: list[int] = field(default_factory=list)

    def arrived(self, clock: int) -> list[int]:
        """The indices (into ``param_numels``) of the gradients hooked in the backward that ``clock`` is in,
        before ``clock``, in their order."""
        micro = max((i for i, start in enumerate(self.backward_clocks) if start <= clock), default=None)
        if micro is None or micro >= len(self.grad_arrivals):
            return []
        return [index for at, index in self.grad_arrivals[micro] if at < clock]

    def most_beside(self, held: Callable[[list[int]], int],
                    at_arrival: Optional[Callable[[list[int]], dict]] = None) -> Optional[tuple[int, dict, int]]:
        """The point of backward where its own bytes (activations, temporaries; ``at_arrival``'s as a gradient is
        taken) and ``held(arrived)`` are the most together, over the micro-steps (`sweep.most_beside`): ``(total,
        own by category, held)``; ``None`` without sweeps."""
        points = [most_beside(s, a, held, at_arrival) for s, a in zip(self.backward_sweeps, self.grad_arrivals)]
        return max(points, key=lambda p: p[0], default=None)


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
        self.layers: Any = None  # a tracker window opened at that first gradient, to the end of backward
        self.layer_temporaries = 0  # the most temporaries it saw (`Trace.layer_temporaries`)
        self.layer_buffers = 0  # and communication buffers (`Trace.layer_buffers`)
        self.index = {id(p): i for i, p in enumerate(params)}
        self.arrivals: list[list[tuple[int, int]]] = []  # `Trace.grad_arrivals`
        self.backward_clocks: list[int] = []
        rank = fullest_rank(shape, [p.numel() for p in params])
        self.partition_numel = rank.numel
        self.in_partition = {id(params[i]) for i in rank.params}

    def start_backward(self) -> None:
        """A micro-step's backward starts (`Trace.backward_clocks`)."""
        self.backward_start = self.tracker.open_window()
        self.backward_clocks.append(self.tracker.clock)
        self.arrivals.append([])

    def hook(self, param: torch.Tensor) -> None:
        shape = self.shape
        self.arrivals[-1].append((self.tracker.clock, self.index[id(param)]))
        if self.backward_start is not None:  # the first gradient: what backward held before the engine acts
            self.backward_starts.append(self.backward_start.report())
            self.backward_start = None
            self.layers = self.tracker.open_window()
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
        if self.shape.host_optimizer:
            return  # each reduced gradient goes to its fp32 partition in host memory (`model_states`)
        if not any(getattr(t, "_xirang_partition", False) for t in self.keep):
            with self.tracker.scope(GRADIENTS):
                t = torch.empty(self.partition_numel, dtype=self.shape.dtype)
            t._xirang_partition = True  # type: ignore[attr-defined]
            self.keep.append(t)

    def end_backward(self) -> None:
        """ZeRO 2's epilogue: the last bucket is reduced into the partition, the gradients cleared."""
        if self.layers is not None:
            peaks = self.layers.category_peaks()
            self.layer_temporaries = max(self.layer_temporaries, peaks[TEMPORARIES])
            self.layer_buffers = max(self.layer_buffers, peaks[COMM_BUFFERS])
            self.layers.close()
            self.layers = None
        if self.shape.stage == 2 and self.bucket_fill:
            self._reduce()
            self.bucket_fill = 0
        for p in self.pending:
            p.grad = None
        self.pending.clear()


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
    floats = [t for t in tensors_in(output) if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise EstimateError("the model's forward returns no loss and no tensor that needs a gradient")
    return sum(t.sum() for t in floats)


def trace_model(build: Callable[[], torch.nn.Module], shape: RunShape, seq: Optional[int] = None,
                vocab: Optional[int] = None, inputs: Optional[Inputs] = None, session: Any = None) -> Trace:
    """Run one fake forward/backward of ``build()`` and measure it (see the module docstring).

    The batch is ``(input_ids, labels)`` of ``shape.micro_batch`` x ``seq`` tokens below ``vocab``, or
    what ``inputs`` makes (a run's own batch: `xirang_ds.memory.calibration`); then a forward whose
    output holds no loss is traced with a stand-in (`Trace.loss_outside`). The ``session``'s plugins
    apply what they change in forward and backward to the fake model meanwhile (`xirang_ds.roles.ChangesTrace`)."""
    from xirang_ds.memory.tracker import MemoryTracker, tensors_in

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
        batch = list(tensors_in((args, kwargs)))
        tracker = MemoryTracker("cpu", fake=True)
        tracker.seed(model.parameters(), PARAMETERS)
        tracker.seed(batch, TEMPORARIES)
        base = tracker.live_bytes
        seeded, sweeps = tracker.clock, []
        applied = contextlib.ExitStack()
        changing = session.plugins_with(ChangesTrace) if session is not None else []
        for plugin in changing:
            context = plugin.trace_context(model, tracker)
            if context is not None:
                applied.enter_context(context)
        emu = _EngineEmulation(shape, params, tracker)
        handles = [p.register_post_accumulate_grad_hook(emu.hook) for p in params]
        index = {id(p): i for i, p in enumerate(params)}
        calls: list[tuple[int, list[int]]] = []
        backward_calls: list[tuple[int, list[int]]] = []
        unreleased: list[int] = []

        def owned(module: torch.nn.Module) -> list[int]:
            return [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]

        def called(module: torch.nn.Module, args: Any) -> None:
            if tracker.phase == "forward" and tracker.measuring and not calls_done:  # not a profiling pass
                calls.append((tracker.clock, owned(module)))

        def returned(module: torch.nn.Module, args: Any, output: Any) -> None:
            # as DeepSpeed's pre-backward function on the outputs: the module's backward starts at the first
            # gradient of one of them
            if tracker.phase != "forward" or not tracker.measuring or calls_done:
                return
            started: list[bool] = []
            fed = any(t.requires_grad for t in tensors_in(args))

            def grad_ready(grad_outputs: Any) -> None:
                if not started and not backward_done:
                    started.append(True)
                    backward_calls.append((tracker.clock, owned(module)))
                    if not fed:
                        unreleased.extend(owned(module))

            for node in dict.fromkeys(t.grad_fn for t in tensors_in(output) if t.grad_fn is not None):
                node.register_prehook(grad_ready)  # on the node, not the tensor: a hooked tensor changes nothing

        calls_done = backward_done = False
        fetches = shape.fetches_weights  # where ZeRO 3 fetches (`xirang_ds.memory.zero3_fetch`)
        if fetches:
            handles += [m.register_forward_pre_hook(called) for m in model.modules()]
            handles += [m.register_forward_hook(returned) for m in model.modules()]
        forward_sweep = None
        micro_steps = 2 if shape.grad_accum > 1 else 1  # the second carries the first's gradients
        fwd_report = bwd_report = None
        forward_ops, backward_ops = OpTally(), OpTally()
        tracker.on_op = forward_ops.add  # the first micro-step's (one forward and backward; not while paused)
        with applied, tracker:
            for micro in range(micro_steps):
                if micro:
                    tracker.on_op = None
                    emu.end_micro_step()
                    tracker.mark([p.grad for p in params if p.grad is not None], GRADIENTS)
                fwd = tracker.open_window()
                tracker.set_phase("forward")
                forward_clock = tracker.clock
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
                    calls_done = True
                    if fetches:
                        forward_sweep = record_sweep(tracker, forward_clock, tracker.clock, seeded)
                if fwd_report is None or report.peak_bytes >= fwd_report.peak_bytes:
                    fwd_report = report
                bwd = tracker.open_window()
                if micro == 0:
                    tracker.on_op = backward_ops.add
                emu.start_backward()
                loss.backward()
                emu.end_backward()
                backward_done = True
                tracker.on_op = None
                del loss, held
                report = bwd.report()
                if bwd_report is None or report.peak_bytes >= bwd_report.peak_bytes:
                    bwd_report = report
                sweeps.append(record_sweep(tracker, emu.backward_clocks[-1], tracker.clock, seeded))
        for h in handles:
            h.remove()
    ops = OpTally()
    for part in (forward_ops, backward_ops):
        ops.ops_from(part)
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
                 param_numels=[p.numel() for p in params], accumulates=micro_steps > 1, loss_outside=outside,
                 ops=ops, backward_ops=backward_ops, layer_temporaries=max(0, emu.layer_temporaries - batch_bytes),
                 layer_buffers=emu.layer_buffers,
                 grad_arrivals=emu.arrivals,
                 backward_clocks=emu.backward_clocks, backward_sweeps=sweeps, forward_calls=calls,
                 forward_sweep=forward_sweep, backward_calls=backward_calls, unreleased_in_backward=unreleased)
