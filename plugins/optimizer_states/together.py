"""Small tensors with fp32 states, stepped together: one multi-tensor op per step of the update.

`DynamicAdamW` keeps some tensors' states in fp32 for good (norms and biases: ``min_numel``,
``keep_fp32``, ``keep_fp32_params``). Each is small, and the eager update takes about ten ops a tensor
(`update.adam_chunk_` and the step counter), each a kernel launch on a GPU: a model's norms and biases
cost hundreds of launches a step (issue 58; the balanced preset's step at gpt-small, counted as a GPU
runs it, spent 272 of its 975 kernels there). Here they take torch's multi-tensor ops
(``torch._foreach_*``, what ``torch.optim.AdamW`` runs by default on CUDA): the same arithmetic per
element in the same order, so on the CPU the result is `update.adam_chunk_`'s bit for bit
(``tests/optimizer_states/test_together.py``), and on CUDA it is torch's default AdamW's. Where the fused
update is on (``fused: "auto"`` off the CPU, ``true``), they take torch's fused Adam kernel instead, one op
for them all (`fused.FusedStep.adam_`: ``torch.optim.AdamW(fused=True)``'s result bit for bit), and so does
an fp32 tensor too large or measured to be here (`optimizer.DynamicAdamW._run_chunks`).

Which tensors (`steps_together`): fp32 states already made, a steady fp32 tensor (not measured: a
measured one may leave fp32), an fp32 parameter and gradient, dense and contiguous, with no
``xirang_write_back`` or ``xirang_grad_scale`` (grad_release's in-place bf16 weights take the eager
chunks). Their elements are stepped in batches of at most ``chunk_numel`` at a time, so the multi-tensor
temporaries (the square root of the second moment) stay within the eager chunk's, which the estimate
prices.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from xirang_ds.compat.torch import foreach
from xirang_ds.plugins.optimizer_states.formats import format_of
from xirang_ds.plugins.optimizer_states.update import AdamHyper


def plain_fp32(p: torch.Tensor) -> bool:
    """``p`` and its gradient are dense fp32, and ``p`` is updated as it is: no ``xirang_write_back`` or
    ``xirang_grad_scale`` (grad_release's in-place bf16 weights)."""
    g = p.grad
    return p.dtype == torch.float32 and g.dtype == torch.float32 and not g.is_sparse \
        and getattr(p, "xirang_write_back", None) is None and not getattr(p, "xirang_grad_scale", ())


def steps_together(opt: Any, p: torch.Tensor, group: dict) -> bool:
    """``p`` (with a gradient) takes the multi-tensor update this step (module docstring)."""
    state = opt.state.get(p)
    return bool(state) and format_of(state) == "fp32" and opt._pinned(p, group) and not opt._measured(p, group) \
        and plain_fp32(p) and 0 < p.numel() <= opt.config.chunk_numel and p.is_contiguous() \
        and p.grad.is_contiguous()


def batches(params: Sequence[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """``params`` in order, in runs of at most ``limit`` elements (each tensor is at most ``limit``)."""
    run: list[torch.Tensor] = []
    size = 0
    for p in params:
        if run and size + p.numel() > limit:
            yield run
            run, size = [], 0
        run.append(p)
        size += p.numel()
    if run:
        yield run


def adam_foreach_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], steps: list[int], h: AdamHyper) -> None:
    """`update.adam_chunk_` over lists of flat fp32 tensors (each ``steps[i]`` its step after increment),
    op for op on the multi-tensor path."""
    if h.maximize:
        grads = foreach.neg(grads)
    if h.weight_decay != 0:
        if h.decoupled:
            foreach.mul_(params, 1 - h.lr * h.weight_decay)
        else:
            grads = foreach.add(grads, params, alpha=h.weight_decay)
    foreach.lerp_(exp_avgs, grads, 1 - h.beta1)
    foreach.mul_(exp_avg_sqs, h.beta2)
    foreach.addcmul_(exp_avg_sqs, grads, grads, value=1 - h.beta2)
    if h.bias_correction:
        corrections = [(1 - h.beta1 ** step, 1 - h.beta2 ** step) for step in map(float, steps)]
    else:
        corrections = [(1.0, 1.0)] * len(steps)
    denom = foreach.sqrt(exp_avg_sqs)
    foreach.div_(denom, [bc2 ** 0.5 for _, bc2 in corrections])
    foreach.add_(denom, h.eps)
    foreach.addcdiv_(params, exp_avgs, denom, [-(h.lr / bc1) for bc1, _ in corrections])


def update_together(opt: Any, params: list[torch.Tensor], hyper: AdamHyper) -> None:
    """Step ``params`` (each `steps_together`) of one group: their step counters in one op, their update
    on torch's fused kernel where the fused update is on (`fused.FusedStep.adam_`: one op for them all), else
    in batches of at most ``chunk_numel`` elements."""
    states = [opt.state[p] for p in params]
    steps = [opt._next_step(p) for p in params]
    foreach.add_([s["step"] for s in states], 1.0)
    opt._step_numbers.update((p, (s["step"], step)) for p, s, step in zip(params, states, steps))
    flat_p, flat_g = [p.view(-1) for p in params], [p.grad.view(-1) for p in params]
    m, v = ([s[k].view(-1) for s in states] for k in ("exp_avg", "exp_avg_sq"))
    if opt.fused.adam_(flat_p, flat_g, m, v, steps, hyper):
        return
    start = 0
    for run in batches(params, opt.config.chunk_numel):  # in order: each run the next len(run) tensors
        end = start + len(run)
        adam_foreach_(flat_p[start:end], flat_g[start:end], m[start:end], v[start:end], steps[start:end], hyper)
        start = end

__all__ = ["adam_foreach_", "batches", "plain_fp32", "steps_together", "update_together"]
