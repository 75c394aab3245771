"""Every private PyTorch name xirang_ds uses, in one version-guarded place.

setup.py allows ``torch>=2.4``; the names below were read in torch 2.13.0 (the tested version), and the
file and line of each in that release are in `UPSTREAM_NAMES`. ``tests/structure/test_compat.py`` resolves every
one of them in the installed torch, so a release that moves one fails there and not in a training run;
the same test fails when package code outside ``xirang_ds/compat/`` reaches a private name itself.

Attribute reads on hot paths (the tracker and the precision kernels run them on every op) are bound as
``operator.attrgetter`` objects and the C entry points are re-exported as they are: no Python frame is
added to what the callers did before.
"""
from __future__ import annotations

import operator
import sys
import types
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree  # noqa: F401  (re-exported: tree_map and friends)
from torch.utils._python_dispatch import (
    TorchDispatchMode,
)
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: F401  (re-exported)
from torch.utils._python_dispatch import _pop_mode_temporarily as pop_mode_temporarily
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

TESTED_VERSION = "2.13.0"

UPSTREAM_NAMES: dict[str, Any] = {
    "torch/optim/lr_scheduler.py": ("self._last_lr",),
    "torch.Tensor._base": "the tensor a view was taken of (C property, torch/_C/__init__.pyi)",
    "torch.Tensor._version": "the in-place version counter (C property, torch/_C/__init__.pyi)",
    "torch.UntypedStorage._cdata": "the storage's C++ address, stable while it lives",
    "torch.Tensor._make_wrapper_subclass": "torch/_C/__init__.pyi L2398",
    "torch._C._autograd._push_saved_tensors_default_hooks": "torch/_C/_autograd.pyi L137",
    "torch._C._autograd._pop_saved_tensors_default_hooks": "torch/_C/_autograd.pyi L141",
    "torch._C._autograd._top_saved_tensors_default_hooks": "torch/_C/_autograd.pyi L142",
    "torch._C._autograd._saved_tensors_hooks_is_enabled": "torch/autograd/graph.py (disable_saved_tensors_hooks)",
    "torch._C._current_autograd_node": "torch/_C/__init__.pyi L12348",
    "torch._C._autograd._get_current_graph_task_keep_graph": "torch/_C/_autograd.pyi L129 (read by AOTAutograd, "
                                                              "torch/_functorch/_aot_autograd/runtime_wrappers.py L2761)",
    "torch._C._DisableAutocast": "torch/_C/__init__.pyi L1640",
    "torch._C.DisableTorchFunctionSubclass": "torch/_C/__init__.pyi",
    "torch._C._get_privateuse1_backend_name": "torch/_C/__init__.pyi L1734",
    "torch._C._dispatch_has_kernel_for_dispatch_key": "torch/_C/__init__.pyi L1832",
    "torch._C._dispatch_get_all_op_names": "torch/_C/__init__.pyi L1853",
    "torch._C._construct_storage_from_data_pointer": "torch/_C/__init__.pyi L1359",
    "torch._C._nn._parse_to": "torch/_C/_nn.pyi L240",
    "torch._ops.OpOverload": "torch/_ops.py L806 (._op: the C++ entry, ._schema)",
    "torch._ops.OpOverloadPacket": "torch/_ops.py L1166",
    "torch.library.Library._destroy": "torch/library.py L601",
    "torch.utils._python_dispatch.TorchDispatchMode": "torch/utils/_python_dispatch.py L72",
    "torch.utils._python_dispatch._pop_mode_temporarily": "torch/utils/_python_dispatch.py L382",
    "torch.utils._python_dispatch._disable_current_modes": "torch/utils/_python_dispatch.py L391",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass": "torch/utils/_python_dispatch.py L547",
    "torch.utils._pytree.tree_map": "torch/utils/_pytree.py L1537",
    "torch._subclasses.fake_tensor.FakeTensorMode": "torch/_subclasses/fake_tensor.py L1432",
    "torch._dynamo.eval_frame.OptimizedModule": "torch/_dynamo/eval_frame.py L430 (._orig_mod, L465)",
    "torch._dynamo.is_dynamo_supported": "torch/_dynamo/eval_frame.py L1641",
    "torch.utils._triton.has_triton": "torch/utils/_triton.py L178",
    "torch.utils._python_dispatch._get_current_dispatch_mode": "torch/utils/_python_dispatch.py L270",
    "torch.utils._python_dispatch._get_current_dispatch_mode_stack": "torch/utils/_python_dispatch.py L340",
    "torch.overrides._get_current_function_mode_stack": "torch/overrides.py (the TorchFunctionMode stack)",
    "torch.overrides._pop_mode_temporarily": "torch/overrides.py (pops the innermost TorchFunctionMode)",
    "torch.ops.aten._local_scalar_dense": "what .item(), float(t) and bool(t) dispatch (native_functions.yaml)",
    "torch.ops.aten._unique": "unique without dim (native_functions.yaml)",
    "torch.ops.aten._unique2": "unique with inverse and counts (native_functions.yaml)",
    "torch.ops.aten._to_copy": "what Tensor.to dispatches when it copies (native_functions.yaml)",
    "torch.ops.aten._scaled_dot_product_flash_attention": "SDPA's flash kernel (native_functions.yaml)",
    "torch.ops.aten._scaled_dot_product_flash_attention_backward": "its backward (native_functions.yaml)",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": "the CPU's flash SDPA (native_functions.yaml)",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": "its backward (native_functions.yaml)",
    "torch.nn.modules.batchnorm._NormBase": "torch/nn/modules/batchnorm.py L25",
    "torch.nn.Module._parameters": "torch/nn/modules/module.py (the module's own parameter table)",
    "torch.Tensor._backward_hooks": "a tensor's register_hook hooks (C property, torch/_C/__init__.pyi; None if none)",
    "torch.nn.Module._buffers": "torch/nn/modules/module.py (the module's own buffer table)",
    "torch.autograd.Variable._execution_engine": "torch/autograd/variable.py L15",
    "torch._foreach_zero_": "aten op, torch/_C/_VariableFunctions.pyi",
    "torch._amp_foreach_non_finite_check_and_unscale_": "aten op, torch/_C/_VariableFunctions.pyi",
    "torch.ops.aten._log_softmax_backward_data": "aten op (native_functions.yaml)",
    "torch.cuda.memory._record_memory_history": "torch/cuda/memory.py L892",
    "torch.cuda.memory._dump_snapshot": "torch/cuda/memory.py L1129",
    "torch.utils.checkpoint._checkpoint_hook": "torch/utils/checkpoint.py L1153 (its pack hook's qualname)",
    "torch.utils.checkpoint._recomputation_hook": "torch/utils/checkpoint.py L1088 (its pack hook's qualname)",
    "torch.utils.checkpoint.SAC_IGNORED_OPS": "torch/utils/checkpoint.py L1328",
}
"""Dotted path in torch → where it is in torch 2.13.0 (``tests/structure/test_compat.py`` resolves every path); a file
of the installed torch → lines that must be in it."""

SCHEDULER_PER_GROUP_LISTS = ("base_lrs", "_last_lr", "min_lrs", "max_lrs", "initial_lrs", "base_momentums",
                             "max_momentums")
"""Per-group lists ``torch.optim.lr_scheduler``'s schedulers keep in their state (``_last_lr``: what
``get_last_lr()`` returns)."""

# tensors and storages -----------------------------------------------------------------------------
view_base: Callable[[torch.Tensor], Optional[torch.Tensor]] = operator.attrgetter("_base")
"""The tensor ``t`` is a view of, or ``None``."""
version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
"""The tensor's in-place version counter (bumped by every in-place op on its storage)."""
storage_key: Callable[[torch.UntypedStorage], int] = operator.attrgetter("_cdata")
"""A key of the C++ storage object, equal for every Python handle of the same storage while it lives."""
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
"""``Tensor._make_wrapper_subclass(cls, shape, ...)``: a tensor subclass instance without storage."""
parse_to = torch._C._nn._parse_to
"""``Tensor.to``'s argument parser: ``(device, dtype, non_blocking, memory_format)``."""


GRAD_DTYPE_SETTABLE = hasattr(torch.Tensor, "grad_dtype")
"""``Tensor.grad_dtype`` exists: set to None, ``t.grad`` may have another dtype than ``t`` (an fp32
gradient for a bf16 tensor). Older torch refuses such a gradient: callers keep a path that needs none."""


def allow_any_grad_dtype(t: torch.Tensor) -> None:
    """``t.grad`` may take any dtype (needs `GRAD_DTYPE_SETTABLE`)."""
    t.grad_dtype = None


def has_grad_hooks(t: torch.Tensor) -> bool:
    """Whether ``register_hook`` put a hook on ``t`` (it sees the gradient before it is accumulated)."""
    return bool(t._backward_hooks)


def storage_at(base: torch.Tensor, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A storage over ``nbytes`` of ``base``'s memory from byte ``offset``; it does not own the memory."""
    return torch._C._construct_storage_from_data_pointer(base.data_ptr() + offset, base.device, nbytes)


def parameter_table(module: torch.nn.Module) -> dict[str, Optional[torch.nn.Parameter]]:
    """The module's own parameters, the live dict (a write bypasses ``Module.__setattr__``)."""
    return module._parameters


def buffer_table(module: torch.nn.Module) -> dict[str, Optional[torch.Tensor]]:
    """The module's own buffers, the live dict."""
    return module._buffers


NormBase: type = torch.nn.modules.batchnorm._NormBase
"""The base class of BatchNorm and InstanceNorm of every dimension."""


def uncompiled(module: Any) -> Any:
    """The module ``torch.compile`` wrapped, or ``module`` itself when it was not compiled.

    ``torch.compile(module)`` returns an ``OptimizedModule`` that holds the user's module as ``_orig_mod``
    and runs it through Dynamo. Plugins find the modules inside (the activations plugin wraps compiled
    modules at their compiled call, `plugins/activations/compiled.py`); DeepSpeed still gets the compiled
    module, so parameter names and checkpoints are those of the plain compiled run.
    """
    while is_optimized_module(module):
        module = module._orig_mod
    return module


def compiled_entry(module: Any) -> Optional[str]:
    """The attribute through which ``module`` runs compiled code (``None``: it runs eagerly):
    ``forward`` of torch.compile's ``OptimizedModule``, ``_compiled_call_impl`` after ``module.compile()``
    (torch/nn/modules/module.py, ``Module.compile``)."""
    if is_optimized_module(module):
        return "forward"
    if isinstance(module, torch.nn.Module) and vars(module).get("_compiled_call_impl") is not None:
        return "_compiled_call_impl"
    return None


def is_optimized_module(module: Any) -> bool:
    """``module`` is torch.compile's ``OptimizedModule`` (its ``forward`` runs the compiled code). None exists
    before Dynamo is imported, so this does not import it (about 3 s of CPU in each new process)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def compile_unavailable(device_type: str) -> Optional[str]:
    """Why ``torch.compile`` (Dynamo and Inductor) cannot build kernels for ``device_type``, or ``None``
    when it can: Dynamo unsupported on this Python, no Triton for a GPU, no C++ compiler for the CPU."""
    import shutil

    import torch._dynamo
    from torch.utils._triton import has_triton

    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile is not supported by torch {torch.__version__} on this Python"
    if device_type == "cpu":
        import os

        cxx = os.environ.get("CXX", "g++")
        found = shutil.which(cxx) or shutil.which("c++")
        return None if found else f"no C++ compiler ({cxx}) for Inductor's CPU kernels"
    if not has_triton():
        return f"Triton is not installed (or does not support this {device_type} device): Inductor cannot build kernels"
    return None


def current_dispatch_mode() -> Any:
    """The innermost active ``TorchDispatchMode``, or ``None``."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def outside_dynamo(fn: Callable) -> Callable:
    """``fn`` run with Dynamo's frame evaluation off: a hook that compiled code calls (a saved-tensor
    hook) runs as written, not traced (``torch._dynamo.disable``; ``fn`` itself without Dynamo)."""
    try:
        import torch._dynamo
    except ImportError:
        return fn
    return torch._dynamo.disable(fn)


def dispatch_mode_stack() -> list[Any]:
    """The active ``TorchDispatchMode`` objects, outermost first."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def function_mode_stack() -> list[Any]:
    """The active ``TorchFunctionMode`` objects, outermost first."""
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


def pop_function_mode_temporarily() -> Any:
    """A context that pops the innermost ``TorchFunctionMode`` and pushes it back on exit."""
    from torch.overrides import _pop_mode_temporarily

    return _pop_mode_temporarily()


def dispatch_mode_active() -> bool:
    """A ``TorchDispatchMode`` is active (the memory tracker, a FakeTensorMode): Dynamo does not trace
    under one, so compiled code must run its eager twin."""
    return current_dispatch_mode() is not None


# autograd ------------------------------------------------------------------------------------------
HookPair = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]

push_saved_tensors_hooks: Callable[[Callable, Callable], None] = torch._C._autograd._push_saved_tensors_default_hooks
"""Make ``(pack, unpack)`` the innermost saved-tensor hooks (what ``saved_tensors_hooks.__enter__`` does)."""
pop_saved_tensors_hooks: Callable[[], None] = torch._C._autograd._pop_saved_tensors_default_hooks
"""Undo the innermost `push_saved_tensors_hooks`."""
saved_tensors_hooks_enabled: Callable[[], bool] = torch._C._autograd._saved_tensors_hooks_is_enabled
"""False inside ``torch.autograd.graph.disable_saved_tensors_hooks``."""
top_saved_tensors_hooks: Callable[[bool], Optional[HookPair]] = torch._C._autograd._top_saved_tensors_default_hooks
"""``top(ignore_is_tracing)``: the innermost active (pack, unpack) pair, or ``None``."""
current_autograd_node: Callable[[], Any] = torch._C._current_autograd_node
"""The autograd node whose backward is running on this thread, or ``None``."""
graph_retained: Callable[[], bool] = torch._C._autograd._get_current_graph_task_keep_graph
"""True when the running backward keeps its graph (``retain_graph=True``: its saved tensors may be unpacked
again by a later backward), and outside any backward."""

_CHECKPOINT_PACK_OWNERS = ("_checkpoint_hook.", "_recomputation_hook.")


def current_saved_tensors_hooks() -> Optional[HookPair]:
    """The innermost active (pack, unpack) pair, or ``None`` (PyTorch applies only that pair: ours compose
    with an outer pair instead of silently shadowing it)."""
    return top_saved_tensors_hooks(False)


def is_checkpoint_hook(hooks: Optional[HookPair]) -> bool:
    """True when ``hooks`` belong to ``torch.utils.checkpoint`` (a recompute region is running): the pack
    hooks of non-reentrant checkpointing are closures of its ``_checkpoint_hook`` and ``_recomputation_hook``."""
    if hooks is None:
        return False
    qualname = getattr(hooks[0], "__qualname__", "")
    return qualname.startswith(_CHECKPOINT_PACK_OWNERS)


def sac_ignored_ops() -> frozenset:
    """Ops that selective activation checkpointing neither caches nor counts."""
    from torch.utils import checkpoint

    return frozenset(getattr(checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default}))


def host_read_ops() -> frozenset:
    """ATen op packets the host waits on: it reads their value (``.item()``, a truth value, ``equal``)
    or the shape of their output is data (``nonzero``, ``masked_select``, ``unique``)."""
    aten = torch.ops.aten
    return frozenset((aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select,
                      aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
                      aten.unique_dim_consecutive))


def copy_ops() -> tuple[Any, Any]:
    """The ATen op packets of a copy into an existing tensor (``copy_``) and into a new one (``_to_copy``)."""
    return torch.ops.aten.copy_, torch.ops.aten._to_copy


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward in progress finishes (call it from inside one of its hooks)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# dispatch and autocast -------------------------------------------------------------------------------
DisableAutocast: type = torch._C._DisableAutocast
"""Context manager: autocast off below this frame (what autocast's own kernels use)."""
DisableTorchFunctionSubclass: type = torch._C.DisableTorchFunctionSubclass
"""Context manager: ``__torch_function__`` of tensor subclasses off (what ``Tensor.__torch_function__`` uses)."""
OpOverload: type = torch._ops.OpOverload
OpOverloadPacket: type = torch._ops.OpOverloadPacket
op_entry: Callable[[Any], Callable[..., Any]] = operator.attrgetter("_op")
"""An ``OpOverload``'s C++ entry: one Python frame less than ``OpOverload.__call__``."""
log_softmax_backward_data = torch.ops.aten._log_softmax_backward_data
"""``(grad_output, output, dim, input_dtype)``: the gradient of ``log_softmax`` from its output."""
foreach_zero_ = torch._foreach_zero_
FOREACH_OPS = ("add", "add_", "addcdiv_", "addcmul_", "copy_", "div_", "lerp_", "mul_", "neg", "sqrt")
foreach = types.SimpleNamespace(**{name: getattr(torch, f"_foreach_{name}") for name in FOREACH_OPS})
"""torch's multi-tensor ops by name (``foreach.lerp_`` is ``torch._foreach_lerp_``): what ``torch.optim``'s
``foreach`` paths run, one op over a list of tensors."""
UPSTREAM_NAMES.update({f"torch._foreach_{name}": "aten op, torch/_C/_VariableFunctions.pyi" for name in FOREACH_OPS})
amp_foreach_non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
"""``(grads, found_inf, inv_scale)``: what ``GradScaler.unscale_`` runs, in place."""
fused_adam_ = torch._fused_adam_
fused_adamw_ = torch._fused_adamw_
"""``(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2, weight_decay, eps,
amsgrad, maximize)``: the kernel of ``torch.optim.Adam`` / ``AdamW`` with ``fused=True``, in place over lists of
tensors; each step tensor holds the step after increment, on the parameters' device (read, not changed)."""
fused_adam_devices: Callable[[], list[str]] = torch.utils._foreach_utils._get_fused_kernels_supported_devices
"""Device types that have torch's fused optimizer kernels (``fused=True``)."""
UPSTREAM_NAMES.update({
    "torch._fused_adam_": "aten op, torch/_C/_VariableFunctions.pyi (torch/optim/adam.py _fused_adam)",
    "torch._fused_adamw_": "aten op, torch/_C/_VariableFunctions.pyi (torch/optim/adam.py _fused_adam)",
    "torch.utils._foreach_utils._get_fused_kernels_supported_devices": "torch/utils/_foreach_utils.py L13",
})


def op_schema(func: Any) -> Any:
    """The ``FunctionSchema`` of an ``OpOverload`` (``None`` for anything else)."""
    return getattr(func, "_schema", None)


def privateuse1_backend_name() -> str:
    """The device type name the out-of-tree backend registered (``"privateuseone"`` when none did)."""
    return torch._C._get_privateuse1_backend_name()


def all_op_names() -> list[str]:
    """Every qualified operator overload the dispatcher knows (``"aten::mm"``, ``"aten::add.Tensor"``)."""
    return torch._C._dispatch_get_all_op_names()


def ops_with_kernel(key: str) -> frozenset[str]:
    """Qualified overloads that have a kernel at dispatch key ``key`` (PyTorch's own list)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return frozenset(n for n in all_op_names() if has(n, key))


def destroy_library(lib: torch.library.Library) -> None:
    """Deregister every kernel ``lib`` registered; the earlier kernels come back."""
    lib._destroy()


def fake_tensor_mode(**kwargs: Any) -> Any:
    """A ``FakeTensorMode`` (tensors with shapes, dtypes and devices but no memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def cast_ops() -> frozenset:
    """The op a dtype cast (``.to(dtype)``, ``.float()``) dispatches to."""
    return frozenset({torch.ops.aten._to_copy.default})


def flop_aliases() -> dict:
    """ATen op packets PyTorch's FLOP table (``torch.utils.flop_counter.flop_registry``) leaves out, each with the
    packet of the same arithmetic it does count: the CPU's own flash attention, forward and backward."""
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward}


def is_fake(t: torch.Tensor) -> bool:
    """``t`` is a tensor of a ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


# the CUDA caching allocator's history ------------------------------------------------------------------
def record_memory_history(enabled: Optional[str] = "all", max_entries: int = 1_000_000) -> None:
    """Start (``enabled="all"``) or stop (``None``) the allocator's per-allocation history."""
    torch.cuda.memory._record_memory_history(enabled=enabled, max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the allocator's history as ``torch.cuda.memory._snapshot`` pickle (memory_viz reads it)."""
    torch.cuda.memory._dump_snapshot(path)


__all__ = [
    "DisableAutocast", "DisableTorchFunctionSubclass", "GRAD_DTYPE_SETTABLE", "NormBase", "OpOverload",
    "OpOverloadPacket",
    "SCHEDULER_PER_GROUP_LISTS", "TorchDispatchMode", "UPSTREAM_NAMES", "all_op_names", "allow_any_grad_dtype",
    "amp_foreach_non_finite_check_and_unscale_", "buffer_table", "compile_unavailable", "compiled_entry", "copy_ops",
    "fused_adam_", "fused_adam_devices", "fused_adamw_",
    "host_read_ops",
    "current_autograd_node",
    "current_dispatch_mode", "current_saved_tensors_hooks", "destroy_library", "disable_current_modes",
    "dispatch_mode_active", "dispatch_mode_stack", "function_mode_stack", "pop_function_mode_temporarily",
    "dump_memory_snapshot", "fake_tensor_mode", "flop_aliases", "foreach", "foreach_zero_", "graph_retained",
    "is_checkpoint_hook",
    "is_optimized_module",
    "is_traceable_wrapper_subclass", "log_softmax_backward_data", "make_wrapper_subclass", "op_entry", "op_schema",
    "ops_with_kernel", "outside_dynamo", "parameter_table", "parse_to", "pop_mode_temporarily",
    "pop_saved_tensors_hooks",
    "privateuse1_backend_name", "push_saved_tensors_hooks", "pytree", "queue_end_of_backward",
    "cast_ops", "is_fake", "record_memory_history", "sac_ignored_ops", "saved_tensors_hooks_enabled", "storage_at", "storage_key",
    "top_saved_tensors_hooks", "uncompiled", "version", "view_base",
]
