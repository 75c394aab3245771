"""A measured tensor's first update without its whole fp32 moments.

A tensor under ``keep_fp32_embeddings_and_norms: "measured"`` (an embedding) keeps fp32 states until
the error its update direction takes in the step policy's integer format is measured
(`DynamicAdamW._measure_release`). Measured after the first update, that held the whole tensor's fp32
moments for the step (8 bytes per element: a 162M GPT's token embedding holds 147 MiB per rank at 2
ranks) beside everything else, even when the measurement then moved it to int8 (2 bytes).

On the first update the moments start from zero, so this pass does it chunk by chunk instead: each
chunk's fp32 moments are computed (``adam_chunk_``, the update every format runs), the parameter is
updated with them, and they are encoded into each candidate format (the policy's, then the wider
integer ones) with the update direction's error summed per candidate. The first candidate within
``measured_max_error`` keeps its encoded states: the parameter and the states are those of the fp32
first update followed by the measurement, and no more than the candidates' buffers (3 bytes per
element for int4 and int8, 2 for int8 alone) is held. When none qualifies the tensor stays fp32: its
moments are rebuilt from the gradient, which is still there (from zero state they depend on the
gradient alone; Adam's L2 term reads the parameter before the update, so that case takes the whole
fp32 path).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from xirang_ds.plugins.optimizer_states.formats import MOMENTS, STATE_DTYPE_ORDER, update_error
from xirang_ds.plugins.optimizer_states.update import AdamHyper, adam_chunk_, grad_chunk, store_param


CHUNK_BYTES = 36
"""The most the first update holds at once per element of a chunk, besides the parameter, its gradient and the
candidates' buffers: the chunk's fp32 moments, their copies for a candidate's encoding and the update direction's
error (`formats.update_error`: the directions in fp32, their difference and square in float64). The ordinary
update holds 16 (`plugin.OptimizerStatesPlugin.adjust_estimate`). Pinned against the tracker by
``tests/optimizer_states/test_units.py``."""


def candidates(opt: Any, state: dict, step: int) -> list[str]:
    """The integer formats a measured tensor may leave fp32 for after ``step``: the policy's, then the
    wider ones below bf16 (int8 after int4); empty when the policy keeps it in 16 or 32 bits."""
    return widening(opt.policy.target(state, step))


def widening(name: str) -> list[str]:
    """``name`` and the wider integer formats below bf16 (int8 after int4); empty unless ``name`` is one."""
    if not name.startswith("int"):
        return []
    return list(STATE_DTYPE_ORDER[STATE_DTYPE_ORDER.index(name):STATE_DTYPE_ORDER.index("bf16"):-1])


def applies(opt: Any, p: torch.Tensor, state: dict, hyper: AdamHyper) -> bool:
    """The first update of a measured tensor that may leave fp32 (not under Adam's L2 term)."""
    return not state and not (hyper.weight_decay != 0 and not hyper.decoupled) and bool(candidates(opt, state, 1))


def first_update(opt: Any, p: torch.Tensor, state: dict, hyper: AdamHyper) -> None:
    """``p``'s first update, its states measured chunk by chunk (module docstring)."""
    state["step"] = torch.tensor(1.0, dtype=torch.float32)
    names = candidates(opt, state, 1)
    formats = [opt._format(name) for name in names]
    outs = [{k: v for m in MOMENTS for k, v in fmt.zeros(m, p.numel(), p.device, opt._empty()).items()}
            for fmt in formats]
    draws = opt._rounding(p, 1)
    flat_p, flat_g = flat_view(p), flat_view(p.grad)
    n = flat_p.numel()
    chunk = math.lcm(opt.config.chunk_numel, *(fmt.block_size for fmt in formats))
    sums = torch.zeros(len(formats), 2, dtype=torch.float64, device=flat_p.device)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        m, v = _first_moments(p, flat_p, flat_g, start, end, hyper, update=True)
        for i, fmt in enumerate(formats):
            fmt.encode("exp_avg", m.clone(), outs[i], start, draws)
            fmt.encode("exp_avg_sq", v.clone(), outs[i], start, draws)
            du, u = update_error((m, v.clone()), fmt, outs[i], start, end, hyper.eps)  # it takes v's root in place
            sums[i, 0] += du
            sums[i, 1] += u
    errors = [(du / u) ** 0.5 if u > 0 else 0.0 for du, u in sums.tolist()]  # one host sync
    policy = names[0]
    for name, fmt, error in zip(names, formats, errors):
        leaves = error <= opt.config.measured_max_error
        opt.measurements.append((1, p.numel(), name, error, leaves))
        if leaves:
            if name != policy:
                state["measured_floor"] = STATE_DTYPE_ORDER.index(name)
            _settle(opt, p, state, name, fmt, outs[names.index(name)])
            return
    outs.clear()  # no candidate qualifies: their buffers go before the fp32 moments come
    fp32 = opt._format("fp32")
    out = {k: v for mom in MOMENTS for k, v in fp32.zeros(mom, n, p.device, opt._empty()).items()}
    for start in range(0, n, chunk):  # the moments again, from the gradient alone; the parameter is done
        end = min(n, start + chunk)
        m, v = _first_moments(p, flat_p, flat_g, start, end, hyper, update=False)
        fp32.encode("exp_avg", m, out, start, None)
        fp32.encode("exp_avg_sq", v, out, start, None)
    _settle(opt, p, state, "fp32", fp32, out)


def _first_moments(p: torch.Tensor, flat_p: torch.Tensor, flat_g: torch.Tensor, start: int, end: int,
                   hyper: AdamHyper, update: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 moments of the first update of ``flat_p[start:end]`` (from zero), the parameter
    updated with them when ``update`` (else a scratch copy takes the update)."""
    p32 = flat_p[start:end] if flat_p.dtype == torch.float32 else flat_p[start:end].float()
    if not update:
        p32 = p32.clone()
    g32 = grad_chunk(p, flat_g, start, end)
    m, v = torch.zeros_like(g32), torch.zeros_like(g32)
    adam_chunk_(p32, g32, m, v, 1.0, hyper)
    if update and p32.data_ptr() != flat_p[start:end].data_ptr():
        store_param(p, flat_p, start, p32)
    return m, v


def _settle(opt: Any, p: torch.Tensor, state: dict, name: str, fmt: Any, buffers: dict) -> None:
    """``state`` holds ``buffers`` in format ``name`` from the first update on."""
    state.update(buffers)
    state["format"] = STATE_DTYPE_ORDER.index(name)
    state["block_size"] = fmt.block_size
    if name != "fp32":
        opt.format_changes.append((1, "fp32", name, p.numel()))
        for hook in list(opt._format_hooks.values()):
            hook(opt, p, "fp32", name)


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one flat view (DynamicAdamW steps parameters and gradients as flat runs of elements).

    Raises:
        ValueError: ``t`` is not contiguous.
    """
    if not t.is_contiguous():
        raise ValueError(f"DynamicAdamW needs contiguous parameters and gradients; got strides {t.stride()}")
    return t.view(-1)


__all__ = ["CHUNK_BYTES", "applies", "candidates", "first_update", "flat_view", "widening"]
