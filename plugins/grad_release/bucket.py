"""One bucket on one rank: its parameters, this rank's fp32 master slices and their optimizer, and
the gradient buffers of the step in progress.

Life of a bucket's gradient in one optimizer step (``layout.py`` has the buffer layout):

1. ``add``: each parameter's gradient is copied into the bucket's communication buffer as soon as
   autograd finishes it, and ``param.grad`` is dropped at once.
2. ``launch``/``wait``: the buffer is reduce-scattered (sharded: each rank keeps the sum of its
   row) or all-reduced (stage 0: every rank keeps the whole sum).
3. Not the last micro-step (gradient accumulation): ``fold`` adds the averaged shard into an fp32
   accumulator of this rank's shard. Stage 0 skips the collective and accumulates locally
   (``add(..., local=True)``); it reduces the accumulator once, in the last micro-step.
4. Last micro-step: ``finalize`` makes the step's gradient; ``apply`` unscales and clips it, steps
   the bucket's optimizer and frees it, then casts the masters into the parameters (stage 0) or
   all-gathers every rank's updated slices (``gather``/``finish_gather``).

A bucket's parameters share one dtype. Parameters in fp32 are their own masters (the optimizer
steps views of them); 16-bit parameters get an fp32 master copy of this rank's slices. With
``remainders`` (bf16 only) the master exists only during the bucket's update: between updates it is
the bf16 weight plus ``remainders.py``'s 16-bit remainder and tie bit, and the views the optimizer
steps (its states are keyed by them) point at an empty tensor until the next update rebuilds it.
With ``none`` (bf16 only) there is no master at all: the update widens the bf16 weights to fp32,
steps them, and rounds the result back stochastically (``stochastic.py``). Under an optimizer that
stores its updated chunks through ``xirang_write_back`` (optimizer_states' DynamicAdamW) the widening
is a chunk at a time inside the optimizer (``in_place``), so not even the update holds an fp32 copy
of the shard. The master slices and their optimizer are `masters.MasterSlices`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Sequence, Union

import torch

from xirang_ds.compat.torch import GRAD_DTYPE_SETTABLE
from xirang_ds.memory.categories import COMM_BUFFERS, GRADIENTS
from xirang_ds.plugins.grad_release.comm import DataParallelComm, wait
from xirang_ds.plugins.grad_release.layout import BucketLayout, Piece
from xirang_ds.plugins.grad_release.masters import MasterSlices
from xirang_ds.plugins.grad_release.optimizers import sync_hyperparameters
from xirang_ds.plugins.grad_release.parked_states import ParkedStates

Scope = Callable[[str], ContextManager[None]]
Coefficient = Union[float, torch.Tensor]


def no_scope(category: str) -> ContextManager[None]:
    """The `Scope` used without a memory tracker."""
    return contextlib.nullcontext()


class Bucket(MasterSlices, ParkedStates):
    """A bucket of parameters on this rank.

    Args:
        index: position of the bucket in the launch order.
        params: the bucket's parameters, one dtype, contiguous.
        names: their names (messages, checkpoints).
        sources: for each parameter, the index of its group in the basic optimizer.
        layout: the bucket's shard layout (``world`` 1 when not sharded).
        comm: the data-parallel collectives.
        basic_optimizer: the engine's basic optimizer (cloned for this bucket, hyperparameters
            copied from it before every step).
        comm_dtype: dtype gradients are reduced in.
        scope: tracker scope for the bucket's transient buffers (`no_scope` without a tracker).
        host_scope: where the bucket's host buffer is made (the tracker's host tier; `stash`).
        masters: how bf16 parameters' masters are kept between updates: ``fp32``, ``remainders``
            (exact), ``remainders_8bit`` (to 16 significant bits) or ``none`` (rounded stochastically
            into the weights). Other dtypes: ``fp32``.
        states: where the optimizer's states live between updates: ``device`` or ``host``
            (`parked_states.ParkedStates`).

    Attributes:
        grad: after ``finalize``, the step's gradient shard (``grad * grad_scale`` is the average).
        steps_applied: optimizer steps this bucket has applied.
        norm_counted: per parameter, whether its gradient enters this rank's sum of squares (None:
            all). Under Megatron a parameter replicated on the tensor-parallel group counts on its
            first rank only, as ``clip_grads.get_grad_norm_fp32`` counts it.
    """

    def __init__(self, index: int, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 sources: Sequence[int], layout: BucketLayout, comm: DataParallelComm,
                 basic_optimizer: torch.optim.Optimizer, comm_dtype: torch.dtype, scope: Scope = no_scope,
                 host_scope: Callable[[], ContextManager] = contextlib.nullcontext, masters: str = "fp32",
                 states: str = "device"):
        self.index = index
        self.params = list(params)
        self.names = list(names)
        self.sources = list(sources)
        self.layout = layout
        self.comm = comm
        self.basic = basic_optimizer
        self.comm_dtype = comm_dtype
        self.scope = scope
        self.host_scope = host_scope
        self._host: Optional[torch.Tensor] = None  # where `stash` keeps the gradient shard, reused every step
        self.states_on, self._parked = states, {}
        self.sharded = layout.world > 1
        self.dtype = self.params[0].dtype
        self.pieces: list[Piece] = [p for p in layout.pieces(comm.rank if self.sharded else 0) if p.numel > 0]
        self.has_master = self.dtype != torch.float32
        self.master: Optional[torch.Tensor] = None  # None for fp32, and between updates unless masters is fp32
        self.masters = masters if self.dtype == torch.bfloat16 else "fp32"
        self.remainders = self.masters in ("remainders", "remainders_8bit")
        self.transient = self.masters != "fp32"  # the master exists only during an update (or a load)
        # none, under an optimizer that widens and rounds back a chunk at a time: no master, ever (it
        # takes the fp32 gradient on the bf16 weight: torch with Tensor.grad_dtype)
        self.in_place = (self.masters == "none" and bool(getattr(basic_optimizer, "xirang_write_back", False))
                         and GRAD_DTYPE_SETTABLE)
        if self.in_place:
            self.transient = self.has_master = False
        self.remainder: Optional[torch.Tensor] = None  # int16 (int8: remainders_8bit), one per master element
        self.ties: Optional[torch.Tensor] = None  # uint8, one bit per master element (none: remainders_8bit)
        self.views: list[torch.Tensor] = []
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.group_sources: list[int] = []
        self.steps_applied = 0
        self.acc: Optional[torch.Tensor] = None
        self.norm_counted: Optional[list[bool]] = None
        self._reset_step_buffers()
        self.build_masters()

    def _reset_step_buffers(self) -> None:
        self.arrived = [False] * len(self.params)
        self.missing = len(self.params)
        self.by_rows_done = False
        self.rows_taken: Optional[str] = None  # where `rows.RowSink` put each round: "acc" or "host"
        self.rows_sumsq: Optional[torch.Tensor] = None  # the rounds' squared norms, summed (`sumsq`)
        self.target: Optional[torch.Tensor] = None
        self._target_accumulates = False
        self.reduced: Optional[torch.Tensor] = None
        self._in_flight: Optional[torch.Tensor] = None
        self.work: Any = None
        self.grad: Optional[torch.Tensor] = None
        self.grad_scale = 1.0
        self.gather_work: Any = None
        self._gather_buffers: tuple = ()

    def begin_backward(self) -> None:
        """A new backward starts: no gradient of it has arrived."""
        self.arrived = [False] * len(self.params)
        self.missing = len(self.params)
        self.by_rows_done = False  # handed over by rows in this backward (`rows.RowSink`)
        self.rows_taken, self.rows_sumsq = None, None

    def add(self, index: int, grad: torch.Tensor, local: bool = False, peek: bool = False) -> None:
        """Take parameter ``index``'s gradient of this backward.

        Args:
            local: accumulate into this rank's accumulator without a collective (stage 0, not
                the last micro-step).
            peek: a norm-only pass: the accumulator must stay as it is.
        """
        flat = grad.reshape(-1)
        if local:
            self.layout.write(self._accumulator(), index, flat, add=True)
        elif self._adopts(flat):
            self.target, self._target_accumulates = flat, False
        else:
            target = self._target(peek)
            self.layout.write(target, index, flat, add=self._target_accumulates or self.arrived[index])
        if not self.arrived[index]:
            self.arrived[index] = True
            self.missing -= 1

    def add_late(self, index: int, grad: torch.Tensor) -> None:
        """A gradient of parameter ``index`` that arrives after its rows were reduced (`rows.RowSink`),
        its bucket still in flight: reduced now and added to the reduced shard (or to the accumulator,
        or to the shard brought back from the host, where the rounds went; its norm is then taken whole)."""
        with self.scope(GRADIENTS):
            buffer = torch.zeros(self.layout.numel, dtype=self.comm_dtype, device=grad.device)
            self.layout.write(buffer, index, grad.reshape(-1))
            late = torch.empty(self.layout.shard_numel, dtype=self.comm_dtype, device=grad.device)
        wait(self.comm.reduce_scatter(late, buffer))
        del buffer
        if self.rows_taken == "acc":
            self.acc.add_(late, alpha=1.0 / self.comm.world)
        elif self.rows_taken == "host":  # back on the device, where the reduction would have left it
            self.rows_taken, self.reduced = None, late.add_(self.host_shard_ready().to(late.device))
        else:
            self.reduced.add_(late)
        self.rows_sumsq = None

    def _adopts(self, flat: torch.Tensor) -> bool:
        """Whether the gradient itself is this backward's communication buffer, with no copy: the bucket's
        one parameter, cut into equal chunks (no padding: its flat gradient is then the ``[world, chunk]``
        layout), in the communication dtype, and no local sum to add it to. A parameter larger than the
        bucket size is alone in its bucket (an embedding, an LM head): its gradient is not held twice."""
        return (self.target is None and len(self.params) == 1 and not self.layout.padded
                and (self.sharded or self.acc is None) and flat.dtype == self.comm_dtype and flat.is_contiguous())

    def _accumulator(self) -> torch.Tensor:
        if self.acc is None:
            numel = self.layout.shard_numel if self.sharded else self.layout.numel
            with self.scope(GRADIENTS):
                self.acc = torch.zeros(numel, dtype=torch.float32, device=self.params[0].device)
        return self.acc

    def _target(self, peek: bool) -> torch.Tensor:
        if self.target is None:
            with self.scope(GRADIENTS):
                if not self.sharded and self.acc is not None:
                    # stage 0 with accumulation: the local sum so far plus this micro-step
                    self.target = self.acc.clone() if peek else self.acc
                    self._target_accumulates = True
                else:
                    self.target = torch.empty(self.layout.numel, dtype=self.comm_dtype, device=self.params[0].device)
                    self._target_accumulates = False
        return self.target

    @property
    def complete(self) -> bool:
        """Every parameter's gradient of this backward has arrived."""
        return self.missing == 0

    def launch(self, peek: bool = False) -> None:
        """Start reducing this backward's gradients (zeros for parameters that got none)."""
        target = self._target(peek)
        if not self._target_accumulates:
            for i, done in enumerate(self.arrived):
                if not done:
                    self.layout.zero(target, i)
        if self.sharded:
            with self.scope(GRADIENTS):
                self.reduced = torch.empty(self.layout.shard_numel, dtype=target.dtype, device=target.device)
            self.work = self.comm.reduce_scatter(self.reduced, target)
            self._in_flight = target
        else:
            self.reduced = target
            self.work = self.comm.all_reduce(target)
        self.target = None

    def wait(self) -> None:
        """Wait for the reduction; the communication buffer is freed."""
        wait(self.work)
        self.work, self._in_flight = None, None

    # gradients folded -------------------------------------------------------------------------
    def fold(self) -> None:
        """Not the last micro-step: add this micro-step's averaged shard into the accumulator."""
        if self.rows_taken == "acc":  # each round was added as it was reduced
            return
        self._accumulator().add_(self.reduced, alpha=1.0 / self.comm.world)
        self.reduced = None

    def finalize(self) -> None:
        """Last micro-step: make ``grad`` (the step's gradient shard) from the reduction."""
        if self.rows_taken == "host":
            self.grad, self.grad_scale = self._host, 1.0 / self.comm.world
        elif self.rows_taken == "acc":
            self.grad, self.grad_scale = self.acc, 1.0
        elif self.sharded and self.acc is not None:
            self.acc.add_(self.reduced, alpha=1.0 / self.comm.world)
            self.grad, self.grad_scale = self.acc, 1.0
        else:
            self.grad, self.grad_scale = self.reduced, 1.0 / self.comm.world
        self.acc = None
        self.reduced = None

    def sumsq(self) -> torch.Tensor:
        """Squared L2 norm of the step's gradient shard (float64 scalar; nan/inf if non-finite)."""
        if self.rows_sumsq is not None:  # summed over the rounds as they were reduced (`rows.RowSink`)
            return self.rows_sumsq
        if self.norm_counted is None or all(self.norm_counted):
            norm = torch.linalg.vector_norm(self.grad, dtype=torch.float32).double() * self.grad_scale
            return norm * norm
        total = torch.zeros((), dtype=torch.float64, device=self.grad.device)
        for piece in self.pieces:
            if self.norm_counted[piece.index]:
                part = self.grad[piece.offset:piece.offset + piece.numel]
                total += (torch.linalg.vector_norm(part, dtype=torch.float32).double() * self.grad_scale) ** 2
        return total

    def peek_sumsq(self) -> torch.Tensor:
        """Norm pass: the squared norm the step's gradient will have, leaving the accumulator as it is."""
        if self.sharded and self.acc is not None:
            with self.scope(GRADIENTS):
                total = torch.add(self.acc, self.reduced, alpha=1.0 / self.comm.world)
            norm = torch.linalg.vector_norm(total, dtype=torch.float32).double()
            del total
        else:
            norm = torch.linalg.vector_norm(self.reduced, dtype=torch.float32).double() / self.comm.world
        self.reduced = None
        return norm * norm

    def param_sumsq(self) -> torch.Tensor:
        """Squared norm of each parameter's part of the step's gradient shard (float64 vector)."""
        g = self.grad
        parts = [torch.linalg.vector_norm(g[off:off + c], dtype=torch.float32)
                 for off, c in zip(self.layout.offsets, self.layout.chunks)]
        norms = torch.stack(parts).double() * self.grad_scale
        return norms * norms

    # the update -------------------------------------------------------------------------------
    def apply(self, coefficient: Coefficient) -> None:
        """Step this bucket with its gradient times ``coefficient``, free the gradient, start the gather.

        Args:
            coefficient: one multiplier (unscale and clip), or one per parameter (a tensor).
        """
        if self.in_place:  # the optimizer widens and scales it a chunk at a time, in the same order
            grad = self.grad
        else:
            grad = self._grad32()
            if isinstance(coefficient, torch.Tensor):
                for piece in self.pieces:
                    grad[piece.offset:piece.offset + piece.numel].mul_(coefficient[piece.index])
            elif coefficient != 1.0:
                grad.mul_(coefficient)
        if self.optimizer is not None:
            self.materialize()
            for piece, view in zip(self.pieces, self.views):
                view.grad = grad[piece.offset:piece.offset + piece.numel].view(view.shape)
                if self.in_place:
                    c = coefficient[piece.index] if isinstance(coefficient, torch.Tensor) else coefficient
                    view.xirang_grad_scale = tuple(s for s in (self.grad_scale, c)
                                                   if isinstance(s, torch.Tensor) or s != 1.0)
            sync_hyperparameters(self.basic.param_groups, self.optimizer, self.group_sources)
            self.fetch_states()
            self.optimizer.step()
            self.park_states()
            for view in self.views:
                view.grad = None
        del grad
        self.grad = None
        self.steps_applied += 1
        self.gather()

    def _grad32(self) -> torch.Tensor:
        grad, scale = self.grad, self.grad_scale
        if grad.dtype != torch.float32:
            with self.scope(GRADIENTS):
                grad = grad.float()
        if scale != 1.0:
            grad.mul_(scale)
        return grad

    def gather(self) -> None:
        """Bring the updated masters back into the parameters (all-gather when sharded)."""
        with torch.no_grad():
            if not self.sharded:
                if self.transient:
                    with self.scope(COMM_BUFFERS):
                        weight = torch.empty(self.master.numel(), dtype=self.dtype, device=self.master.device)
                        self._round(weight)
                    self._write_params(weight)
                    self._release(weight)
                elif self.has_master:
                    for piece, view in zip(self.pieces, self.views):
                        self.params[piece.index].copy_(view)
                return
            device = self.params[0].device
            with self.scope(COMM_BUFFERS):
                shard = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=device)
                if self.has_master:
                    self._round(shard)
                    self._release(shard)
                else:
                    for piece, view in zip(self.pieces, self.views):
                        shard[piece.offset:piece.offset + piece.numel].copy_(view)
                # a parameter alone in its bucket, unpadded, is itself the gathered layout: gathered into
                # in place, not into a buffer of its size (as `_adopts` takes its gradient)
                direct = len(self.params) == 1 and not self.layout.padded and self.params[0].is_contiguous()
                full = (self.params[0].detach().view(-1) if direct
                        else torch.empty(self.layout.numel, dtype=self.dtype, device=device))
            self.gather_work = self.comm.all_gather(full, shard)
            self._gather_buffers = (shard, None if direct else full)

    def finish_gather(self) -> None:
        """Wait for the all-gather and copy every rank's slices into the parameters."""
        if not self._gather_buffers:
            return
        wait(self.gather_work)
        shard, full = self._gather_buffers
        if full is not None:
            with torch.no_grad():
                self.layout.read_all(full, [param.detach().view(-1) for param in self.params])
        self.gather_work, self._gather_buffers = None, ()

    def discard(self) -> None:
        """Drop the step's gradients (skipped step) and any buffer of the backward in progress."""
        wait(self.work)
        wait(self.gather_work)
        self.acc = None
        self.drop_prefetch()
        self._reset_step_buffers()

    def abort_backward(self) -> None:
        """Forget a backward that did not finish (its gradients are lost; the accumulator stays)."""
        wait(self.work)
        self.finish_gather()
        acc = self.acc
        self.drop_prefetch()
        self._reset_step_buffers()
        self.acc = acc

    # checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's masters (fp32 however they are kept; ``none``: the weights widened) and
        optimizer state (fp32 parameters: optimizer state only)."""
        master = self.master
        if self.remainders:
            master = torch.empty_like(self.remainder, dtype=torch.float32)
            self._join(master)
        elif self.transient or self.in_place:
            master = self._weight_shard(torch.float32)
        self.settle_states()
        return {"master": master, "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "steps_applied": self.steps_applied}

    def load_state_dict(self, state: dict) -> None:
        if self.has_master and state["master"] is not None:
            # the optimizer state loads while a transient master stands in its views: between updates
            # they hold no element, and a state is matched to its parameter element by element
            with self.fp32_masters(write_params=self.transient):
                self.master.copy_(state["master"])
                self._load_optimizer(state)
        else:
            if self.in_place and state["master"] is not None:
                with torch.no_grad():
                    self._write_params(state["master"].to(self.dtype))
            self._load_optimizer(state)
        self.steps_applied = int(state.get("steps_applied", 0))

    def _load_optimizer(self, state: dict) -> None:
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])  # onto the device, as torch loads them
            self.park_states()

    def fingerprint(self) -> dict:
        """What must match for a checkpoint of this bucket to load here."""
        return {"names": list(self.names), "numels": list(self.layout.numels), "world": self.layout.world,
                "dtype": str(self.dtype).replace("torch.", "")}


__all__ = ["Bucket", "Coefficient", "Scope", "no_scope"]
