"""The fused update: decode, Adam and encode of a tensor (off the CPU) or a chunk as one compiled call.

The eager update (`DynamicAdamW._run_chunks`) runs a chunk as separate ATen ops: 44 per int8 chunk,
58 per int4 chunk and 12 per bf16 chunk besides views, each a kernel launch on a GPU. Here the same three steps,
written with the same `formats` code, are traced by ``torch.compile`` (Inductor: Triton on a GPU,
C++ on the CPU) into one graph call.
On the CPU Inductor emits one ``cpp_fused_*`` call per bf16 or int8 chunk and three per int4 chunk
(two unpack the nibbles of each moment); ``tests/optimizer_states/test_fused.py`` counts them.

* Off the CPU a tensor (a flat ZeRO partition, a bucket's slice, a parameter) takes one call: one
  graph per format whose length is dynamic, the last block padded inside it (`BlockQuantFormat.encode`),
  so a step's kernel calls follow the number of tensors, not their size (the eager path took 44-58
  ops per 131,072-element chunk: about 1,000 calls per step at 134M elements). On the CPU a tensor
  runs in chunks of one static length (a graph per format and chunk length, cached by Dynamo), its
  last, shorter chunk eagerly: Inductor's C++ for a whole tensor writes the decoded moments out whole
  between its five loop nests (8 bytes of temporaries per element), and its dynamic-length code took
  4x the eager path's time per int8 element and over 300x at int4 (``benchmarks/fused_calls.py``;
  per chunk 6x and 118x the static graph's, ``benchmarks/fused_dynamic_tail.py``). Whether
  Triton keeps a whole tensor's moments in registers (a row-wise reduction and its epilogue, as in
  a softmax) is for the next GPU run to measure; `whole_tensor` is the switch.
* The hyperparameters and the step's bias corrections go in as one small fp32 tensor: a new step
  or learning rate is not a new graph. Adam and AdamW, ``maximize`` and ``bias_correction`` share
  the graph through neutral values (a decay of 1, an L2 term of 0, a sign of 1), which are exact.
* Not bit-identical to the eager path: ATen's CPU ``lerp`` uses a fused multiply-add and Inductor's
  does not, so a value on a rounding boundary of the format can land on the neighbouring code. The
  test bounds the difference over 6 steps: the parameters' distance from the eager run at most 2% of
  the eager run's distance from fp32 states (measured 0.1-0.5%), and at most 1% of decoded state
  elements off by more than 1e-5 relative.
* fp32 states always take the eager path: it equals ``torch.optim.AdamW`` bit for bit.
* The eager path also runs a tensor whose step draws stochastic rounding, measures for the
  stability policy or changes format; a parameter that is not fp32; and any step taken under a
  ``TorchDispatchMode`` (the memory tracker), where Dynamo does not trace; only the step counters
  (`xirang_ds.step_counts`) are lifted for the call, which they count as one kernel.

``fused: "auto"`` compiles on GPUs, where the eager path's launches cost most, and stays eager on
the CPU: there each format's graph takes 4-15 s to build (and needs a C++ compiler) before the
update gets faster (one step over 4 tensors of 1024x1024 and one of 4096x4096, 2 threads,
``benchmarks/optimizer_states_compare.py``: int8 14.39 -> 8.60 ns/parameter, int4 18.98 -> 14.82,
bf16 5.33 -> 3.26; bitsandbytes AdamW8bit 25.03, torchao AdamW8bit 46.66). ``fused: true`` pays that
once on a long CPU run.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from xirang_ds.compat.torch import compile_unavailable
from xirang_ds.plugins.optimizer_states.formats import Buffers, StateFormat
from xirang_ds.plugins.optimizer_states.update import AdamHyper
from xirang_ds.step_counts import compiled_call, only_counters_active

FUSED_FORMATS = frozenset({"bf16", "int8", "int4"})
"""State formats the fused kernel updates (fp32 stays on the bit-exact eager path)."""


class FusedUnavailable(RuntimeError):
    """``fused: true`` and the kernel cannot be compiled here (the message says why and the fix)."""


def hyper_tensor(h: AdamHyper, step: int, device: torch.device) -> torch.Tensor:
    """The kernel's scalars as one fp32 tensor on ``device``: decay, L2 factor, gradient sign,
    ``1 - beta1``, ``beta2``, ``1 - beta2``, step size, ``sqrt(1 - beta2 ** step)``, eps (computed
    in double on the host, as the eager path computes its Python scalars)."""
    bc1, bc2 = (1 - h.beta1 ** step, 1 - h.beta2 ** step) if h.bias_correction else (1.0, 1.0)
    values = [1 - h.lr * h.weight_decay if h.decoupled else 1.0, 0.0 if h.decoupled else h.weight_decay,
              -1.0 if h.maximize else 1.0, 1 - h.beta1, h.beta2, 1 - h.beta2, h.lr / bc1, bc2 ** 0.5, h.eps]
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def chunk_step(fmt: StateFormat, p: torch.Tensor, g: torch.Tensor, m_buf: Buffers, v_buf: Buffers,
               scalars: torch.Tensor) -> None:
    """One chunk's update in place: ``p`` (fp32), its gradient ``g`` and the moments' buffers
    (`StateFormat.window` views), in `update.adam_chunk_`'s order of operations."""
    decay, l2, sign, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps = scalars.unbind()
    n = p.numel()
    g = g.float() * sign
    g = g + l2 * p
    p.mul_(decay)
    m = fmt.decode("exp_avg", m_buf, 0, n)
    v = fmt.decode("exp_avg_sq", v_buf, 0, n)
    m.lerp_(g, one_minus_beta1)
    v.mul_(beta2).addcmul_(g, g * one_minus_beta2)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.sub_(step_size * (m / denom))
    fmt.encode("exp_avg", m, m_buf, 0)
    fmt.encode("exp_avg_sq", v, v_buf, 0)


def whole_step(fmt: StateFormat, p: torch.Tensor, g: torch.Tensor, m_buf: Buffers, v_buf: Buffers,
               scalars: torch.Tensor) -> None:
    """`chunk_step` over a whole tensor (its own code object, so Dynamo caches its dynamic-length
    graphs apart from the static ones)."""
    chunk_step(fmt, p, g, m_buf, v_buf, scalars)


def whole_tensor(device_type: str) -> bool:
    """A tensor's update is one compiled call of dynamic length on this device type (module docstring:
    not on the CPU, where chunks of a static length are faster and hold chunk-sized temporaries)."""
    return device_type != "cpu"


_KERNEL: Optional[Callable[..., None]] = None
"""`chunk_step` compiled (static shapes: Dynamo keeps one graph per format and chunk length)."""
_WHOLE_KERNEL: Optional[Callable[..., None]] = None
"""`whole_step` compiled with dynamic shapes."""


class FusedStep:
    """Where and how `DynamicAdamW` runs the fused kernel.

    Args:
        setting: the section's ``fused``: ``"auto"`` (compiled on GPUs, eager on the CPU), ``True``
            (compiled on every device; an error where it cannot be), ``False`` (always eager).

    Attributes:
        chunks: compiled calls so far (whole tensors and chunks).
        wholes: tensors updated whole by the dynamic-length kernel so far.
        eager: ``{device type: reason}`` for the devices this optimizer keeps eager.
        chunked: ``{(device type, format): reason}`` where the whole-tensor kernel failed to compile
            and tensors run in static chunks instead.
    """

    def __init__(self, setting: Union[bool, str]):
        self.setting = setting
        self.chunks = 0
        self.wholes = 0
        self.eager: dict[str, str] = {}
        self.chunked: dict[tuple[str, str], str] = {}
        self._compiled: set[tuple[str, ...]] = set()
        self._scalars: tuple[Any, Optional[torch.Tensor]] = (None, None)

    def applies(self, fmt: StateFormat, p: torch.Tensor, g: torch.Tensor) -> bool:
        """The kernel updates this tensor now (format, dtypes, device, no dispatch mode but the step
        counters, which `step_counts.compiled_call` lifts for the call)."""
        return (fmt.name in FUSED_FORMATS and p.dtype == torch.float32 and g.dtype.is_floating_point
                and self.enabled(p.device.type) and only_counters_active())

    def enabled(self, device_type: str) -> bool:
        """The kernel runs on this device type (decided once; the reason is kept when not).

        Raises:
            FusedUnavailable: ``fused: true`` and compile is unavailable for the device.
        """
        if device_type in self.eager:
            return False
        reason = None
        if self.setting is False:
            reason = "fused: false"
        elif self.setting == "auto" and device_type == "cpu":
            reason = "fused: auto stays eager on the CPU (set true to compile there)"
        else:
            missing = compile_unavailable(device_type)
            if missing and self.setting is True:
                raise FusedUnavailable(f"xirang.optimizer_states.fused: true cannot compile the update on "
                                       f"{device_type}: {missing}. Fix: install what is missing, or set "
                                       f"\"fused\": \"auto\" (eager where compile is unavailable) or false")
            reason = f"fused: auto, and {missing}" if missing else None
        if reason:
            self.eager[device_type] = reason
        return reason is None

    def run(self, fmt: StateFormat, flat_p: torch.Tensor, flat_g: torch.Tensor, buffers: Buffers, step: int,
            hyper: AdamHyper, chunk: int) -> int:
        """Update a tensor with the compiled kernels; the number of leading elements done. The caller
        updates the rest eagerly: on the CPU the last, shorter chunk, or everything from the chunk where
        ``fused: auto`` could not compile (this device then stays eager)."""
        n = flat_p.numel()
        device = flat_p.device.type
        scalars = self._scalars_for(hyper, step, flat_p.device)
        if whole_tensor(device) and (device, fmt.name) not in self.chunked:
            if self._call((device, fmt.name, "whole"), fmt, flat_p, flat_g, buffers, 0, n, scalars):
                self.chunks += 1
                self.wholes += 1
                return n
        for start in range(0, n // chunk * chunk, chunk):
            if not self._call((device, fmt.name), fmt, flat_p, flat_g, buffers, start, start + chunk, scalars):
                return start
            self.chunks += 1
        return n // chunk * chunk

    def _scalars_for(self, hyper: AdamHyper, step: int, device: torch.device) -> torch.Tensor:
        """`hyper_tensor`, made once per group, step and device (one host-to-device copy a step, not
        one a tensor)."""
        key, scalars = self._scalars
        if key != (hyper, step, device):
            scalars = hyper_tensor(hyper, step, device)
            self._scalars = ((hyper, step, device), scalars)
        return scalars

    def _call(self, key: tuple[str, ...], fmt: StateFormat, flat_p: torch.Tensor, flat_g: torch.Tensor,
              buffers: Buffers, start: int, end: int, scalars: torch.Tensor) -> bool:
        args = (fmt, flat_p[start:end], flat_g[start:end], fmt.window("exp_avg", buffers, start, end),
                fmt.window("exp_avg_sq", buffers, start, end), scalars)
        if key in self._compiled:
            with compiled_call():
                (_WHOLE_KERNEL if len(key) == 3 else _KERNEL)(*args)
            return True
        return self._first_call(key, args)

    def _first_call(self, key: tuple[str, ...], args: tuple[Any, ...]) -> bool:
        """Compile (or load) a kernel on its first use for a device and format. A failure there
        happens before the kernel runs, so nothing was written: ``auto`` goes eager, ``true`` raises;
        a whole-tensor kernel that fails leaves that device and format in chunks, either way."""
        global _KERNEL, _WHOLE_KERNEL
        whole = len(key) == 3
        try:
            with compiled_call():
                if whole:
                    if _WHOLE_KERNEL is None:
                        _WHOLE_KERNEL = torch.compile(whole_step, dynamic=True, fullgraph=True)
                    _WHOLE_KERNEL(*args)
                else:
                    if _KERNEL is None:
                        _KERNEL = torch.compile(chunk_step, dynamic=False, fullgraph=True)
                    _KERNEL(*args)
        except Exception as error:  # noqa: BLE001 (Dynamo and Inductor raise many kinds)
            reason = f"compiling failed ({type(error).__name__}: {error})"
            if whole:  # the static chunks' kernel may still work
                self.chunked[key[:2]] = reason
                return False
            if self.setting is True:
                raise FusedUnavailable(f"xirang.optimizer_states.fused: true failed to compile the {key[1]} update "
                                       f"on {key[0]}: {type(error).__name__}: {error}. Fix: set \"fused\": "
                                       f"\"auto\" or false") from error
            self.eager[key[0]] = f"fused: auto, and {reason}"
            return False
        self._compiled.add(key)
        return True

    def describe(self) -> str:
        """One line: how many chunks the compiled kernel updated, and why a device stays eager."""
        eager = "; ".join([f"eager on {device}: {why}" for device, why in self.eager.items()]
                          + [f"chunks on {device} ({name}): {why}" for (device, name), why in self.chunked.items()])
        if self.chunks:
            wholes = f", {self.wholes:,} of them whole tensors" if self.wholes else ""
            return f"fused update: {self.chunks:,} compiled call(s){wholes}" + (f" ({eager})" if eager else "")
        return eager or f"fused: {self.setting!r}, no chunk updated yet"
