"""Test-only shim: megatron-core's CUDA-only calls, answered on CPU.

megatron-core 0.16.1 runs GPT forward/backward, its DDP, its schedules and its fp32 optimizer on CPU
except for a few calls that name CUDA (notes/cpu-runtime.md). `install` maps exactly those, in the
test process only (the package never imports this module; ``examples/megatron_gpt.py`` does on CPU):

* ``torch.cuda.current_device()`` returns ``"cpu"``: used as ``device=`` by RoPE, by
  ``GlobalMemoryBuffer.get_tensor`` (local-spec attention) and by the grad buffers
  (``distributed/param_and_grad_buffer.py``).
* ``torch.cuda.synchronize()`` does nothing: the pipeline's batched point-to-point sends
  (``batch_p2p_sync``) and the distributed checkpoint's writer (``filesystem_async.preload_tensors``)
  call it; on CPU there is nothing to wait for.
* The CUDA RNG calls of ``tensor_parallel/random.py`` (``torch.cuda.get_rng_state``,
  ``torch.cuda.manual_seed``, ``_set_cuda_rng_state``) use the CPU generator, so the RNG tracker's
  ``fork`` and ``model_parallel_cuda_manual_seed`` keep their meaning (``fork``'s warning that the CPU
  state changed inside it is silenced: here the two are one generator).
* Four modules allocate on ``device="cuda"`` literally: ``pipeline_parallel/schedules.py`` (the token
  count), ``optimizer/optimizer.py`` (``FP32Optimizer``'s loss scale), ``optimizer/clip_grads.py`` and
  ``utils.py`` (``local_multi_tensor_l2_norm``, the grad norm). Their module-level ``torch`` is
  replaced by `CpuTorch`, which forwards every name to ``torch`` and rewrites that one argument of
  the factory functions.
* ``Tensor.type()`` with no argument, called from a ``megatron.`` module on a CPU tensor, answers the
  CUDA type name (``torch.cuda.FloatTensor``): the distributed optimizer and the fp16/bf16 optimizers
  sort parameters by those names (``distrib_optimizer.py`` L361/L420/L582, ``optimizer.py`` L671/L690)
  and raise on any other; the grad clipping asserts one (``clip_grads.py`` L167). Calls from any other
  module, and every call with a dtype argument, are torch's own.
* Sequence parallelism needs Apex's or TE's norm (the local spec's ``WrappedTorchNorm`` asserts it off,
  ``torch_norm.py`` L32): `SequenceParallelNorm` stands in for Apex's ``FusedLayerNorm`` there, a torch
  ``LayerNorm``/``RMSNorm`` whose parameters carry ``sequence_parallel`` as Apex's do (so
  ``finalize_model_grads`` all-reduces their gradients over the tensor-parallel group). It replaces
  ``LNImpl``/``LayerNormImpl`` in the backend, layer-spec and block modules, so the LayerNorm specs built
  after `install` use it (an RMSNorm local spec resets megatron-core's own global to ``WrappedTorchNorm``).
"""
from __future__ import annotations

import functools
import importlib
import sys
import types
import warnings
from typing import Any, Callable

import torch

FACTORIES = frozenset({"empty", "zeros", "ones", "full", "tensor", "arange"})
"""Factory functions whose ``device=`` `CpuTorch` rewrites."""
PATCHED_MODULES = ("megatron.core.pipeline_parallel.schedules", "megatron.core.optimizer.optimizer",
                   "megatron.core.optimizer.clip_grads", "megatron.core.utils")
"""Modules whose ``torch`` global becomes `CpuTorch`."""

_INSTALLED = False


class SequenceParallelNorm:
    """Apex's ``FusedLayerNorm`` as far as sequence parallelism goes, on torch's norms (module docstring)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _cpu_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or str(device).startswith("cuda")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapped


class CpuTorch(types.ModuleType):
    """``torch`` as seen by one Megatron module: every name forwarded, factories allocate on CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self._factories = {name: _cpu_device(getattr(torch, name)) for name in FACTORIES}

    def __getattr__(self, name: str) -> Any:
        factory = self.__dict__.get("_factories", {}).get(name)
        return factory if factory is not None else getattr(torch, name)


def _megatron_type(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if (dtype is None and not kwargs and self.device.type == "cpu"
                and sys._getframe(1).f_globals.get("__name__", "").startswith("megatron.")):
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


def install() -> None:
    """Patch the CUDA-only calls listed in the module docstring (idempotent; this process only)."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    _INSTALLED = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.Tensor.type = _megatron_type(torch.Tensor.type)

    import megatron.core.tensor_parallel.random as random_module

    random_module._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)
    warnings.filterwarnings("ignore", message="CPU RNG state changed within GPU RNG context")
    import megatron.core.models.backends as backends
    import megatron.core.models.gpt.gpt_layer_specs as layer_specs
    import megatron.core.transformer.transformer_block as block

    backends.LNImpl = layer_specs.LNImpl = block.LayerNormImpl = SequenceParallelNorm
    cpu_torch = CpuTorch()
    for name in PATCHED_MODULES:
        importlib.import_module(name).torch = cpu_torch
