"""The chunked head's weight gradient by vocabulary rows, handed to grad_release as it is made.

`head_loss.ChunkedLinearCrossEntropy` makes the head's weight gradient by adding each token slice's
product into one ``vocab x hidden`` tensor, which autograd then gives whole to grad_release. Where
grad_release can take that parameter's gradient by rows (`xirang_ds.plugins.grad_release.rows`:
ZeRO 1/2 over several ranks, the weight alone in its bucket and not tied), the backward here makes
it a round of rows at a time instead: for each rank's next rows, the logits of every token against
those rows, their gradient from the softmax's normaliser saved in forward (``lse``, one fp32 value a
token), and the rows' gradient over all tokens, written into the round's buffer and reduced at once.
The whole gradient never exists; the input's gradient adds each round's part in fp32.

Numerics: each logit is the head's own ``linear`` on the same row and the same weight row. The
logits' gradient is the softmax written out, ``exp(z - lse) * w`` less ``w`` at the target (``w``
the weight ``nll_loss`` gives the token), where torch's kernels compute ``exp(log_softmax(z))``:
equal to fp32 rounding before the cast to the head's dtype. The weight gradient sums over all tokens
in one product (one rounding, where the token slices round once a slice); the input's gradient
rounds once from fp32. So the result is exact to bf16 rounding, as the token slices are, not
bit-identical to them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn.functional as F

from xirang_ds.plugins.grad_release.rows import ATTR


def hand_over(weight: torch.Tensor, records: bool) -> Any:
    """grad_release's `RowHandOver` for ``weight`` with this use counted (``records``: the call
    records a graph that gives the weight a gradient), or ``None``."""
    hand = getattr(weight, ATTR, None) if records else None
    if hand is not None:
        hand.used()
    return hand


def lse_of(z: torch.Tensor) -> torch.Tensor:
    """The softmax normaliser of each row of a slice's logits, in fp32 (saved in forward)."""
    return torch.logsumexp(z.float(), 1)


def backward(sink: Any, grad_out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
             bias: Optional[torch.Tensor], target: torch.Tensor, total: torch.Tensor, lse: torch.Tensor,
             casts: tuple, ignore_index: int, reduction: str, tokens: int,
             scope: Optional[Callable[[], ContextManager]], need_h: bool, need_b: bool) -> tuple:
    """``(dh, db)`` of the chunked loss, the weight's gradient handed to ``sink`` (`RowSink`) by rows.

    Each round makes as many logits as a token slice of ``tokens`` rows would (``tokens x vocab``).
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    valid = target != ignore_index
    g = grad_out.float()
    w = (g if reduction == "none" else (g / total.float() if reduction == "mean" else g).expand(n)) * valid
    dh32 = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
    db = torch.empty(vocab, dtype=bias.dtype, device=bias.device) if need_b else None
    per_round = max(1, min(sink.rows, tokens * vocab // max(1, n * sink.world)))
    for first in range(0, sink.rows, per_round):
        count = min(per_round, sink.rows - first)
        buffer = sink.buffer(count)
        for r in range(sink.world):
            lo = r * sink.rows + first
            rows = weight[lo:lo + count]
            with scope() if scope is not None else contextlib.nullcontext():
                gz = _logits_grad(hidden, rows, bias[lo:lo + count] if bias is not None else None, casts, lse, w,
                                  target, valid, lo)
            if gz.dtype == buffer.dtype:
                torch.mm(gz.t(), hidden, out=buffer[r])
            else:
                buffer[r].copy_(gz.t().mm(hidden))
            if need_h:
                dh32.add_(gz.mm(rows))
            if need_b:
                db[lo:lo + count] = gz.sum(0)
            del gz
        sink.reduce(buffer)
        del buffer
    sink.close()
    return (dh32.to(hidden.dtype) if need_h else None), db


def round_bytes(tokens: int, rows: int, vocab: int, hidden: int, world: int, head_bytes: int, loss_bytes: int,
                comm_bytes: int) -> int:
    """The most `backward` holds at once besides what the loss saved, over ``tokens`` tokens with slices of ``rows``
    (the ``tokens`` argument there) and a weight of ``vocab x hidden`` taken by rows over ``world`` ranks: the
    input's fp32 gradient, a round's buffer (``comm_bytes`` an element) and, for each rank's rows, the logits of
    every token against them in the head's dtype (``head_bytes``) beside their copy in the loss's or fp32
    (`_logits_grad`), or their gradient in the head's dtype beside its product with the rows."""
    count = max(1, min(vocab // world, rows * vocab // max(1, tokens * world)))
    logits = tokens * count
    return 4 * tokens * hidden + world * count * hidden * comm_bytes + max(
        logits * (head_bytes + max(loss_bytes, 4)), logits * head_bytes + tokens * hidden * head_bytes)


def _logits_grad(hidden: torch.Tensor, rows: torch.Tensor, bias: Optional[torch.Tensor], casts: tuple,
                 lse: torch.Tensor, w: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
                 lo: int) -> torch.Tensor:
    """The loss's gradient with respect to the logits of weight rows ``[lo, lo + len(rows))``, in the
    head's dtype (the casts undone in reverse, as autograd would)."""
    z = F.linear(hidden, rows, bias)
    for dtype in casts:
        z = z.to(dtype)
    loss_dtype = z.dtype
    gz = z.float().sub_(lse.unsqueeze(1)).exp_().mul_(w.unsqueeze(1))
    del z
    # less w at each token's target where it falls in these rows (no host sync: a masked scatter)
    count = rows.shape[0]
    inside = valid & (target >= lo) & (target < lo + count)
    gz.scatter_add_(1, (target - lo).clamp(0, count - 1).unsqueeze(1), (-w * inside).unsqueeze(1))
    gz = gz.to(loss_dtype)
    for dtype in reversed((hidden.dtype,) + casts[:-1]):
        gz = gz.to(dtype)
    return gz


__all__ = ["backward", "hand_over", "lse_of", "round_bytes"]
