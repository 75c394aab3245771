"""Connect a `MemoryTracker` to a training loop: phases from hooks, roles from DeepSpeed's buffers.

DeepSpeed keeps model states in its optimizer wrappers under attribute names that differ by ZeRO
stage and precision mode. `xirang_ds.compat.deepspeed.OPTIMIZER_ATTRIBUTES_BY_ROLE` names them, checked against deepspeed 0.16-0.19
(``runtime/zero/stage_1_and_2.py``, ``runtime/zero/stage3.py``, ``runtime/bf16_optimizer.py``,
``runtime/fp16/{fused,unfused}_optimizer.py``); ``tests/memory/test_deepspeed_tracker.py`` fails when a
DeepSpeed release moves them, because its byte accounting no longer closes.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from xirang_ds.compat.deepspeed import (OFFLOADED_OPTIMIZER_ATTRIBUTES, OFFLOADED_PARAM_ATTRIBUTES,
                                        OPTIMIZER_ATTRIBUTES_BY_ROLE, offloads_optimizer, offloads_params,
                                        sub_groups_kept_on_device)
from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import COMM_BUFFERS, GRADIENTS, HOST, OPTIMIZER_STATES, PARAMETERS
from xirang_ds.memory.compiled_calls import watch_compiled
from xirang_ds.memory.tracker import MemoryTracker


def _walk(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside containers and DeepSpeed's small helper objects (an IPG bucket's buffer)."""
    if depth > 4 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v, depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("deepspeed"):
        for v in vars(obj).values():
            yield from _walk(v, depth + 1)


def engine_tensors(wrapper: Any, category: str) -> list[torch.Tensor]:
    """Tensors of ``category`` held by a DeepSpeed optimizer wrapper, by attribute name."""
    out: list[torch.Tensor] = []
    for name in OPTIMIZER_ATTRIBUTES_BY_ROLE[category]:
        out.extend(_walk(getattr(wrapper, name, None)))
    return out


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Tensors in ``optimizer.state`` (and nested optimizers' states)."""
    state = getattr(optimizer, "state", None)
    if state is None:
        return []
    return list(_walk(dict(state) if not isinstance(state, dict) else state))


class TrainingWatch:
    """Drives a tracker's phases and roles from a model, an optimizer and (optionally) a DeepSpeed
    engine. Every hook it installs is removed by `remove`.

    Args:
        tracker: the tracker to feed.
        model: the root module (``engine.module`` under DeepSpeed).
        basic_optimizer: the ``torch.optim`` object whose ``step`` marks the optimizer phase.
        wrapper: DeepSpeed's optimizer wrapper (``engine.optimizer``), or ``None``.
        roles: providers of ``(category, tensors)`` pairs for tensors held outside DeepSpeed's
            structures (`Session.add_memory_roles`); marked with the model states.
    """

    def __init__(self, tracker: MemoryTracker, model: torch.nn.Module, basic_optimizer: Any = None,
                 wrapper: Any = None, engine: Any = None,
                 roles: Sequence[Callable[[], Iterable[tuple[str, Any]]]] = ()):
        self.tracker = tracker
        self.roles = roles
        self.model = model
        self.basic_optimizer = basic_optimizer
        self.wrapper = wrapper if wrapper is not basic_optimizer else None
        self.offloaded = offloads_optimizer(self.wrapper)  # DeepSpeed's optimizer in host memory
        self._host_step: Any = None  # the tracker's host tier while an offloaded optimizer steps
        self._handles: list[Any] = []
        self._engine = engine
        self._comm_scanned = False
        self.on_step_end: list[Any] = []
        self._handles.append(model.register_forward_pre_hook(self._forward_pre))
        self._handles.append(model.register_forward_hook(self._forward_post))
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        if basic_optimizer is not None and hasattr(basic_optimizer, "register_step_pre_hook"):
            self._handles.append(basic_optimizer.register_step_pre_hook(self._step_pre))
            self._handles.append(basic_optimizer.register_step_post_hook(self._step_post))
        self._handles += watch_compiled(tracker, model)  # compiled modules run compiled under the tracker
        if engine is not None:
            if callable(getattr(engine, "compile", None)):
                self._handles.append(wrap_method(engine, "compile", self._after_compile))
            # ZeRO's gradient partitions live from the first reduction to the start of step();
            # mark them when backward returns, while they are alive.
            self._handles.append(wrap_method(engine, "backward", self._after_backward))
            self._handles.append(wrap_method(engine, "step", self._after_step))
            if _zero_stage(engine) == 3:
                # ZeRO-3 gathers each module's parameters in its forward pre-hook; this hook runs after
                # DeepSpeed's (registered later), while they are gathered: they are parameters, not
                # activations, even where autograd keeps them until backward
                for module in model.modules():
                    if any(True for _ in module.parameters(recurse=False)):
                        self._handles.append(module.register_forward_pre_hook(self._gathered))

    # hooks --------------------------------------------------------------------------------
    def _forward_pre(self, module, args) -> None:
        if self.tracker.phase != "forward":
            self.tracker.set_phase("forward")
            self._comm_scanned = False

    def _gathered(self, module, args) -> None:
        if self.tracker.active:
            self.tracker.mark([p.data for p in module.parameters(recurse=False) if p.data.numel()], PARAMETERS)

    def _forward_post(self, module, args, output) -> None:
        self.tracker.set_phase("backward")

    def _grad_ready(self, param: torch.Tensor) -> None:
        t = self.tracker
        if not t.active:
            return
        if param.grad is not None:
            t.mark(param.grad, GRADIENTS)
        if self.wrapper is not None and not self._comm_scanned:
            # ZeRO allocates its reduction bucket in its own grad hook, which runs before ours.
            t.mark(engine_tensors(self.wrapper, COMM_BUFFERS), COMM_BUFFERS)
            self._comm_scanned = True

    def _after_backward(self, original, *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        self.mark_model_states()
        return result

    def _after_compile(self, original, *args: Any, **kwargs: Any) -> Any:
        """``engine.compile()``: the model's compiled call is watched from now on."""
        result = original(*args, **kwargs)
        self._handles += watch_compiled(self.tracker, self.model, self._handles)
        return result

    def _after_step(self, original, *args: Any, **kwargs: Any) -> Any:
        boundary = getattr(self._engine, "is_gradient_accumulation_boundary", None)
        if callable(boundary) and boundary():
            # the wrapper's work before the basic optimizer's step (flattening and upcasting the
            # gradients, the norm) is the step's, not backward's
            self.tracker.set_phase("optimizer_step")
        result = original(*args, **kwargs)
        if self.tracker.phase == "optimizer_step":
            self.tracker.set_phase("idle")  # between steps: data loading, logging
        return result

    def _step_pre(self, optimizer, args, kwargs) -> None:
        self.mark_model_states()
        self.tracker.set_phase("optimizer_step")
        if self.offloaded:  # DeepSpeed's offloaded update runs on the host: its temporaries are host memory
            self._host_step = self.tracker.host_tier()
            self._host_step.__enter__()

    def _step_post(self, optimizer, args, kwargs) -> None:
        if self._host_step is not None:
            self._host_step.__exit__(None, None, None)
            self._host_step = None
        self.tracker.mark(optimizer_state_tensors(optimizer), HOST if self.offloaded else OPTIMIZER_STATES)
        for fn in self.on_step_end:
            fn()

    # scans --------------------------------------------------------------------------------
    def mark_model_states(self) -> None:
        """Mark parameters, gradients, optimizer states and communication buffers by role."""
        t = self.tracker
        params = list(self.model.parameters())
        t.mark(params, PARAMETERS)
        t.mark([p.grad for p in params if p.grad is not None], GRADIENTS)
        if self.basic_optimizer is not None:
            masters = [p for g in self.basic_optimizer.param_groups for p in g["params"]]
            t.mark(masters, PARAMETERS)
            t.mark([p.grad for p in masters if p.grad is not None], GRADIENTS)
            t.mark(optimizer_state_tensors(self.basic_optimizer), OPTIMIZER_STATES)
        if self.wrapper is not None:
            for category in (PARAMETERS, GRADIENTS, COMM_BUFFERS):
                tensors = engine_tensors(self.wrapper, category)
                t.mark(tensors, category)
                if category == PARAMETERS:
                    t.mark([p.grad for p in tensors if p.grad is not None], GRADIENTS)
        for provider in self.roles:
            for category, tensors in provider():
                t.mark(tensors, category)
        if offloads_params(self.wrapper):  # ZeRO 3's 16-bit partitions in host memory (offload_param)
            t.mark([x for name in OFFLOADED_PARAM_ATTRIBUTES for x in _walk(getattr(self.wrapper, name, None))], HOST)
        if self.offloaded:  # on a CPU run the host tier is accounted apart, as on a GPU it is apart
            kept = {id(x) for x in sub_groups_kept_on_device(self.wrapper)}
            host = [x for name in OFFLOADED_OPTIMIZER_ATTRIBUTES for x in _walk(getattr(self.wrapper, name, None))
                    if id(x) not in kept]
            t.mark(host + [x.grad for x in host if x.grad is not None], HOST)
            if self.basic_optimizer is not None:
                t.mark(optimizer_state_tensors(self.basic_optimizer), HOST)

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()


def _zero_stage(engine: Any) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    try:
        return int(stage()) if callable(stage) else 0
    except Exception:  # not a DeepSpeed engine (Megatron's run, a stand-in)
        return 0


def watch_engine(tracker: MemoryTracker, engine: Any,
                 roles: Sequence[Callable[[], Iterable[tuple[str, Any]]]] = ()) -> TrainingWatch:
    """Seed the tracker with what the engine holds and drive it from the engine's hooks."""
    watch = TrainingWatch(tracker, engine.module, getattr(engine, "basic_optimizer", None),
                          getattr(engine, "optimizer", None), engine, roles=roles)
    seed_model_states(tracker, watch)
    return watch


def seed_model_states(tracker: MemoryTracker, watch: TrainingWatch) -> None:
    """Register what already exists before tracking starts, by role."""
    watch.mark_model_states()


def model_state_bytes(engine: Any) -> int:
    """Device bytes of the storages that hold an engine's model states now (each storage once):
    the allocator's figure on accelerators, a count of parameters, optimizer states and
    DeepSpeed's parameter and gradient buffers on CPU."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu":
        return int(acc.memory_allocated())
    tensors = list(engine.module.parameters())
    basic = getattr(engine, "basic_optimizer", None)
    if basic is not None:
        tensors += [p for g in basic.param_groups for p in g["params"]] + optimizer_state_tensors(basic)
    wrapper = getattr(engine, "optimizer", None)
    if wrapper is not None and wrapper is not basic:
        for category in (PARAMETERS, GRADIENTS, COMM_BUFFERS):
            tensors += engine_tensors(wrapper, category)
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def current_device_bytes(tracker: Optional[MemoryTracker] = None) -> int:
    """Bytes in use on the device now: the accelerator's allocator, or the tracker on CPU."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu":
        return int(acc.memory_allocated())
    if tracker is None:
        raise RuntimeError("on CPU, device bytes come from a MemoryTracker; none is running")
    return tracker.live_bytes
