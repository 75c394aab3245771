"""What plugins attach to under Megatron-core: the model chunks, Megatron's optimizer and a step count.

Under DeepSpeed a plugin attaches to the engine. Megatron has no engine, so `MegatronRun` carries
what the plugins read from one: the root module (``module``), the optimizer (``optimizer``, and the
``torch.optim`` objects inside it as ``basic_optimizers``), the ranks and ``global_steps``. Megatron's
training loop calls ``optimizer.step()``; the run routes that call through its own `MegatronRun.step`,
so a plugin wraps ``run.step`` with `xirang_ds.hooks.wrap_method` exactly as it wraps
``engine.step``, and sees every optimizer step.

`MegatronWatch` drives the shared memory tracker from the run: phases from the first chunk's forward
hooks and from ``run.step``; roles from the chunks' parameters, Megatron DDP's contiguous gradient
buffers (every ``param.main_grad`` is a view of one), the optimizer's fp32 masters and states, and
Megatron's ``GlobalMemoryBuffer`` (``comm_buffers``: the persistent arena of sequence-parallel
all-gathers, which local attention also borrows for its baddbmm input).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from xirang_ds.compat.megatron import (
    buffer_tensors,
    global_memory_buffer_tensors,
    inner_optimizers,
    num_microbatches,
)
from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import COMM_BUFFERS, GRADIENTS, OPTIMIZER_STATES, PARAMETERS
from xirang_ds.memory.engine_roles import TrainingWatch, optimizer_state_tensors
from xirang_ds.memory.tracker import MemoryTracker


def _rank_and_size(group: Any = None) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class MegatronRun:
    """The engine-shaped view of a Megatron-core run that plugins attach to.

    Args:
        model_chunks: the model chunks as training calls them (Megatron DDP-wrapped; one per virtual
            pipeline stage).
        optimizer: Megatron's optimizer (``get_megatron_optimizer``): a ``ChainedOptimizer`` or one
            ``MegatronOptimizer``.
        micro_batch_size: samples per micro-batch, for reports (Megatron-LM: ``args.micro_batch_size``).
        num_microbatches: micro-batches per optimizer step (reports; grad_release finds the last one
            by it) when Megatron's calculator is not initialised; the calculator wins when it is.

    Attributes:
        module: the first chunk (the root whose forward hooks mark phases).
        basic_optimizers: the ``torch.optim`` objects inside ``optimizer``.
        global_steps: optimizer steps taken since attach (skipped fp16 steps count, as in DeepSpeed).
        global_rank, world_size: of the default process group.
        dp_world_size, tp_world_size: Megatron's data- and tensor-parallel sizes.
        applied_update: set by a plugin that applies the update itself during backward
            (grad_release): `step` returns what it returns (Megatron's ``(update_successful,
            grad_norm, num_zeros_in_grad)``) instead of calling Megatron's optimizer step.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], optimizer: Any,
                 micro_batch_size: Optional[int] = None, num_microbatches: Optional[int] = None):
        if not model_chunks:
            raise ValueError("MegatronRun needs at least one model chunk")
        self.model_chunks = list(model_chunks)
        self.module = self.model_chunks[0]
        self.optimizer = optimizer
        self.basic_optimizers = inner_optimizers(optimizer)
        self.global_steps = 0
        self.global_rank, self.world_size = _rank_and_size()
        self.dp_world_size, self.tp_world_size = self._parallel_sizes()
        first = next(self.module.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._micro_batch_size = micro_batch_size
        self._num_microbatches = num_microbatches
        self.applied_update: Optional[Callable[[], Any]] = None
        self._handle = wrap_method(optimizer, "step", self._route)
        self._inner_step: Callable[..., Any] = self._handle.original

    @staticmethod
    def _parallel_sizes() -> tuple[int, int]:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return 1, 1
        return (parallel_state.get_data_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_world_size())

    # the step -----------------------------------------------------------------------------
    def _route(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._inner_step = original
        return self.step(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """One step of Megatron's optimizer, counted in ``global_steps``; plugins wrap this method.

        Returns:
            What the optimizer's ``step`` returns (``(update_successful, grad_norm, num_zeros)``).
        """
        if self.applied_update is not None:
            result = self.applied_update()
        else:
            result = self._inner_step(*args, **kwargs)
        self.global_steps += 1
        return result

    # what observation plugins read from a DeepSpeed engine ---------------------------------
    def train_micro_batch_size_per_gpu(self) -> Optional[int]:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> Optional[int]:
        """Micro-batches per step: Megatron's calculator when it is initialised (it follows
        ``--rampup-batch-size``), else the number given to the run."""
        live = num_microbatches()
        return live if live is not None else self._num_microbatches

    def zero_optimization_stage(self) -> int:
        """1 with Megatron's distributed optimizer (states sharded over data parallel), else 0."""
        ddp_config = getattr(self.module, "ddp_config", None)
        return 1 if getattr(ddp_config, "use_distributed_optimizer", False) else 0

    def model_state_bytes(self) -> int:
        """Device bytes the model states hold now, each storage once: the allocator's figure on
        accelerators; on CPU the chunks' parameters, DDP's grad (and param) buffers, the optimizer's
        masters and states (what ``memory_budget`` must leave room for)."""
        if self.device.type != "cpu":
            return int(torch.cuda.memory_allocated(self.device))
        grads, params = buffer_tensors(self.model_chunks)
        tensors = [p for chunk in self.model_chunks for p in chunk.parameters()] + grads + params
        for opt in self.basic_optimizers:
            tensors += [p for g in opt.param_groups for p in g["params"]] + optimizer_state_tensors(opt)
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
        return sum(seen.values())

    def remove(self) -> None:
        """Stop routing ``optimizer.step`` through the run."""
        self._handle.remove()


class MegatronWatch(TrainingWatch):
    """`TrainingWatch` for a `MegatronRun`: phases and roles as described in the module docstring.

    Args:
        tracker: the tracker to feed.
        run: the run; its ``step`` marks the optimizer phase.
        roles: providers of ``(category, tensors)`` for tensors plugins hold (`Session.add_memory_roles`).
    """

    def __init__(self, tracker: MemoryTracker, run: MegatronRun,
                 roles: Sequence[Callable[[], Iterable[tuple[str, Any]]]] = ()):
        super().__init__(tracker, run.module, roles=roles)
        self.run = run
        self._handles.append(wrap_method(run, "step", self._around_step))

    def _around_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.mark_model_states()
        self.tracker.set_phase("optimizer_step")
        result = original(*args, **kwargs)
        for opt in self.run.basic_optimizers:
            self.tracker.mark(optimizer_state_tensors(opt), OPTIMIZER_STATES)
        for fn in self.on_step_end:
            fn()
        self.tracker.set_phase("idle")
        return result

    def mark_model_states(self) -> None:
        """Mark parameters, ``main_grad`` buffers, masters, optimizer states and Megatron's arena."""
        super().mark_model_states()
        t = self.tracker
        for chunk in self.run.model_chunks[1:]:
            params = list(chunk.parameters())
            t.mark(params, PARAMETERS)
            t.mark([p.grad for p in params if p.grad is not None], GRADIENTS)
        grads, params = buffer_tensors(self.run.model_chunks)
        t.mark(params, PARAMETERS)
        t.mark(grads, GRADIENTS)
        for opt in self.run.basic_optimizers:
            masters = [p for g in opt.param_groups for p in g["params"]]
            t.mark(masters, PARAMETERS)
            t.mark([p.grad for p in masters if p.grad is not None], GRADIENTS)
            t.mark(optimizer_state_tensors(opt), OPTIMIZER_STATES)
        t.mark(global_memory_buffer_tensors(), COMM_BUFFERS)


def watch_run(tracker: MemoryTracker, run: MegatronRun,
              roles: Sequence[Callable[[], Iterable[tuple[str, Any]]]] = ()) -> MegatronWatch:
    """Seed the tracker with what the run holds and drive it from the run (`Session.attach`'s ``watch``)."""
    watch = MegatronWatch(tracker, run, roles=roles)
    watch.mark_model_states()
    return watch


__all__ = ["MegatronRun", "MegatronWatch", "watch_run"]
