"""Survive an out-of-memory error inside a step (``monitor.on_oom = "halve_micro_batch"``).

An error inside ``engine.forward`` or ``engine.backward`` is caught on the rank that ran out; every
rank then drops the micro-step, the micro-batch runs as twice as many pieces (`MicroBatchSplitter`:
the accumulation doubles inside ``engine.forward``, the global batch does not change) and this
step's micro-batches run again from the first, with gradients cleared as DeepSpeed clears them when
it skips a step. Counters, the LR schedule and the data order are untouched: no optimizer step ran.

Agreement. A rank that ran out stops issuing collectives, so the others must learn it before they
wait in one it will never join. While a forward or backward runs, every collective DeepSpeed issues
(``deepspeed.comm``'s backend; grad_release's reductions go through it too) is preceded by a check on
a separate gloo group where each rank says whether it has failed (`CollectiveGate`); a failing rank
answers the next check it would have reached with "failed". Collectives run in the same order on
every rank, so the failing rank's answer meets the check the others make before their next
collective, or the one at the end of forward or backward; every rank unwinds with the same verdict
and no rank waits alone. Cost: one gloo all-reduce of an int32 per rank per collective and per forward and backward,
only with ``on_oom`` on and more than one rank.

The graph. ``engine.forward`` hands back a stand-in for the loss (a leaf with its value; the real
loss stays here, and ``engine.backward`` runs it). When backward fails, the graph the user's
variable would have held is dropped here, so the retry does not run beside the failed attempt's
saved activations. A ``loss.backward()`` on the stand-in raises with the fix.

At ZeRO-3 the interrupted pass also leaves parameters gathered, a prefetch trace recorded part-way and
sub-modules on ZeRO-3's module stack: `xirang_ds.compat.deepspeed.drop_step_gradients` releases, invalidates
and pops them.

Where nothing can be retried: an update that has begun (grad_release applies its held shards only
after every rank confirmed its backward, `OomGuard.confirm_update`), the optimizer step, and a
micro-batch already in pieces of one sample; those raise ``torch.OutOfMemoryError``.
"""
from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Optional

import torch

from xirang_ds.compat.deepspeed import (
    accumulation_boundary,
    drop_step_gradients,
    restore_accumulation_boundary,
    zero_state_missing,
)
from xirang_ds.compat.torch import version
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import wrap_method
from xirang_ds.microbatch import loss_of, require_loss, with_loss
from xirang_ds.roles import DropsGradients

logger = logging.getLogger("xirang_ds")


class PeerOutOfMemoryError(RuntimeError):
    """Another rank ran out of memory in this micro-step (raised on the ranks that did not)."""


GATED_OPS = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
             "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "all_gather_base",
             "all_gather_coalesced", "broadcast", "all_to_all_single", "all_to_all", "gather", "scatter",
             "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv")
"""DeepSpeed backend methods that wait for other ranks."""


def _ranks_ran_out(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ran out of memory"


class CollectiveGate:
    """Before each collective while armed, every rank says whether it has failed (one gloo all-reduce).

    Attributes:
        armed: checks run (set by `OomGuard` around forward and backward).
        checks: checks made so far.
    """

    def __init__(self) -> None:
        import deepspeed.comm.comm as ds_comm
        import torch.distributed as dist

        self._dist = dist
        self.group = dist.new_group(backend="gloo")  # its own group: checks never queue behind NCCL work
        self.rank = dist.get_rank()
        self.flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
        self.armed = False
        self.checks = 0
        self._inside = False
        backend = ds_comm.cdb
        self._handles = [wrap_method(backend, name, self._gated) for name in GATED_OPS if hasattr(backend, name)]

    def check(self, failed: bool) -> list[int]:
        """This rank's verdict in, every rank's out: the ranks that failed (empty: none)."""
        self.flags.zero_()
        self.flags[self.rank] = 1 if failed else 0
        self._dist.all_reduce(self.flags, group=self.group)
        self.checks += 1
        return self.flags.nonzero().flatten().tolist()

    def _gated(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        if not self.armed or self._inside:  # a backend method calling another is one collective
            return original(*args, **kwargs)
        self._inside = True
        try:
            failed = self.check(False)
            if failed:
                raise PeerOutOfMemoryError(_ranks_ran_out(failed))
            return original(*args, **kwargs)
        finally:
            self._inside = False

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()


# ---------------------------------------------------------------------------------------------
class OomGuard:
    """Catch an out-of-memory error in forward or backward, agree on it, halve and run the step again.

    Args:
        engine: the DeepSpeed engine (its ``forward``, ``backward`` and ``step`` are wrapped, outside
            every plugin's wrappers: create it after they attached).
        splitter: the `MicroBatchSplitter` whose pieces double at each retry.
        session: the xirang session (its plugins that play `xirang_ds.roles.DropsGradients`, events).
        on_retry: called with each retry's record (the monitor logs it and sends its event).

    Attributes:
        retries: one record per retry: step, micro-step, where, pieces, error.
    """

    def __init__(self, engine: Any, splitter: Any, session: Any, on_retry: Callable[[dict], None]):
        import deepspeed
        import torch.distributed as dist

        missing = zero_state_missing(engine.optimizer)
        if missing:
            raise XirangConfigError([("xirang.monitor.on_oom", f"'halve_micro_batch' clears a failed step's gradients "
                                                               f"in DeepSpeed's ZeRO optimizer, whose {deepspeed.__version__} "
                                                               f"lacks {', '.join(missing)}; set on_oom to \"raise\"")])
        self.engine, self.splitter, self.session, self.on_retry = engine, splitter, session, on_retry
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.gate: Optional[CollectiveGate] = CollectiveGate() if world > 1 else None
        self.inputs: list[tuple[tuple, dict]] = []
        """This step's micro-batches so far (references to the caller's tensors, until the step)."""
        self.retries: list[dict] = []
        self.committed = False
        """An update has begun in this attempt: an error now cannot be retried."""
        self._pending: Optional[tuple] = None  # the real loss, the stand-in's leaf, the stand-in, its version
        self._direct_ok = False
        self._depth = 0
        self._forward_inner: Optional[Callable] = None
        self._backward_inner: Optional[Callable] = None
        self._backward_kwargs: dict = {}
        self._handles = [wrap_method(engine, "forward", self._forward),
                         wrap_method(engine, "backward", self._backward),
                         wrap_method(engine, "step", self._step)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self.gate is not None:
            self.gate.remove()
        self.inputs.clear()
        self._pending = None

    # the engine's methods --------------------------------------------------------------------
    def _forward(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        if self._depth or not (self.engine.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        self._forward_inner = original
        self._pending = None
        self.inputs.append((args, kwargs))
        ok, output = self._attempt(lambda: original(*args, **kwargs))
        if not ok:
            output = self._recover(output, "forward", with_backward=False)
        return self._hand_out(output)

    def _backward(self, original: Callable, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self._depth or self._pending is None:
            return original(loss, *args, **kwargs)
        self._backward_inner = original
        self._backward_kwargs = dict(kwargs, **dict(zip(("retain_graph", "scale_wrt_gas"), args)))
        real = self._real_loss(loss)
        self._pending = None
        ok, result = self._attempt(lambda: original(real, **self._backward_kwargs))
        del real
        if ok:
            return result
        self._recover(result, "backward", with_backward=True)
        scale = self.engine.gradient_accumulation_steps() if self._backward_kwargs.get("scale_wrt_gas", True) else 1
        return loss.detach() / scale

    def _step(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        boundary = self.engine.is_gradient_accumulation_boundary()
        result = original(*args, **kwargs)
        if boundary:
            self.inputs.clear()
        return result

    def confirm_update(self) -> None:
        """Called right before an update inside backward (grad_release's held shards): every rank
        confirms its backward succeeded; after this an error cannot be retried."""
        failed = self.gate.check(False) if self.gate is not None else []
        if failed:
            raise PeerOutOfMemoryError(_ranks_ran_out(failed))
        self.committed = True

    # one attempt -----------------------------------------------------------------------------
    def _attempt(self, run: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, result)``, or ``(False, why)`` once every rank agreed that one of them failed."""
        gate = self.gate
        self._depth += 1
        self.committed = False
        if gate is not None:
            gate.armed = True
        try:
            try:
                result = run()
            except torch.OutOfMemoryError as error:
                if self.committed:
                    raise torch.OutOfMemoryError(
                        f"{error} [xirang.monitor.on_oom: out of memory after the update began (grad_release "
                        "applying its held gradients); it cannot be retried without a half-applied step. "
                        "Lower train_micro_batch_size_per_gpu or raise memory_budget]") from error
                why = str(error).splitlines()[0] if str(error) else "out of memory"
                if gate is not None:
                    why = f"{_ranks_ran_out(gate.check(True))}; here: {why}"
                return False, why
            except PeerOutOfMemoryError as peer:
                return False, str(peer)
            failed = gate.check(False) if gate is not None else []
            if failed:
                del result
                return False, _ranks_ran_out(failed)
            return True, result
        finally:
            if gate is not None:
                gate.armed = False
            self._depth -= 1

    def _recover(self, why: str, where: str, with_backward: bool) -> Any:
        """Every rank: drop, halve, run this step's micro-batches again; until one attempt succeeds."""
        engine, splitter = self.engine, self.splitter
        micro = engine.train_micro_batch_size_per_gpu()
        while True:
            self._pending = None
            for plugin in self.session.plugins_with(DropsGradients):
                plugin.drop_gradients()
            drop_step_gradients(engine)
            gc.collect()
            from deepspeed.accelerator import get_accelerator

            get_accelerator().empty_cache()
            pieces = splitter.pieces * 2
            if not splitter.can_split(pieces):
                raise torch.OutOfMemoryError(
                    f"xirang.monitor.on_oom: out of memory in {where} ({why}) with the micro-batch of {micro} "
                    f"already run as {splitter.pieces} piece(s) of {micro // splitter.pieces}; nothing left to "
                    "halve. Lower train_micro_batch_size_per_gpu, raise memory_budget or shorten the sequences")
            splitter.pieces = pieces
            record = {"step": engine.global_steps + 1, "micro_step": len(self.inputs), "where": where,
                      "pieces": pieces, "error": why, "replayed": len(self.inputs) - 1}
            self.retries.append(record)
            self.on_retry(record)
            ok, output = self._attempt(lambda: self._replay(with_backward))
            if ok:
                return output
            why, where = output, "retry"

    def _replay(self, with_backward: bool) -> Any:
        """This step's earlier micro-batches forward and backward (not a boundary), then the current
        one: forward only (the caller runs its backward) or with its backward."""
        engine = self.engine
        saved = accumulation_boundary(engine)
        try:
            for args, kwargs in self.inputs[:-1]:
                engine.set_gradient_accumulation_boundary(False)
                self._backward_inner(self._require_loss(self._forward_inner(*args, **kwargs)))
        finally:
            restore_accumulation_boundary(engine, saved)
        args, kwargs = self.inputs[-1]
        output = self._forward_inner(*args, **kwargs)
        if not with_backward:
            return output
        self._backward_inner(self._require_loss(output), **self._backward_kwargs)
        return None

    # the loss handed out ---------------------------------------------------------------------
    @staticmethod
    def _require_loss(output: Any) -> torch.Tensor:
        return require_loss(output, "xirang.monitor.on_oom = \"halve_micro_batch\"")

    def _hand_out(self, output: Any) -> Any:
        """The output with its loss replaced by a stand-in of the same value: one step from a leaf,
        so the caller may scale it in place (HF's ``loss *= ...``)."""
        loss = loss_of(output)
        if loss is None or not loss.requires_grad:
            return output
        leaf = loss.detach().requires_grad_(True)
        leaf.register_hook(self._direct_backward)
        stand_in = leaf * 1.0
        self._pending = (loss, leaf, stand_in, version(stand_in))
        return with_loss(output, stand_in)

    def _direct_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._direct_ok:
            raise RuntimeError("xirang.monitor.on_oom = \"halve_micro_batch\": call engine.backward(loss) on the "
                               "loss of the last engine forward, not loss.backward(): the engine keeps that loss's "
                               "graph so that an out-of-memory retry can drop it")
        return grad

    def _real_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What ``engine.backward(loss)`` runs: the real loss for the stand-in; for an expression of the
        stand-in (``loss * w``, or the stand-in scaled in place), the real loss times its gradient."""
        real, leaf, stand_in, saved_version = self._pending
        if loss is stand_in and version(loss) == saved_version:
            return real
        if not loss.requires_grad:
            return loss
        self._direct_ok = True
        try:
            (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        finally:
            self._direct_ok = False
        return loss if grad is None else real * grad.to(real.dtype)


__all__ = ["CollectiveGate", "OomGuard", "PeerOutOfMemoryError"]
