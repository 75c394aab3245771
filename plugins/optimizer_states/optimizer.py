"""`DynamicAdamW`: Adam/AdamW whose states change storage format during training.

The bookkeeping lives here (state creation, the chunk loop, format changes, checkpoints); the
formats (`formats.py`) only encode and decode, the math (`update.py`) is one pure function, and
the policy (`schedule.py`) picks each tensor's format. This is torchao's ``optim/adam.py`` split,
with plain tensors instead of tensor subclasses so that DeepSpeed's per-rank checkpoints and the
memory tracker see every byte.

A format change happens inside an update: the chunk is decoded from the old format and encoded
into the new one, so no separate conversion pass is made; the old buffers are freed when the
tensor's update finishes.

Contract for code that drives the optimizer (``grad_release``):

* it is a ``torch.optim.Optimizer``; ``type(opt)(param_groups, **opt.defaults)`` builds an
  equivalent optimizer over other tensors (``defaults["states"]`` carries the section's
  settings as plain data, ``defaults["keep_fp32"]`` a group's fp32 pin);
* state is keyed by parameter and every position (step count, format, policy window) is per
  tensor, so stepping a subset of parameters by narrowing ``param_groups`` works;
* `state_format` / `state_nbytes` answer per tensor.
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils.hooks import RemovableHandle

from xirang_ds.config.validate import XirangConfigError, convert_section
from xirang_ds.plugins.optimizer_states import export, first_step
from xirang_ds.plugins.optimizer_states.export import StateLoadError, check_numel, reencode_v1
from xirang_ds.plugins.optimizer_states.config import STATE_DTYPE_ORDER, OptimizerStatesConfig
from xirang_ds.plugins.grad_release.stochastic import noise_keys
from xirang_ds.plugins.optimizer_states.formats import (
    MOMENTS,
    Draws,
    StateFormat,
    encode_with_error,
    format_of,
    make_format,
    update_error,
)
from xirang_ds.plugins.optimizer_states.fused import FusedStep
from xirang_ds.plugins.optimizer_states.schedule import Measurement, Policy, make_policy
from xirang_ds.plugins.optimizer_states.together import plain_fp32, steps_together, update_together
from xirang_ds.plugins.optimizer_states.update import AdamHyper, adam_chunk_, grad_chunk, param_numel, store_param

STATE_DICT_KEY = "xirang_optimizer_states"
"""Extra key of `DynamicAdamW.state_dict`: the format version."""
STATE_DICT_VERSION = 2
"""2: the int8 second moment has no zero code (`qmaps.SECOND_MOMENT_8BIT`); version 1 states load
and are re-encoded (`export.reencode_v1`)."""


def config_from_dict(data: Any) -> OptimizerStatesConfig:
    """The section from plain data (what ``defaults["states"]`` holds), validated.

    Raises:
        XirangConfigError: the data is not a valid ``optimizer_states`` section.
    """
    if isinstance(data, OptimizerStatesConfig):
        return data

    problems: list = []
    config = convert_section(dict(data or {}), OptimizerStatesConfig, "xirang.optimizer_states", problems)
    if problems:
        raise XirangConfigError(problems)
    return config


def config_to_dict(config: OptimizerStatesConfig) -> dict:
    """The section as plain JSON data (round-trips through `config_from_dict`)."""
    out = dataclasses.asdict(config)
    out["schedule"] = [{k: v for k, v in e.items() if v is not None} for e in out["schedule"]]
    out["keep_fp32"] = list(out["keep_fp32"])
    return out


class DynamicAdamW(torch.optim.Optimizer):
    """Adam/AdamW with fp32, bf16, int8 or int4 states chosen per tensor by a policy.

    With every tensor in fp32 the update equals ``torch.optim.AdamW`` (``adam_w_mode=True``) or
    ``torch.optim.Adam`` bit for bit.

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        lr, betas, eps, weight_decay: Adam's hyperparameters.
        adam_w_mode: decoupled weight decay (AdamW); ``False`` adds ``weight_decay * p`` to the
            gradient (Adam).
        maximize: ascend instead of descend.
        bias_correction: divide moments by ``1 - beta ** step`` (DeepSpeed FusedAdam's key).
        states: the ``optimizer_states`` section, as plain data or the dataclass.
        keep_fp32: keep every tensor of the group in fp32 (set per group by the plugin for
            embeddings, norms, small tensors and ``keep_fp32`` globs); ``"measured"``: each tensor
            starts in fp32 and leaves it for the step policy's int8/int4 format once its update
            direction's error in that format is at most ``measured_max_error`` (`_measure_release`).
        keep_fp32_params: parameters kept in fp32 one by one, where the groups are not the
            plugin's to split (Megatron's groups are matched by their keys when a checkpoint loads,
            so two halves of one group would collide).
        measured_params: parameters measured as under ``keep_fp32="measured"``, one by one.

    Raises:
        ValueError: a hyperparameter out of range.
        XirangConfigError: ``states`` is not a valid section.

    Example:
        >>> opt = DynamicAdamW(model.parameters(), lr=1e-3,
        ...                    states={"schedule": [{"dtype": "fp32", "until_step": 100}, {"dtype": "int8"}]})
        >>> opt.state_format(next(model.parameters()))
        'fp32'
    """

    xirang_elementwise = True
    """The update math is element-wise (grad_release may step 1/world slices of a parameter). A
    quantized tensor's blocks then follow the slice it is given, which moves block boundaries but
    keeps each format's error bound; fp32 states stay exact."""
    xirang_write_back = True
    """A parameter's ``xirang_write_back`` stores its updated chunks (`update.store_param`)."""
    torch_state_keys = ("step",) + MOMENTS
    """The state it loads in ``torch.optim.AdamW`` layout (a checkpoint's, `checkpoints.param_states.check_kind`)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, adam_w_mode: bool = True,
                 maximize: bool = False, bias_correction: bool = True, states: Any = None,
                 keep_fp32: Any = False, keep_fp32_params: Iterable[torch.Tensor] = (),
                 measured_params: Iterable[torch.Tensor] = ()):
        _check_hyper(lr, betas, eps, weight_decay)
        config = config_from_dict(states)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                        maximize=maximize, bias_correction=bias_correction, states=config_to_dict(config),
                        keep_fp32=keep_fp32)
        super().__init__(params, defaults)
        self.config = config
        self._kept_ids = frozenset(id(p) for p in keep_fp32_params)
        self._measured_ids = frozenset(id(p) for p in measured_params)
        self.measurements: list[tuple[int, int, str, float, bool]] = []
        """Every measured tensor's check: ``(step, numel, format, error, left fp32)``, in order."""
        self.policy: Policy = make_policy(config)
        self._formats: dict[tuple[str, int], StateFormat] = {}
        self._draws: dict[str, tuple[int, torch.Tensor, int]] = {}  # per device: step, its noise keys, elements drawn
        self.fused = FusedStep(config.fused)  # where a chunk's update is one compiled kernel
        self._step_numbers: dict[torch.Tensor, tuple[torch.Tensor, int]] = {}  # param -> (its step tensor, value)
        self._format_hooks: OrderedDict[int, Callable[["DynamicAdamW", torch.Tensor, str, str], None]] = \
            OrderedDict()  # weak-referencable, as RemovableHandle needs
        self.format_changes: list[tuple[int, str, str, int]] = []
        """Every format change: ``(step, from, to, numel)``, in order."""
        self.state_pool: Any = None
        """Where int8/int4 codes and scales are allocated: a `xirang_ds.memory.pool.MemoryPool`
        (anything with ``allocate(nbytes, dtype, persistent=True)`` and ``owns(t)``), or ``None``."""

    # queries ------------------------------------------------------------------------------------
    def state_format(self, param: torch.Tensor) -> str:
        """Format ``param``'s states are stored in now (before its first step: the one it starts in)."""
        state = self.state.get(param)
        if state:
            return format_of(state)
        group = self._group_of(param)
        return "fp32" if self._pinned(param, group) else self.policy.initial()

    def state_nbytes(self, param: Optional[torch.Tensor] = None) -> int:
        """Bytes of the state tensors (moments or codes and scales, and the step counter) of
        ``param``, or of every parameter."""
        states = [self.state.get(param, {})] if param is not None else list(self.state.values())
        return sum(t.numel() * t.element_size() for s in states for t in s.values() if isinstance(t, torch.Tensor))

    def format_numel(self) -> dict[str, int]:
        """Elements per format over all parameters that have states."""
        out: dict[str, int] = {}
        for p, state in self.state.items():  # not param_groups: ZeRO 3 empties them between steps
            if state:
                name = format_of(state)
                out[name] = out.get(name, 0) + param_numel(p)  # a parked master is empty
        return out

    def register_format_change_hook(self, hook: Callable[["DynamicAdamW", torch.Tensor, str, str], None]
                                    ) -> RemovableHandle:
        """Call ``hook(optimizer, param, old, new)`` after a tensor's states change format."""
        handle = RemovableHandle(self._format_hooks)
        self._format_hooks[handle.id] = hook
        return handle

    # step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every parameter with a gradient in ``param_groups``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.fused.new_step()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper = AdamHyper(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                              weight_decay=group["weight_decay"], decoupled=group["adam_w_mode"],
                              maximize=group["maximize"], bias_correction=group["bias_correction"])
            together = []  # small tensors with fp32 states: one multi-tensor update (`together`)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if steps_together(self, p, group):
                    together.append(p)
                    self._rounding(p, self._next_step(p))  # what it would draw, for the tensors after it
                else:
                    self._update(p, group, hyper)
            if together:
                update_together(self, together, hyper)
        return loss

    def _update(self, p: torch.Tensor, group: dict, hyper: AdamHyper) -> None:
        if p.grad.is_sparse:
            raise RuntimeError("DynamicAdamW does not support sparse gradients")
        state = self.state[p]
        pinned = self._pinned(p, group)
        if pinned and self._measured(p, group) and first_step.applies(self, p, state, hyper):
            return first_step.first_update(self, p, state, hyper)  # no whole fp32 moments on the way
        if not state:
            self._init_state(p, state, "fp32" if pinned else self.policy.initial())
        step = self._count_step(p, state)
        old_name = format_of(state)
        new_name = "fp32" if pinned else self._target(state, step)
        src = self._format(old_name, state.get("block_size", 0))
        dst = self._format(new_name)  # the same object when neither format nor block size changes
        buffers = {k: state[k] for m in MOMENTS for k in src.keys(m)}
        out = buffers if dst is src else {k: v for m in MOMENTS
                                          for k, v in dst.zeros(m, p.numel(), p.device, self._empty()).items()}
        measure = not pinned and self.policy.wants_measurement(state, step)
        stats = self._run_chunks(p, buffers, out, src, dst, step, hyper, measure, self._rounding(p, step))
        if dst is not src:
            self._replace(p, state, buffers, out, old_name, new_name, dst, step)
        if measure:
            self.policy.observe(state, step, stats)
        if pinned and self._measured(p, group) and (step == 1 or step % self.config.measured_every_steps == 0):
            self._measure_release(p, state, step, hyper.eps)

    def _count_step(self, p: torch.Tensor, state: dict) -> int:
        """Add one to ``state["step"]`` and return it as a Python int, read from the tensor only when it is
        not the one this optimizer last counted (after a load, `first_step`, a checkpoint's clone): no host
        read per tensor and step (the counter lives on the host, but a read is a sync where it does not)."""
        step = self._next_step(p)
        counter = state["step"]
        counter += 1
        self._step_numbers[p] = (counter, step)
        return step

    def _next_step(self, p: torch.Tensor) -> int:
        """The step ``p``'s next update counts, as a Python int (no counter changed)."""
        counter = self.state[p]["step"]
        last = self._step_numbers.get(p)
        return last[1] + 1 if last is not None and last[0] is counter else int(counter.item()) + 1

    def _replace(self, p: torch.Tensor, state: dict, old: dict, new: dict, old_name: str, new_name: str,
                 fmt: StateFormat, step: int) -> None:
        for k in old:
            del state[k]
        state.update(new)
        state["format"] = STATE_DTYPE_ORDER.index(new_name)
        state["block_size"] = fmt.block_size
        self.format_changes.append((step, old_name, new_name, p.numel()))
        for hook in list(self._format_hooks.values()):
            hook(self, p, old_name, new_name)

    def _measure_release(self, p: torch.Tensor, state: dict, step: int, eps: float) -> None:
        """A measured tensor still in fp32: encode its moments (just updated) in the step policy's
        format, and keep that encoding when the relative error of the Adam update direction it gives,
        ``|m'/(sqrt(v')+eps) - m/(sqrt(v)+eps)| / |m/(sqrt(v)+eps)|`` over the tensor, is at most
        ``measured_max_error``; else try the wider integer format (int8 after int4), which then stays
        the narrowest the tensor takes (`_target`); else the states stay fp32 until the next check."""
        name = self.policy.target(state, step)
        if not name.startswith("int"):
            return
        src = self._format("fp32")
        buffers = {k: state[k] for m in MOMENTS for k in src.keys(m)}
        for candidate in STATE_DTYPE_ORDER[STATE_DTYPE_ORDER.index(name):STATE_DTYPE_ORDER.index("bf16"):-1]:
            dst = self._format(candidate)
            out = {k: v for m in MOMENTS for k, v in dst.zeros(m, p.numel(), p.device, self._empty()).items()}
            error = encode_with_error(src, dst, buffers, out, p.numel(), _lcm(self.config.chunk_numel, dst.block_size),
                                      self._rounding(p, step), eps)
            leaves = error <= self.config.measured_max_error
            self.measurements.append((step, p.numel(), candidate, error, leaves))
            if leaves:
                if candidate != name:
                    state["measured_floor"] = STATE_DTYPE_ORDER.index(candidate)
                self._replace(p, state, buffers, out, "fp32", candidate, dst, step)
                return

    def _target(self, state: dict, step: int) -> str:
        """The policy's format, but no narrower than the one a measured tensor settled on."""
        name = self.policy.target(state, step)
        floor = state.get("measured_floor")
        return name if floor is None else STATE_DTYPE_ORDER[min(STATE_DTYPE_ORDER.index(name), int(floor))]

    def _run_chunks(self, p: torch.Tensor, src_buf: dict, dst_buf: dict, src: StateFormat, dst: StateFormat,
                    step: int, hyper: AdamHyper, measure: bool, draws: Optional[Draws]) -> Optional[Measurement]:
        """Decode, update and encode ``p`` chunk by chunk; the measurement when ``measure``."""
        flat_p = first_step.flat_view(p)
        flat_g = first_step.flat_view(p.grad)
        n = flat_p.numel()
        chunk = _lcm(self.config.chunk_numel, src.block_size, dst.block_size)
        if not measure and src is dst and src.name == "fp32" and plain_fp32(p):  # torch's fused kernel: one op
            m, v = (src.decode(k, src_buf, 0, n) for k in MOMENTS)
            if self.fused.adam_([flat_p], [flat_g], [m], [v], [step], hyper):
                return None
        fuse = not measure and src is dst and self.fused.applies(src, flat_p, flat_g, p)
        done = self.fused.run(src, flat_p, flat_g, src_buf, step, hyper, chunk, draws, p) if fuse else 0  # eager: the rest
        # |m|^2, |v|^2, |du|^2, |u|^2 summed on the device: one host sync per tensor and measurement, not four per chunk
        sums = torch.zeros(4, dtype=torch.float64, device=flat_p.device) if measure else None
        quantized = dst.name.startswith("int")
        for start in range(done, n, chunk):
            end = min(n, start + chunk)
            p32 = flat_p[start:end] if flat_p.dtype == torch.float32 else flat_p[start:end].float()
            g32 = grad_chunk(p, flat_g, start, end)
            m = src.decode("exp_avg", src_buf, start, end)
            v = src.decode("exp_avg_sq", src_buf, start, end)
            adam_chunk_(p32, g32, m, v, float(step), hyper)
            if p32.data_ptr() != flat_p[start:end].data_ptr():
                store_param(p, flat_p, start, p32)
            if measure:
                sums[0] += m.double().square().sum()
                sums[1] += v.double().square().sum()
                reference = (m.clone(), v.clone()) if quantized else None
            dst.encode("exp_avg", m, dst_buf, start, draws)
            dst.encode("exp_avg_sq", v, dst_buf, start, draws)
            if measure and reference is not None:
                du, u = update_error(reference, dst, dst_buf, start, end, hyper.eps)
                sums[2] += du
                sums[3] += u
        if not measure:
            return None
        sums = sums.tolist()  # the stability policy decides on the host
        error = math.sqrt(sums[2] / sums[3]) if quantized and sums[3] > 0 else (0.0 if quantized else None)
        # bias-corrected, so a stationary gradient reads as settled while v is still warming up
        bc1, bc2 = (1 - hyper.beta1 ** step, 1 - hyper.beta2 ** step) if hyper.bias_correction else (1.0, 1.0)
        return Measurement(math.sqrt(sums[0]) / bc1, math.sqrt(sums[1]) / bc2, error)

    # helpers ------------------------------------------------------------------------------------
    def torch_state(self, p: torch.Tensor) -> dict:
        """``p``'s state in ``torch.optim.AdamW`` layout (fp32 moments shaped like ``p``, ``step``);
        empty before its first update. Other code that moves states (grad_release handing them
        back on removal) reads them through this."""
        state = self.state.get(p)
        return export.decode_state(state, p) if state else {}

    def _init_state(self, p: torch.Tensor, state: dict, name: str) -> None:
        fmt = self._format(name)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for m in MOMENTS:
            state.update(fmt.zeros(m, p.numel(), p.device, self._empty()))
        state["format"] = STATE_DTYPE_ORDER.index(name)
        state["block_size"] = fmt.block_size

    def _empty(self) -> Optional[Callable[[int, torch.dtype, torch.device], torch.Tensor]]:
        pool = self.state_pool
        if pool is None:
            return None
        return lambda numel, dtype, device: pool.allocate(numel * dtype.itemsize, dtype, persistent=True,
                                                          what="optimizer_states")

    def rehome_states(self) -> int:
        """Move quantized state buffers that lie outside `state_pool` into it (after the pool's
        reservation, and after a checkpoint load made plain copies). Returns the bytes moved; views
        others keep of the old buffers (DeepSpeed's state links) must be rebuilt by the caller."""
        pool = self.state_pool
        moved = 0
        if pool is None or getattr(pool, "warmup", False):  # nothing reserved yet: stay where they are
            return 0
        for state in self.state.values():
            for key, t in list(state.items()):
                if key.endswith(("_codes", "_scales")) and isinstance(t, torch.Tensor) and not pool.owns(t):
                    block = pool.allocate(t.numel() * t.element_size(), t.dtype, persistent=True,
                                          what="optimizer_states")
                    if pool.owns(block):  # state buffers are 1-D; keep the pool's own tensor (its block's life)
                        state[key] = block.copy_(t.reshape(-1))
                        moved += block.numel() * block.element_size()
        return moved

    def _format(self, name: str, block_size: int = 0) -> StateFormat:
        if not block_size:
            block_size = {"int8": self.config.int8_block_size, "int4": self.config.int4_block_size}.get(name, 1)
        key = (name, block_size)
        fmt = self._formats.get(key)
        if fmt is None:
            fmt = make_format(name, int8_block_size=block_size, int4_block_size=block_size)
            self._formats[key] = fmt
        return fmt

    def keeps_fp32(self, p: torch.Tensor) -> bool:
        """True if ``p`` is one of the parameters kept in fp32 one by one (``keep_fp32_params``); a
        copy of this optimizer over views of the parameters (grad_release's buckets) pins their views."""
        return id(p) in self._kept_ids

    def measures_fp32(self, p: torch.Tensor) -> bool:
        """True if ``p`` is one of the parameters measured one by one (``measured_params``)."""
        return id(p) in self._measured_ids

    def _measured(self, p: torch.Tensor, group: Optional[dict]) -> bool:
        return bool(group and group.get("keep_fp32") == "measured") or id(p) in self._measured_ids

    def _pinned(self, p: torch.Tensor, group: Optional[dict]) -> bool:
        if param_numel(p) < self.config.min_numel or id(p) in self._kept_ids:
            return True
        if self._measured(p, group):  # fp32 until `_measure_release` moves it (the stability policy measures itself)
            state = self.state.get(p)
            return self.config.policy == "steps" and (not state or format_of(state) == "fp32")
        return bool(group and group.get("keep_fp32"))

    def _group_of(self, p: torch.Tensor) -> Optional[dict]:
        return next((g for g in self.param_groups if any(q is p for q in g["params"])), None)

    def _rounding(self, p: torch.Tensor, step: int) -> Optional[Draws]:
        """Stochastic rounding's noise at ``step`` (None: round to nearest): counter-based under keys of the
        seed and the step alone, a step's tensors drawing consecutive elements in the order they are updated,
        so a resumed run draws what the uninterrupted one would have, whichever rank's checkpoint it loads,
        nothing of it is saved, and the compiled update draws what the eager one does."""
        refresh = self.config.refresh_every_steps
        if not (self.config.stochastic_rounding or (refresh and step % refresh == 0)):
            return None
        seeded, keys, drawn = self._draws.get(str(p.device), (None, None, 0))
        if seeded != step:
            keys, drawn = noise_keys(((self.config.seed << 32) ^ step) % (1 << 63), p.device), 0
        self._draws[str(p.device)] = (step, keys, drawn + p.numel())
        return Draws(keys, drawn)

    # checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``torch.optim`` state dict plus the format version."""
        out = super().state_dict()
        pool = self.state_pool
        if pool is not None:  # a view of the pool would save the whole reservation: save a compact copy
            out["state"] = {i: {k: (v.clone() if isinstance(v, torch.Tensor) and pool.owns(v) else v)
                                for k, v in st.items()} for i, st in out["state"].items()}
        out[STATE_DICT_KEY] = {"version": STATE_DICT_VERSION}  # older checkpoints' "generators" are not read
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer or of ``torch.optim.AdamW``/``Adam``.

        States saved in another format are converted by the next update (decoded from the saved
        format, encoded in the one the policy picks now); their block size travels with them.

        Raises:
            StateLoadError: a saved state tensor does not have the parameter's element count
                (saved under ZeRO with another data-parallel world size), or another format version.
        """
        extra = state_dict.get(STATE_DICT_KEY, {})
        if extra and extra.get("version") not in (1, STATE_DICT_VERSION):
            raise StateLoadError(f"optimizer states saved with format version {extra.get('version')}; "
                                 f"this xirang_ds reads version {STATE_DICT_VERSION}")
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for index, (i, p) in enumerate(zip(ids, params)):
            st = saved.get(i)
            if st:
                check_numel(st, p, index)
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # torch.optim.AdamW's groups lack this optimizer's keys
            group.setdefault("adam_w_mode", bool(group.get("decoupled_weight_decay", self.defaults["adam_w_mode"])))
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        for i, p in zip(ids, params):
            st = self.state.get(p)
            for k, t in (st or {}).items():
                original = saved.get(i, {}).get(k)
                if isinstance(t, torch.Tensor) and k != "step" and t.dtype != original.dtype:
                    st[k] = original.to(device=p.device)  # torch casts floating states to the param's dtype
        if extra and extra.get("version") == 1:
            for st in self.state.values():
                reencode_v1(st)


def _check_hyper(lr: float, betas: tuple, eps: float, weight_decay: float) -> None:
    for ok, what in ((0.0 <= float(lr), f"learning rate: {lr}"), (0.0 <= eps, f"epsilon value: {eps}"),
                     (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas), f"betas: {betas}; two numbers in [0, 1)"),
                     (0.0 <= weight_decay, f"weight_decay value: {weight_decay}")):
        if not ok:
            raise ValueError(f"Invalid {what}")


def _lcm(*values: int) -> int:
    return math.lcm(*values)
