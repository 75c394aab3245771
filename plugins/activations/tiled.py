"""``recompute_tiled``: a token-wise module recomputed in backward a slice of tokens at a time.

A module whose output for a token depends on that token's input alone (a feed-forward block: linear,
activation, linear, dropout) can run on slices of its input. Under ``recompute_tiled`` it keeps only
its input, like ``recompute``, and both its forward and its recomputation in backward run on
``tiles`` slices along the input's first dimension (its second, when the first has fewer elements
than ``tiles``): during backward one slice's intermediates exist at a time instead of the whole
module's (DeepSpeed's TiledMLP, Arctic's long-sequence training, does the same). The forward of each
slice runs without grad; backward recomputes the slice with torch's (and the accelerator's) random
state as that slice's forward had it, so dropout draws the same mask, and takes the slice's gradients
with ``torch.autograd.grad``. The parameters' gradients of all slices are summed and returned once, so
each parameter's gradient hooks (DeepSpeed's, grad_release's) fire once, as for an untiled module.

Exactness: the module's output and gradients are those of its slices: a matmul over a slice may
round differently from the matmul over all tokens, and the weight gradient is a sum over slices, so
results match ``recompute`` to rounding, not bit for bit (docs/activations.md).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch

DEFAULT_TILES = 4
"""Slices of a module fixed to ``recompute_tiled`` when no profile chose the number (planner off)."""
MAX_TILES = 64


def tile_count(transient_bytes: int, input_bytes: int) -> int:
    """Slices for a module whose recomputation holds ``transient_bytes`` beyond its input: enough for one
    slice's intermediates to be about its whole input (a 4x-wide feed-forward block: 8), between 2 and
    `MAX_TILES` (a call with fewer rows gets one slice per row)."""
    if input_bytes <= 0:
        return DEFAULT_TILES
    return max(2, min(-(-transient_bytes // input_bytes), MAX_TILES))


def tileable(args: tuple, kwargs: dict) -> bool:
    """A call ``recompute_tiled`` can slice: one tensor argument with at least two dimensions, no
    tensor among the keyword arguments."""
    return (len(args) == 1 and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2
            and not any(isinstance(v, torch.Tensor) for v in kwargs.values()))


def _slices(x: torch.Tensor, tiles: int) -> tuple[int, list[slice]]:
    dim = 0 if x.shape[0] >= tiles or x.dim() == 2 else 1
    size = x.shape[dim]
    step = -(-size // max(1, min(tiles, size)))
    return dim, [slice(start, min(start + step, size)) for start in range(0, size, step)]


def _rng_state(device: torch.device) -> tuple:
    if device.type == "cpu":
        return (torch.get_rng_state(), None)
    from deepspeed.accelerator import get_accelerator

    return (torch.get_rng_state(), get_accelerator().get_rng_state())


@contextlib.contextmanager
def _forked_rng(state: tuple, device: torch.device):
    """Run with ``state`` and put the states of this moment back after (the run's later draws unmoved)."""
    now = _rng_state(device)
    torch.set_rng_state(state[0])
    if state[1] is not None:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().set_rng_state(state[1])
    try:
        yield
    finally:
        torch.set_rng_state(now[0])
        if now[1] is not None:
            from deepspeed.accelerator import get_accelerator

            get_accelerator().set_rng_state(now[1])


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Callable, tiles: int, scope: Callable[[], ContextManager], x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        dim, parts = _slices(x, tiles)
        states, outs = [], []
        for part in parts:
            piece = x.narrow(dim, part.start, part.stop - part.start)
            states.append(_rng_state(x.device))
            outs.append(run(piece))
            if not isinstance(outs[-1], torch.Tensor):
                raise TypeError(f"xirang.activations: a recompute_tiled module returned {type(outs[-1]).__name__}; the "
                                "tiled options slice modules that take and return one tensor. Fix: leave it out of "
                                "xirang.activations.token_wise (or of the recompute_tiled lists)")
        ctx.run, ctx.scope, ctx.dim, ctx.parts, ctx.states, ctx.params = run, scope, dim, parts, states, params
        ctx.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", x.device.type)]
        ctx.save_for_backward(x)  # through the saved-tensor hooks around the call, as recompute's inputs
        return torch.cat(outs, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        params = list(ctx.params)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        sums: list[Optional[torch.Tensor]] = [None] * len(params)
        for part, state in zip(ctx.parts, ctx.states):
            piece = x.narrow(ctx.dim, part.start, part.stop - part.start).detach().requires_grad_(grad_x is not None)
            with torch.enable_grad(), _forked_rng(state, x.device), ctx.scope(), contextlib.ExitStack() as stack:
                for device, enabled, dtype in ctx.autocast:
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
                out = ctx.run(piece)
            inputs = ([piece] if grad_x is not None else []) + params
            got = torch.autograd.grad(out, inputs, grad.narrow(ctx.dim, part.start, part.stop - part.start),
                                      allow_unused=True)
            if grad_x is not None:
                grad_x.narrow(ctx.dim, part.start, part.stop - part.start).copy_(got[0])
                got = got[1:]
            for i, g in enumerate(got):  # summed in fp32 at least: a 16-bit sum over slices rounds at each add
                if g is not None:
                    sums[i] = g.to(torch.promote_types(g.dtype, torch.float32)) if sums[i] is None else sums[i].add_(g)
            del out, got
        sums = [s if s is None else s.to(p.dtype) for s, p in zip(sums, params)]
        by_param = dict(zip(map(id, params), sums))
        return (None, None, None, grad_x, *(by_param.get(id(p)) for p in ctx.params))


def run_tiled(original: Callable, x: torch.Tensor, kwargs: dict, tiles: int, module: torch.nn.Module,
              scope: Callable[[], ContextManager]) -> torch.Tensor:
    """``original(x, **kwargs)`` under ``recompute_tiled``: ``tiles`` slices, only ``x`` kept.

    Args:
        module: whose parameters the slices' gradients are taken for.
        scope: entered around each slice's recomputation (the tracker's activations scope).
    """
    params = tuple(p for p in module.parameters() if p.requires_grad)
    run = (lambda piece: original(piece, **kwargs)) if kwargs else original
    return _Tiled.apply(run, tiles, scope, x, *params)


__all__ = ["DEFAULT_TILES", "run_tiled", "tile_count", "tileable"]
