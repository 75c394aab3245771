"""The cast policy as kernels at the device's Autocast dispatch key.

Why this level: autocast's own kernels sit at the ``Autocast<Device>`` dispatch key, above
autograd, so the casts they make are recorded by autograd (gradients flow back through them in the
right dtype) and an op's inputs are saved for backward in the dtype it ran in. PyTorch lets a
library register a kernel for any operator at that key (``torch.library.Library.impl``), which
replaces the built-in kernel while the registration lives and restores it when it is destroyed.
So inside ``torch.autocast`` every op on the lists reaches our kernel, from Python or from C++
(``F.linear``, ``x @ w``, Megatron's autograd functions, ``nn.MultiheadAttention``'s fused path),
and every other op costs nothing: autocast's fallthrough passes it on untouched. A
``TorchFunctionMode`` would see only Python-level calls and would run for every tensor method;
a ``TorchDispatchMode`` sits below autograd, where a cast is invisible to backward.

Each kernel casts its eligible inputs (floating, not fp64, on this device; as autocast does),
runs the op with autocast off (so the ops it calls inherit its decision: ``matmul`` decides for
the ``mm`` it calls), and saves casts of weights, and widening casts, as `recast.Recast` records.

Kernels, per qualified overload:

* ``low``: inputs to the low-precision dtype.
* ``fp32``: inputs to fp32.
* ``widest``: inputs to the widest floating dtype among them. Used for ops that PyTorch's autocast
  for this device handles but neither list names (its built-in decision would otherwise apply),
  and for Apex ``register_promote_function`` registrations.

The registrations are process-wide (one dispatcher): while a policy is installed, every
``torch.autocast`` region on that device follows it. Installing the same policy again shares the
registrations; a different policy for the same device is refused until the first is removed.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from xirang_ds.compat.torch import (
    DisableAutocast,
    OpOverload,
    destroy_library,
    op_entry,
    pop_saved_tensors_hooks,
    privateuse1_backend_name,
    push_saved_tensors_hooks,
)
from xirang_ds.plugins.precision.op_lists import OpLists, native_autocast_ops
from xirang_ds.plugins.precision.recast import CastSet, widest

_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "hpu": "AutocastHPU",
                  "mps": "AutocastMPS", "ipu": "AutocastIPU"}


def autocast_key(device_type: str) -> str:
    """The Autocast dispatch key of a device type (``"cuda"`` -> ``"AutocastCUDA"``).

    Raises:
        ValueError: the device type has no autocast support in this torch build.
    """
    key = _AUTOCAST_KEYS.get(device_type)
    if key is None and device_type == privateuse1_backend_name():
        key = "AutocastPrivateUse1"
    if key is None:
        raise ValueError(f"device type {device_type!r} has no torch autocast support; precision runs on "
                         f"{', '.join(sorted(_AUTOCAST_KEYS))} or the registered privateuse1 backend")
    return key


@dataclass(frozen=True)
class CastPolicy:
    """What the kernels do on one device.

    Attributes:
        lists: the resolved op lists.
        device_type: ``"cpu"``, ``"cuda"``, ...
        low_dtype: ``torch.bfloat16`` or ``torch.float16``.
        narrow_upcasts: save the 16-bit source of widening casts instead of the fp32 copy.
    """

    lists: OpLists
    device_type: str
    low_dtype: torch.dtype
    narrow_upcasts: bool = True

    def kind_of(self, overload: str) -> str:
        """The kernel an overload gets: ``low``, ``fp32`` or ``widest`` (``follow`` is not registered)."""
        kind = self.lists.policy_of(overload)
        return "widest" if kind in ("promote", "follow") else kind


@dataclass
class _Installation:
    policy: CastPolicy
    libraries: list = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)
    scopes: list[Callable[[], Any]] = field(default_factory=list)
    refs: int = 0

    def weight_scope(self) -> Callable[[], Any]:
        """The scope factory of the latest user (kept by the casts of one call, for backward too)."""
        return self.scopes[-1] if self.scopes else contextlib.nullcontext


_INSTALLED: dict[str, _Installation] = {}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _make_kernel(op: OpOverload, kind: str, inst: _Installation) -> Callable[..., Any]:
    policy = inst.policy
    device, low, narrow = policy.device_type, policy.low_dtype, policy.narrow_upcasts
    fp64 = torch.float64
    call = op_entry(op)  # the operator's C++ entry: one Python frame less than ``OpOverload.__call__``
    autocast_off = DisableAutocast
    push, pop = push_saved_tensors_hooks, pop_saved_tensors_hooks

    def eligible(t: torch.Tensor) -> bool:
        return t.is_floating_point() and t.dtype is not fp64 and t.device.type == device

    fixed = low if kind == "low" else torch.float32 if kind == "fp32" else None

    def target(t: torch.Tensor) -> Optional[torch.dtype]:
        return fixed if eligible(t) else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        to = fixed
        if to is None:  # widest
            to = widest(t.dtype for t in _tensors((args, tuple(kwargs.values()))) if eligible(t))

            def cast_to(t: torch.Tensor) -> Optional[torch.dtype]:
                return to if eligible(t) else None
        else:
            cast_to = target
        with autocast_off():
            if to is None:
                return call(*args, **kwargs)
            casts = CastSet(inst.weight_scope(), narrow)
            args = casts.map(args, cast_to)
            if kwargs:
                kwargs = {k: casts.map(v, cast_to) for k, v in kwargs.items()}
            hooks = casts.hooks()
            if hooks is None:  # nothing cast, or no copy backward could remake
                return call(*args, **kwargs)
            push(*hooks)  # ``saved_tensors_hooks`` without its Python frames
            try:
                return call(*args, **kwargs)
            finally:
                pop()

    kernel.__name__ = f"xirang_{kind}_{op.__name__}"
    return kernel


def _overload(qualified: str) -> tuple[str, str, OpOverload]:
    namespace, _, rest = qualified.partition("::")
    name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, namespace), name)
    return namespace, rest, getattr(packet, overload or "default")


def _register(inst: _Installation, key: str) -> None:
    lists = inst.policy.lists
    wanted = set(lists.low) | set(lists.fp32) | set(lists.promote) | set(native_autocast_ops(key))
    libraries: dict[str, torch.library.Library] = {}
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": replacing autocast's kernel is the point.
        warnings.simplefilter("ignore", UserWarning)
        for qualified in sorted(wanted):
            namespace, name, op = _overload(qualified)
            kind = inst.policy.kind_of(qualified)
            lib = libraries.get(namespace)
            if lib is None:
                lib = libraries[namespace] = torch.library.Library(namespace, "IMPL")
            lib.impl(name, _make_kernel(op, kind, inst), key)
            inst.kinds[qualified] = kind
    inst.libraries = list(libraries.values())


class KernelHandle:
    """One user of an installed policy; ``remove()`` restores PyTorch's kernels after the last one."""

    def __init__(self, key: str, scope: Callable[[], Any]) -> None:
        self.key, self.scope = key, scope
        self._removed = False

    @property
    def kinds(self) -> dict[str, str]:
        """Qualified overload -> kernel kind, for every registered overload."""
        return dict(_INSTALLED[self.key].kinds)

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        inst = _INSTALLED[self.key]
        if self.scope in inst.scopes:
            inst.scopes.remove(self.scope)
        inst.refs -= 1
        if inst.refs == 0:
            del _INSTALLED[self.key]
            for lib in inst.libraries:
                destroy_library(lib)  # the earlier kernels come back


def install(policy: CastPolicy, weight_scope: Callable[[], Any]) -> KernelHandle:
    """Register the policy's kernels at the device's Autocast key (or share an identical install).

    Args:
        policy: the lists, device and dtypes.
        weight_scope: context factory entered while weight copies are made (the tracker's
            ``scope("parameters")`` when a tracker runs).

    Raises:
        RuntimeError: a different policy is installed for this device in this process.
    """
    key = autocast_key(policy.device_type)
    inst = _INSTALLED.get(key)
    if inst is not None and inst.policy != policy:
        raise RuntimeError(f"another xirang precision policy is active for {policy.device_type} in this process "
                           "(the autocast kernels are process-wide); call engine.xirang.remove() on the other "
                           "engine first, or give both engines the same precision section")
    if inst is None:
        inst = _Installation(policy=policy)
        _register(inst, key)
        _INSTALLED[key] = inst
    inst.refs += 1
    inst.scopes.append(weight_scope)
    return KernelHandle(key, weight_scope)


def installed_policy(device_type: str) -> Optional[CastPolicy]:
    """The policy installed for a device type, or ``None``."""
    inst = _INSTALLED.get(autocast_key(device_type))
    return inst.policy if inst is not None else None


__all__ = ["CastPolicy", "KernelHandle", "autocast_key", "install", "installed_policy", "native_autocast_ops"]
