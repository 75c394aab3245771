"""Split each micro-batch into k pieces inside ``engine.forward``, without changing the user's loop.

The monitor's ``halve_micro_batch`` action uses this: the pieces run forward and backward one after
another with the accumulation boundary held off, so activations shrink k-fold while the gradient
(and the global batch) stay the same. The loss the user receives has the value of the whole
micro-batch's mean loss, and its backward applies only the last piece's share.

Exact for losses that are a mean over equally sized samples (the usual language-model loss with
no padding), or a sum divided by a count given as ``num_items_in_batch`` (HF Trainer's, exact with
padding too); the batch dimension must divide by k. Forward returns a scalar loss, or an output
holding one under ``loss`` (HF's ``ModelOutput``): the output then is the last piece's, with the
whole micro-batch's loss in it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from xirang_ds.compat.deepspeed import accumulation_boundary, restore_accumulation_boundary
from xirang_ds.hooks import wrap_method

NUM_ITEMS = "num_items_in_batch"
"""HF Trainer's keyword: the loss is a sum over the micro-batch's tokens divided by this count."""


class SplitError(RuntimeError):
    """The forward's inputs or output do not allow splitting."""


def loss_of(output: Any) -> Optional[torch.Tensor]:
    """The scalar loss in a forward's output: the output itself, or its ``loss`` entry (HF's
    ``ModelOutput``, a dict); None if there is none."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None
    return None


def require_loss(output: Any, who: str, error: type = RuntimeError) -> torch.Tensor:
    """`loss_of`, or ``error`` saying that ``who`` needs one."""
    loss = loss_of(output)
    if loss is None:
        raise error(f"{who} needs forward to return a scalar loss (or an output with a scalar 'loss'); "
                    f"got {type(output).__name__}")
    return loss


def with_loss(output: Any, loss: torch.Tensor) -> Any:
    """``output`` with its loss replaced (see `loss_of`)."""
    if isinstance(output, torch.Tensor):
        return loss
    output["loss"] = loss  # ModelOutput keeps its attribute and its key in step
    return output


def _batch_size(args: tuple, kwargs: dict) -> int:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise SplitError("no tensor argument to split along dimension 0")


def split_inputs(args: tuple, kwargs: dict, k: int) -> list[tuple[tuple, dict]]:
    """k (args, kwargs) pieces: tensors whose first dimension is the batch are chunked."""
    batch = _batch_size(args, kwargs)
    if batch % k:
        raise SplitError(f"micro-batch of {batch} does not split into {k} equal pieces")

    def piece(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
            return value.chunk(k, dim=0)[i]
        return value

    return [(tuple(piece(a, i) for a in args), {n: piece(v, i) for n, v in kwargs.items()}) for i in range(k)]


class MicroBatchSplitter:
    """Run each ``engine(...)`` call as ``pieces`` smaller forward/backward passes.

    Args:
        engine: the DeepSpeed engine.
        pieces: initial number of pieces (1 = off).
    """

    def __init__(self, engine: Any, pieces: int = 1):
        self.engine = engine
        self.pieces = pieces
        self._handle = wrap_method(engine, "forward", self._forward)

    def remove(self) -> None:
        self._handle.remove()

    def can_split(self, k: int) -> bool:
        micro = self.engine.train_micro_batch_size_per_gpu()
        return micro % k == 0 and micro >= k

    def _forward(self, original, *args: Any, **kwargs: Any) -> Any:
        k = self.pieces
        if k <= 1 or not torch.is_grad_enabled() or not self.engine.training:
            return original(*args, **kwargs)
        pieces = split_inputs(args, kwargs, k)
        # a loss already divided by the whole batch's token count (HF's num_items_in_batch) adds up over
        # the pieces; a mean over the piece's samples averages
        share = 1.0 if NUM_ITEMS in kwargs else 1.0 / k
        engine = self.engine
        saved_boundary = accumulation_boundary(engine)
        earlier = []
        try:
            engine.set_gradient_accumulation_boundary(False)
            for piece_args, piece_kwargs in pieces[:-1]:
                loss = _scalar_loss(original(*piece_args, **piece_kwargs))
                engine.backward(loss * share)
                earlier.append(loss.detach())
                del loss
        finally:
            restore_accumulation_boundary(engine, saved_boundary)
        output = original(*pieces[-1][0], **pieces[-1][1])
        last = _scalar_loss(output)
        # value: the whole micro-batch's; gradient: only the last piece's share (the rest is applied)
        return with_loss(output, (last + torch.stack(earlier).sum().to(last.dtype)) * share)


def _scalar_loss(output: Any) -> torch.Tensor:
    return require_loss(output, "halve_micro_batch", SplitError)
