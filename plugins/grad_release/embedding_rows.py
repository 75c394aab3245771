"""An input embedding's weight gradient handed over by rows (`rows.RowSink`), never made whole.

``nn.Embedding``'s backward makes a ``vocab x hidden`` gradient that is zero except at the rows of
the tokens in the batch. Where grad_release takes the embedding's weight by rows (`rows.fits`), its
forward runs `RowsEmbedding`: the same ``F.embedding`` forward, and a backward that builds each round's
rows from the tokens that fall in them (autograd's own ``embedding_dense_backward`` on them, each
row's tokens in their order: on CPU bit for bit the rows of the gradient autograd makes) and reduces
them at once. So the device holds this rank's shard and one round, not the whole. The tokens are
sorted by id once (stably), and every round's bounds are read with one host sync per backward.

Where the rows are not taken in a backward (`RowHandOver.take` says why: the weight used twice, an
earlier bucket not launched yet), the backward is autograd's own ``embedding_dense_backward``, the
gradient autograd would have made. ``max_norm`` (renormalises the weight in forward), ``sparse`` and
``scale_grad_by_freq`` keep the module's own forward, as does a call inside torch.compile's tracing.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import GRADIENTS


def plain(module: torch.nn.Embedding) -> bool:
    """Settings under which `RowsEmbedding` computes what the module computes."""
    return module.max_norm is None and not module.sparse and not module.scale_grad_by_freq


class RowsEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient goes to grad_release by rows."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, hand):
        if ctx.needs_input_grad[1]:
            hand.used()
        ctx.save_for_backward(ids)
        ctx.setup = (weight.shape[0], padding_idx, hand)
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        vocab, padding_idx, hand = ctx.setup
        sink = hand.take() if ctx.needs_input_grad[1] else None
        if sink is None:
            if not ctx.needs_input_grad[1]:
                return None, None, None, None
            padding = -1 if padding_idx is None else padding_idx  # F.embedding's "none"
            whole = torch.ops.aten.embedding_dense_backward(grad, ids, vocab, padding, False)
            return None, whole, None, None
        # the tokens sorted by id once, and every round's bounds found with one host sync
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # each row's tokens in their order, as autograd adds them
        ids_sorted = flat_ids[order]
        rows = grad.reshape(-1, grad.shape[-1])[order]
        per_round = sink.round_rows()
        rounds = [(r * sink.rows + first, min(per_round, sink.rows - first))
                  for first in range(0, sink.rows, per_round) for r in range(sink.world)]
        edges = torch.tensor([e for lo, count in rounds for e in (lo, lo + count)], device=ids_sorted.device,
                             dtype=ids_sorted.dtype)
        at = torch.searchsorted(ids_sorted, edges).tolist()
        for k in range(0, len(rounds), sink.world):
            buffer = sink.buffer(rounds[k][1])
            for r in range(sink.world):
                (lo, count), start, end = rounds[k + r], at[2 * (k + r)], at[2 * (k + r) + 1]
                # autograd's own kernel on the round's tokens (the padding id skipped, as there)
                pad = padding_idx - lo if padding_idx is not None and lo <= padding_idx < lo + count else -1
                with sink.bucket.scope(GRADIENTS):
                    part = torch.ops.aten.embedding_dense_backward(rows[start:end], ids_sorted[start:end] - lo, count,
                                                                   pad, False)
                buffer[r].copy_(part)
                del part
            sink.reduce(buffer)
            del buffer
        sink.close()
        return None, None, None, None


def wrap(module: torch.nn.Embedding, hand: Any) -> Any:
    """Run ``module``'s forward through `RowsEmbedding` (a removable handle)."""
    def forward(original: Callable, ids: torch.Tensor) -> torch.Tensor:
        if not plain(module) or torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return original(ids)
        return RowsEmbedding.apply(ids, module.weight, module.padding_idx, hand)

    return wrap_method(module, "forward", forward)


__all__ = ["RowsEmbedding", "plain", "wrap"]
