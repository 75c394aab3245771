"""The fused update: decode, Adam, encode and stochastic rounding of a tensor (off the CPU) or chunk as one call.

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
* Stochastic rounding is in the graph (issue 58): its noise is counter-based (grad_release's
  `stochastic.random_bits`, integer tensor arithmetic of a seed and each element's index; a graph
  cannot take a ``torch.Generator``), its keys and each call's first index tensor inputs, so the
  states' draws (`formats.Draws`) and a bf16 weight's are the eager path's bit for bit, whatever the
  chunking. A bf16 parameter is widened, updated and stored in the kernel: rounded stochastically
  where it carries ``xirang_weight_noise`` (grad_release's ``masters: none`` in place: one call per
  tensor covers decode, Adam, encode and the rounding into the weight, with the gradient's
  ``xirang_grad_scale`` multipliers), else to nearest. Each kind of call (stochastic states, a bf16
  weight) compiles a function of its own code (`_variant`), as Dynamo keeps 8 graphs per code object.
  A chunk (the CPU's static length) draws its states' noise in a compiled call of its own before its
  update (`formats.draw_chunk`, 8 bytes an element of the chunk), which takes the draws as an input:
  Inductor's C++ for the update with the hash inside took 36 ns an element of an int8 chunk against
  3.0 with the draws given and 1.6 for the draws alone (``benchmarks/fused_draws.py``; the generated
  loops are vectorized alike, the cause inside the compiler not found). A whole tensor (off
  the CPU) keeps the hash in its one call: its draws made apart would take 8 bytes an element of it.
  ZeRO-3's ``masters: none``, whose update is DeepSpeed's, rounds in a pass of its own after it:
  `FusedStep.round_`, one dynamic-length call per sub-group (a single loop, on the CPU too).
* fp32 states with an fp32 weight take torch's fused Adam kernel where this update is on (`FusedStep.adam_`:
  ``torch.optim.AdamW(fused=True)``'s bit for bit, one multi-tensor op for a group's small tensors or for one
  large one, no temporaries), and the eager path elsewhere (``torch.optim.AdamW``'s default, bit for bit;
  `together`). Under a 16-bit weight rounded stochastically (grad_release's ``masters: none`` in place: norms
  and biases kept in fp32), which equals neither, they take this kernel: one call per tensor there too, instead
  of about fifteen ops (`fuses`).
* The eager path also runs a tensor whose step measures for the stability policy or changes format;
  a parameter neither fp32 nor bf16, or one whose ``xirang_write_back`` has no ``xirang_weight_noise``;
  and any step taken under a ``TorchDispatchMode`` (the memory tracker), where Dynamo does not trace;
  only the step counters (`xirang_ds.step_counts`) are lifted for the call, which they count as one kernel.

``fused: "auto"`` compiles on GPUs, where the eager path's launches cost most, and stays eager on
the CPU: there each format's graph takes 4-15 s to build (and needs a C++ compiler) before the
update gets faster (one step over 4 tensors of 1024x1024 and one of 4096x4096, 2 threads,
``benchmarks/optimizer_states_compare.py``: int8 14.39 -> 8.60 ns/parameter, int4 18.98 -> 14.82,
bf16 5.33 -> 3.26; bitsandbytes AdamW8bit 25.03, torchao AdamW8bit 46.66). ``fused: true`` pays that
once on a long CPU run.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional, Union

import torch

from xirang_ds.compat.torch import compile_unavailable, fused_adam_, fused_adam_devices, fused_adamw_
from xirang_ds.plugins.grad_release.remainders import HALF, HIGH_HALF
from xirang_ds.plugins.grad_release.stochastic import noise_keys, stochastic_round
from xirang_ds.plugins.optimizer_states.formats import Buffers, Draws, StateFormat, draw_chunk
from xirang_ds.plugins.optimizer_states.update import AdamHyper
from xirang_ds.step_counts import compiled_call, only_counters_active

FUSED_FORMATS = frozenset({"bf16", "int8", "int4"})
"""State formats the fused kernel updates (fp32 stays on the bit-exact eager path, `fuses`)."""


def fuses(name: str, rounded_weight: bool = False) -> bool:
    """The fused kernel updates states in format ``name``: the low-bit ones, and fp32 where the weight is a
    16-bit one rounded stochastically (``rounded_weight``: grad_release's ``masters: none`` in place), whose
    result no longer equals ``torch.optim.AdamW``'s bit for bit whichever path runs it."""
    return name in FUSED_FORMATS or (name == "fp32" and rounded_weight)

Weight = tuple[torch.Tensor, Union[int, torch.Tensor]]
"""A 16-bit weight's stochastic rounding in the kernel: `stochastic.noise_keys` and the index of the
chunk's first element in the shard (`stochastic.stochastic_round`'s arguments)."""


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
               scalars: torch.Tensor, draws: Optional[Draws] = None, weight: Optional[Weight] = None,
               grad_scales: Optional[torch.Tensor] = None) -> None:
    """One chunk's update in place: ``p``, its gradient ``g`` and the moments' buffers
    (`StateFormat.window` views), in `update.adam_chunk_`'s order of operations.

    Args:
        p: the parameter chunk: fp32, or a 16-bit weight updated in fp32 and stored rounded
            stochastically with ``weight``'s noise (``masters: none``), else to nearest.
        draws: the states' stochastic rounding (`formats.Draws`, its offset the chunk's); None: nearest.
        grad_scales: two multipliers of the gradient, in order (grad_release's unscale and clip
            coefficients, `update.grad_chunk`; 1.0 where there is none: exact).
    """
    decay, l2, sign, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps = scalars.unbind()
    n = p.numel()
    g = g.float()
    if grad_scales is not None:
        g = g * grad_scales[0] * grad_scales[1]
    g = g * sign
    p32 = p if p.dtype == torch.float32 else p.float()
    g = g + l2 * p32
    p32.mul_(decay)
    m = fmt.decode("exp_avg", m_buf, 0, n)
    v = fmt.decode("exp_avg_sq", v_buf, 0, n)
    m.lerp_(g, one_minus_beta1)
    v.mul_(beta2).addcmul_(g, g * one_minus_beta2)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p32.sub_(step_size * (m / denom))
    if p32 is not p:
        p.copy_(p32 if weight is None else stochastic_round(p32, *weight).view(torch.float32))
    if fmt.name != "fp32":  # fp32's decode is a view of its buffer, updated in place above
        fmt.encode("exp_avg", m, m_buf, 0, draws)
        fmt.encode("exp_avg_sq", v, v_buf, 0, draws)


def whole_step(fmt: StateFormat, p: torch.Tensor, g: torch.Tensor, m_buf: Buffers, v_buf: Buffers,
               scalars: torch.Tensor, draws: Optional[Draws] = None, weight: Optional[Weight] = None,
               grad_scales: Optional[torch.Tensor] = None) -> None:
    """`chunk_step` over a whole tensor (its own code object, so Dynamo caches its dynamic-length
    graphs apart from the static ones)."""
    chunk_step(fmt, p, g, m_buf, v_buf, scalars, draws, weight, grad_scales)


def round_step(master: torch.Tensor, out: torch.Tensor, keys: torch.Tensor, start: torch.Tensor) -> None:
    """fp32 ``master`` (flat; consumed) rounded stochastically into bf16 ``out`` (`stochastic.round_` in one
    graph: ``masters: none`` where the update is not this kernel's, grad_release's transient masters and
    ZeRO-3's, whose update is DeepSpeed's, round in this pass after it)."""
    out.copy_(stochastic_round(master, keys, start).view(torch.float32))


def round8_step(master: torch.Tensor, out: torch.Tensor, keys: torch.Tensor, start: torch.Tensor) -> None:
    """fp32 ``master`` (flat; consumed) rounded stochastically to 16 significant bits, its bf16 rounding half
    away from zero into ``out`` (`remainders.round8_` in one graph: ``masters: remainders_8bit``)."""
    bits = stochastic_round(master, keys, start, low_bits=8)
    out.copy_(bits.add(HALF).bitwise_and_(HIGH_HALF).view(torch.float32))


def whole_tensor(device_type: str) -> bool:
    """A tensor's update is one compiled call of dynamic length on this device type (module docstring:
    not on the CPU, where chunks of a static length are faster and hold chunk-sized temporaries)."""
    return device_type != "cpu"


@functools.lru_cache(maxsize=1)
def _fused_adam_devices() -> frozenset:
    """Device types with torch's fused Adam kernel (asked once, not per tensor and step)."""
    return frozenset(fused_adam_devices())


def _identity(value: Any) -> Any:
    """A cache key's part: a tensor by identity (its values may change between steps), anything else by value."""
    return ("tensor", id(value)) if isinstance(value, torch.Tensor) else value


def _variant(function: Callable[..., None], tag: str) -> Callable[..., None]:
    """``function`` with a code object of its own: Dynamo keeps at most 8 graphs per code object
    (``recompile_limit``), so each kind of call (stochastic states, a 16-bit weight) gets its own."""
    name = f"{function.__name__}_{tag}"
    return types.FunctionType(function.__code__.replace(co_name=name, co_qualname=name), function.__globals__, name,
                              function.__defaults__)


_KERNEL: Optional[Callable[..., None]] = None
"""`chunk_step` compiled (static shapes: Dynamo keeps one graph per format and chunk length)."""
_WHOLE_KERNEL: Optional[Callable[..., None]] = None
"""`whole_step` compiled with dynamic shapes."""
ROUNDINGS: dict[int, Callable[..., None]] = {16: round_step, 8: round8_step}
"""The rounding passes by the low bits they clear: ``masters: none`` (to bf16), ``remainders_8bit``."""
_ROUND_KERNELS: dict[int, Callable[..., None]] = {}
"""`ROUNDINGS` compiled with dynamic shapes (one call per tensor on every device: one loop, no moments)."""
_DRAW_KERNEL: Optional[Callable[..., torch.Tensor]] = None
"""`formats.draw_chunk` compiled (static shapes: a graph per chunk length and number of bits)."""
_VARIANTS: dict[tuple[str, ...], Callable[..., None]] = {}
"""The other kinds of call, compiled, by their key's tags (``draws``, a weight dtype, ``whole``)."""


def _draw_kernel() -> Callable[..., torch.Tensor]:
    global _DRAW_KERNEL
    if _DRAW_KERNEL is None:
        _DRAW_KERNEL = torch.compile(draw_chunk, dynamic=False, fullgraph=True)
    return _DRAW_KERNEL


def _compiled(tags: tuple[str, ...]) -> Callable[..., None]:
    """The compiled kernel of a kind of call (built on its first use)."""
    global _KERNEL, _WHOLE_KERNEL
    whole = "whole" in tags
    if tags in ((), ("whole",)):
        if whole and _WHOLE_KERNEL is None:
            _WHOLE_KERNEL = torch.compile(whole_step, dynamic=True, fullgraph=True)
        elif not whole and _KERNEL is None:
            _KERNEL = torch.compile(chunk_step, dynamic=False, fullgraph=True)
        return _WHOLE_KERNEL if whole else _KERNEL
    if tags not in _VARIANTS:
        function = _variant(whole_step if whole else chunk_step, "_".join(tags))
        _VARIANTS[tags] = torch.compile(function, dynamic=whole, fullgraph=True)
    return _VARIANTS[tags]


class FusedStep:
    """Where and how `DynamicAdamW` runs the fused kernel.

    Args:
        setting: the section's ``fused``: ``"auto"`` (compiled on GPUs, eager on the CPU), ``True``
            (compiled on every device; an error where it cannot be), ``False`` (always eager).

    Attributes:
        chunks: compiled update calls so far (whole tensors and chunks).
        draw_calls: compiled calls that drew a chunk's stochastic rounding noise so far (`draw_chunk`).
        wholes: tensors updated whole by the dynamic-length kernel so far.
        adam_calls: calls of torch's fused Adam kernel so far (fp32 states, `adam_`).
        rounds: compiled rounding passes so far (`round_`: ``masters: none`` and ``remainders_8bit`` where the
            update is not this kernel's: grad_release's transient masters, ZeRO-3's DeepSpeed update).
        eager: ``{device type: reason}`` for the devices this optimizer keeps eager.
        chunked: ``{(device type, format): reason}`` where the whole-tensor kernel failed to compile
            and tensors run in static chunks instead; ``(device type, "round")``: where `round_` failed
            to compile and the rounding stays eager.
    """

    def __init__(self, setting: Union[bool, str]):
        self.setting = setting
        self.chunks = 0
        self.draw_calls = 0
        self.wholes = 0
        self.rounds = 0
        self.adam_calls = 0
        self.eager: dict[str, str] = {}
        self.chunked: dict[tuple[str, str], str] = {}
        self._compiled: set[tuple[str, ...]] = set()
        self._step_inputs: dict[tuple[Any, ...], tuple[tuple[Any, ...], torch.Tensor]] = {}

    def applies(self, fmt: StateFormat, p: torch.Tensor, g: torch.Tensor, param: Optional[torch.Tensor] = None) -> bool:
        """The kernel updates this tensor now (format, dtypes, device, no dispatch mode but the step
        counters, which `step_counts.compiled_call` lifts for the call). ``p`` is ``param``'s flat view: an
        fp32 one, or a bf16 one stored to nearest or, where ``param`` carries ``xirang_weight_noise``
        (grad_release's ``masters: none``), rounded stochastically in the kernel."""
        param = p if param is None else param
        rounded = p.dtype == torch.bfloat16 and hasattr(param, "xirang_weight_noise")
        if p.dtype == torch.float32:
            weight_ok = getattr(param, "xirang_write_back", None) is None and not getattr(param, "xirang_grad_scale", ())
        else:
            weight_ok = p.dtype == torch.bfloat16 and (getattr(param, "xirang_write_back", None) is None or rounded)
        return (fuses(fmt.name, rounded) and weight_ok and g.dtype.is_floating_point
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
            hyper: AdamHyper, chunk: int, draws: Optional[Draws] = None, param: Optional[torch.Tensor] = None) -> int:
        """Update a tensor with the compiled kernels; the number of leading elements done. The caller
        updates the rest eagerly: on the CPU the last, shorter chunk, or everything from the chunk where
        ``fused: auto`` could not compile (this device then stays eager).

        Args:
            draws: the states' stochastic rounding (None: to nearest).
            param: the parameter ``flat_p`` views: a 16-bit one's ``xirang_weight_noise`` (``() -> (seed,
                offset)``) and ``xirang_grad_scale`` are read from it.
        """
        n = flat_p.numel()
        device = flat_p.device.type
        scalars = self._scalars_for(hyper, step, flat_p.device)
        tags, extra = self._extras(flat_p, n, chunk, draws, param)
        if whole_tensor(device) and (device, fmt.name) not in self.chunked:
            if self._call((device, fmt.name, *tags, "whole"), fmt, flat_p, flat_g, buffers, 0, n, scalars, extra(0)):
                self.chunks += 1
                self.wholes += 1
                return n
        tags = tuple("drawn" if t == "draws" else t for t in tags)  # chunks draw in a call of their own
        for k, start in enumerate(range(0, n // chunk * chunk, chunk)):
            if not self._call((device, fmt.name, *tags), fmt, flat_p, flat_g, buffers, start, start + chunk, scalars,
                              extra(k)):
                return start
            self.chunks += 1
        return n // chunk * chunk

    def adam_(self, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
              exp_avg_sqs: list[torch.Tensor], steps: list[int], hyper: AdamHyper) -> bool:
        """Step fp32 tensors with fp32 states (flat, all on one device; each ``steps[i]`` its step after
        increment) on torch's fused Adam kernel, ``torch.optim.AdamW(fused=True)``'s bit for bit: one
        multi-tensor op for them all, no temporaries, whatever their size. False where the eager path must run
        them (not enabled here, no fused kernel on the device, or ``bias_correction`` off, which the kernel
        lacks)."""
        device = params[0].device
        if not (hyper.bias_correction and device.type in _fused_adam_devices() and self.enabled(device.type)):
            return False

        def step_tensor(step: int) -> torch.Tensor:  # made on the device (a fill), once a step for each value
            return self._step_input(("step", step, device), lambda: torch.full((), float(step), device=device))

        kernel = fused_adamw_ if hyper.decoupled else fused_adam_
        kernel(params, grads, exp_avgs, exp_avg_sqs, [], [step_tensor(s) for s in steps], amsgrad=False, lr=hyper.lr,
               beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps,
               maximize=hyper.maximize)
        self.adam_calls += 1
        return True

    def new_step(self) -> None:
        """An optimizer step begins: the gradients' multipliers and the noise keys made for the last one go."""
        self._step_inputs = {}

    def _step_input(self, key: tuple[Any, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, made once per step for equal keys (a tensor in a key is the same object, which the cache
        holds): the hyperparameters' tensor, and grad_release gives every view of a bucket the same multipliers
        and noise seed, so each tensor would otherwise stack the one and copy the others to the device again."""
        found = self._step_inputs.get(tuple(map(_identity, key)))
        if found is None:
            found = self._step_inputs[tuple(map(_identity, key))] = (key, make())
        return found[1]

    def _extras(self, flat_p: torch.Tensor, n: int, chunk: int, draws: Optional[Draws], param: Optional[torch.Tensor]
                ) -> tuple[tuple[str, ...], Callable[[int], tuple[Any, ...]]]:
        """The kernel's tags and, for the ``k``-th call, its noise and gradient scales: each call's first
        element index a 0-d view of one ``arange`` per tensor (no host copy and no new graph per chunk)."""
        tags: tuple[str, ...] = ()
        device = flat_p.device
        starts = state_keys = weight = scales = None
        if draws is not None:
            tags += ("draws",)
            state_keys, starts = draws.keys, torch.arange(draws.offset, draws.offset + n, chunk, device=device)
        if flat_p.dtype != torch.float32:
            tags += (str(flat_p.dtype).rsplit(".", 1)[-1],)
            noise = getattr(param, "xirang_weight_noise", None)
            if noise is not None:
                tags += ("rounded",)
                seed, offset = noise()
                keys = self._step_input(("keys", seed, device), lambda: noise_keys(seed, device))
                weight = (keys, torch.arange(offset, offset + n, chunk, device=device))
            factors = tuple(getattr(param, "xirang_grad_scale", ()))

            def stack() -> torch.Tensor:
                made = [torch.as_tensor(f, dtype=torch.float32, device=device).reshape(()) for f in factors]
                return torch.stack(made + [torch.ones((), device=device)] * (2 - len(made)))

            scales = self._step_input(("scales", device, *factors), stack)

        def extra(k: int) -> tuple[Any, ...]:
            return (None if starts is None else Draws(state_keys, starts[k]),
                    None if weight is None else (weight[0], weight[1][k]), scales)

        return tags, extra

    def _scalars_for(self, hyper: AdamHyper, step: int, device: torch.device) -> torch.Tensor:
        """`hyper_tensor`, made once per group, step and device (one host-to-device copy a step, not
        one a tensor)."""
        return self._step_input(("scalars", hyper, step, device), lambda: hyper_tensor(hyper, step, device))

    def _call(self, key: tuple[str, ...], fmt: StateFormat, flat_p: torch.Tensor, flat_g: torch.Tensor,
              buffers: Buffers, start: int, end: int, scalars: torch.Tensor, extra: tuple[Any, ...]) -> bool:
        args = (fmt, flat_p[start:end], flat_g[start:end], fmt.window("exp_avg", buffers, start, end),
                fmt.window("exp_avg_sq", buffers, start, end), scalars, *extra)
        if key in self._compiled:
            self._launch(key, args)
            return True
        return self._first_call(key, args)

    def _launch(self, key: tuple[str, ...], args: tuple[Any, ...]) -> None:
        """One kernel call; a ``drawn`` chunk's noise first, in a compiled call of its own (module docstring)."""
        if "drawn" in key:
            fmt, p, draws = args[0], args[1], args[6]
            with compiled_call():
                drawn = _draw_kernel()(draws.keys, draws.offset, p.numel(), fmt.draw_bits)
            args = (*args[:6], draws._replace(drawn=drawn), *args[7:])
            self.draw_calls += 1
        with compiled_call():
            _compiled(key[2:])(*args)

    def _first_call(self, key: tuple[str, ...], args: tuple[Any, ...]) -> bool:
        """Compile (or load) a kernel on its first use for a device, format and kind of call. A failure
        there happens before the kernel runs, so nothing was written: ``auto`` goes eager, ``true`` raises;
        a whole-tensor kernel that fails leaves that device and format in chunks, either way."""
        whole = "whole" in key
        try:
            self._launch(key, args)
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

    def round_(self, master: torch.Tensor, out: torch.Tensor, seed: int, offset: int = 0, low_bits: int = 16) -> bool:
        """Round fp32 ``master`` (flat; consumed) stochastically into bf16 ``out`` in one compiled call, bit for
        bit what the eager pass writes: `stochastic.round_` (``low_bits`` 16: ``masters: none``) or
        `remainders.round8_` (8: ``remainders_8bit``); False where the eager rounding must do it (not enabled
        here, a dispatch mode, other dtypes, or ``auto`` failed to compile it).

        Raises:
            FusedUnavailable: ``fused: true`` and the rounding failed to compile.
        """
        device = master.device.type
        if not (master.dtype == torch.float32 and out.dtype == torch.bfloat16 and (device, "round") not in self.chunked
                and self.enabled(device) and only_counters_active()):
            return False
        # the offset made on the device (a fill), not copied from the host: a blocking copy would wait there
        start = torch.full((), offset, dtype=torch.int64, device=master.device)
        args = (master, out, noise_keys(seed, master.device), start)
        try:
            with compiled_call():
                if low_bits not in _ROUND_KERNELS:
                    _ROUND_KERNELS[low_bits] = torch.compile(ROUNDINGS[low_bits], dynamic=True, fullgraph=True)
                _ROUND_KERNELS[low_bits](*args)
        except Exception as error:  # noqa: BLE001 (Dynamo and Inductor raise many kinds)
            if self.setting is True:
                raise FusedUnavailable(f"xirang.optimizer_states.fused: true failed to compile the stochastic "
                                       f"rounding on {device}: {type(error).__name__}: {error}. Fix: set \"fused\": "
                                       f"\"auto\" or false") from error
            self.chunked[(device, "round")] = f"compiling failed ({type(error).__name__}: {error})"
            return False
        self.rounds += 1
        return True

    def describe(self) -> str:
        """One line: how many chunks the compiled kernel updated, and why a device stays eager."""
        eager = "; ".join([f"eager on {device}: {why}" for device, why in self.eager.items()]
                          + [f"{'eager rounding' if name == 'round' else 'chunks'} on {device} ({name}): {why}"
                             for (device, name), why in self.chunked.items()])
        if self.chunks or self.rounds or self.adam_calls:
            wholes = f", {self.wholes:,} of them whole tensors" if self.wholes else ""
            rounds = f", {self.rounds:,} compiled rounding pass(es)" if self.rounds else ""
            adam = f", {self.adam_calls:,} fused fp32 Adam call(s)" if self.adam_calls else ""
            return (f"fused update: {self.chunks:,} compiled call(s){wholes}{rounds}{adam}"
                    + (f" ({eager})" if eager else ""))
        return eager or f"fused: {self.setting!r}, no chunk updated yet"
