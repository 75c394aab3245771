"""The Adam/AdamW update of one chunk: one pure function, whatever the states' storage format.

It repeats ``torch.optim.adam._single_tensor_adam`` (torch 2.13) op for op, so with fp32 states
(views of the state tensors, updated in place) the result equals ``torch.optim.AdamW`` /
``torch.optim.Adam`` bit for bit; elementwise ops give the same bits whatever the chunking.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def param_numel(p: torch.Tensor) -> int:
    """``p``'s element count, also while optimizer_states' ``masters`` keeps it parked (an empty tensor
    then, its count in ``xirang_parked_numel``)."""
    parked = getattr(p, "xirang_parked_numel", None)
    return p.numel() if parked is None or p.numel() else parked


def store_param(p: torch.Tensor, flat_p: torch.Tensor, start: int, values: torch.Tensor) -> None:
    """Store a chunk's updated fp32 ``values`` into ``flat_p[start:start + len]``, the flat view of
    ``p``: through ``p.xirang_write_back(values, start)`` where ``p`` carries one (grad_release's bf16
    weights without a master round stochastically, with the noise of ``p.xirang_weight_noise``, which
    the fused update reads to round in its kernel; ``values`` may be consumed), else a copy (round
    to nearest into a 16-bit parameter)."""
    write_back = getattr(p, "xirang_write_back", None)
    if write_back is not None:
        write_back(values, start)
    else:
        flat_p[start:start + values.numel()].copy_(values)


def grad_chunk(p: torch.Tensor, flat_g: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``flat_g[start:end]`` (the flat view of ``p.grad``) in fp32, times each multiplier of
    ``p.xirang_grad_scale`` in order where ``p`` carries it (grad_release's in-place update: the
    unscale and clip coefficients, applied a chunk at a time instead of to a widened whole shard). The
    gradient itself is left as it is (a chunk may be read twice: `first_step`'s fallback), so the
    scaled chunk is a new tensor either way."""
    g32 = flat_g[start:end] if flat_g.dtype == torch.float32 else flat_g[start:end].float()
    scales = getattr(p, "xirang_grad_scale", ())
    for i, scale in enumerate(scales):
        g32 = g32 * scale if i == 0 and flat_g.dtype == torch.float32 else g32.mul_(scale)
    return g32


@dataclass(frozen=True)
class AdamHyper:
    """Hyperparameters of one step of one parameter group.

    Attributes:
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        decoupled: AdamW's decoupled weight decay (``adam_w_mode``); else Adam's L2 term.
        maximize: ascend instead of descend.
        bias_correction: divide the moments by ``1 - beta ** step`` (DeepSpeed's FusedAdam key).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool = False
    bias_correction: bool = True


def adam_chunk_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: float, h: AdamHyper) -> None:
    """Update ``param``, ``exp_avg`` and ``exp_avg_sq`` in place (all fp32, same shape).

    Args:
        param: the fp32 parameter chunk (the master weights under DeepSpeed).
        grad: its gradient, fp32 (not modified).
        exp_avg, exp_avg_sq: the decoded moments (views of fp32 state, or temporaries).
        step: the step number after increment (1 on the first step).
        h: the group's hyperparameters.
    """
    if h.maximize:
        grad = -grad
    if h.weight_decay != 0:
        if h.decoupled:
            param.mul_(1 - h.lr * h.weight_decay)
        else:
            grad = grad.add(param, alpha=h.weight_decay)
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    if h.bias_correction:
        bias_correction1 = 1 - h.beta1 ** step
        bias_correction2 = 1 - h.beta2 ** step
    else:
        bias_correction1 = bias_correction2 = 1.0
    step_size = h.lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(h.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
