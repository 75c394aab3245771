"""Every name xirang reads from megatron-core, in one version-guarded place.

The integration runs on megatron-core 0.16.1 (what installs for Python 3.11 here) and its names were
read in the source of Megatron-LM's tags ``core_v0.12.0`` to ``core_v0.19.0`` and main. `UPSTREAM_NAMES` lists,
per file, the lines this module relies on; ``tests/integration/test_megatron_patch.py`` reads each tag's source
(when a Megatron-LM checkout is available) and fails when one of them moves. Line numbers below are at
``core_v0.16.1`` (commit 55ac7082517c3878ae653c07c09c534b8aed49f6).
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterable

import torch

from xirang_ds.hooks import wrap_method

logger = logging.getLogger("xirang_ds")

CHECKED_RANGE = ((0, 12), (0, 21))
"""megatron-core versions whose source was read: ``>= 0.12, < 0.21``; 0.20 is Megatron-LM main at d98e8a64
(2026-08-22, ``package_info`` 0.20.0, in-tree megatron-core; no 0.20 release was read). setup.py's extra
stays ``< 0.20``: a pip-installed 0.20 was not read."""
TESTED_VERSION = "0.16.1"
"""The version the CPU tests run."""

UPSTREAM_NAMES: dict[str, tuple[str, ...]] = {
    # DDP's contiguous grad (and, with the distributed optimizer, param) buffers, and its backward
    # hook, which folds param.grad into param.main_grad
    "megatron/core/distributed/distributed_data_parallel.py": (
        "self.buffers", "self.expert_parallel_buffers", "param.main_grad.add_(param.grad.data)",
        # grad_release disarms the hook (it checks this dict first) and the methods touching the buffer
        "if param in self.param_to_bucket_group:", "def zero_grad_buffer(self)", "def start_grad_sync(self",
        "def finish_grad_sync(self", "def scale_gradients(self"),
    "megatron/core/distributed/param_and_grad_buffer.py": ("self.grad_data", "self.param_data"),
    "megatron/core/distributed/distributed_data_parallel_config.py": (
        "bucket_size:", "overlap_grad_reduce:", "grad_reduce_in_fp32:"),
    # the persistent model-parallel arena (sequence-parallel all-gathers, attention workspace)
    "megatron/core/parallel_state.py": (
        "_GLOBAL_MEMORY_BUFFER = None", "def model_parallel_is_initialized", "def get_data_parallel_world_size",
        "def get_tensor_model_parallel_world_size", "def get_tensor_model_parallel_group",
        "def get_data_parallel_group", "def get_pipeline_model_parallel_world_size"),
    "megatron/core/utils.py": ("class GlobalMemoryBuffer", "self.buffer = {}"),
    "megatron/core/optimizer/optimizer.py": (
        "self.chained_optimizers", "self.float16_groups", "self.fp32_from_float16_groups", "def sharded_state_dict",
        "def load_state_dict", "class FP32Optimizer",
        # optimizer_states' masters: the Float16 optimizer's masters whole from prepare_grads to the end of
        # step_with_ready_grads, saved from state_dict's list
        "def prepare_grads(self)", "def step_with_ready_grads(self)", "def reload_model_params(self",
        "state_dict['fp32_from_fp16_params'] = self.fp32_from_float16_groups"),
    # optimizer_states steps the distributed optimizer's ranges and reads/writes their states through its
    # per-parameter seams; precision keeps the LM loss in fp32
    "megatron/core/optimizer/distrib_optimizer.py": (
        "class DistributedOptimizer", "def _get_main_param_and_optimizer_states",
        "def _set_main_param_and_optimizer_states", "def load_parameter_state_from_dp_zero(",
        "def load_parameter_state(", "self.model_param_group_index_map", "self.model_fp32_groups",
        "self.shard_fp32_groups", "self.model_float16_groups", "self.shard_fp32_from_float16_groups"),
    "megatron/core/models/common/language_module/language_module.py": ("def compute_language_model_loss(self, labels",),
    "megatron/core/optimizer/optimizer_config.py": (
        "use_precision_aware_optimizer:", "exp_avg_dtype:", "exp_avg_sq_dtype:", "optimizer_cpu_offload:",
        "clip_grad:"),
    "megatron/core/transformer/transformer_config.py": (
        "recompute_granularity:", "recompute_method:", "recompute_num_layers:", "recompute_modules:",
        "distribute_saved_activations:"),
    "megatron/core/model_parallel_config.py": ("cpu_offloading:", "cpu_offloading_num_layers:", "bf16:", "fp16:",
                                               "sequence_parallel:", "gradient_accumulation_fusion:"),
    "megatron/core/transformer/transformer_layer.py": (
        "class TransformerLayer(", "self.self_attention", "self.input_layernorm", "self.pre_mlp_layernorm",
        "self.mlp"),
    "megatron/core/num_microbatches_calculator.py": ("def get_num_microbatches",),
    "megatron/core/package_info.py": ("__version__",),
    "megatron/core/optimizer/__init__.py": ("MegatronOptimizer",),
    # the seams docs/megatron.md gives the plugins: the TP layers and what their autograd function saves
    "megatron/core/tensor_parallel/layers.py": (
        "class ColumnParallelLinear", "class RowParallelLinear", "class VocabParallelEmbedding",
        "ctx.save_for_backward(input, weight)", "weight.main_grad", "grad_added_to_main_grad"),
    # the dropout generators of tensor-parallel regions, which a recomputation must restore
    "megatron/core/tensor_parallel/random.py": ("def get_cuda_rng_tracker", "def get_states", "def set_states"),
}
"""File → substrings that must be in it (read at every tag of `CHECKED_RANGE` by the tests)."""

RECOMPUTE_MODULES: dict[str, tuple[str, ...]] = {
    "core_attn": ("self_attention.core_attention",),
    "layernorm": ("input_layernorm", "pre_mlp_layernorm"),
    "mlp": ("mlp",),
    "moe": ("mlp",),
    "moe_act": ("mlp.experts",),
    "shared_experts": ("mlp.shared_experts",),
    "mla_up_proj": ("self_attention",),
}
"""``TransformerConfig.recompute_modules`` keys → submodules of a ``TransformerLayer`` they recompute
(transformer_config.py L411-424, transformer_layer.py). An unknown key counts as the whole layer."""

OFFLOAD_MODULES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("input_layernorm",),
    "qkv_linear": ("self_attention.linear_qkv",),
    "core_attn": ("self_attention.core_attention",),
    "attn_proj": ("self_attention.linear_proj",),
    "mlp_norm": ("pre_mlp_layernorm",),
    "expert_fc1": ("mlp.experts",),
    "moe_act": ("mlp.experts",),
}
"""``TransformerConfig.offload_modules`` keys (fine-grained activation offloading, 0.16+;
transformer_config.py L894) → submodules of a ``TransformerLayer``."""

_warned = False

# Megatron-LM's launch (pretrain_gpt.py -> megatron.training.pretrain), per version range --------------
LAUNCHES: dict[str, str] = {
    "providers": "core_v0.16-0.17: pretrain(train_valid_test_dataset_provider, model_provider, model_type, "
                 "forward_step_func, ..., extra_args_provider=...) parses the arguments itself",
    "config_and_provider": "core_v0.18: pretrain(cfg_container, train_valid_test_dataset_provider, model_provider, "
                           "model_type, ...); pretrain_gpt.py parses the arguments first with "
                           "parse_and_validate_args(extra_args_provider=...)",
    "config_builder": "core_v0.19 and main: pretrain(cfg_container, train_valid_test_dataset_provider, model_type, "
                      "forward_step_func, model_provider=None, ...); the model is built from cfg_container.model "
                      "(its pre_wrap_hooks run before DDP wraps it)",
}
"""The shapes of Megatron-LM's ``pretrain`` xirang knows, by the version range that has each (read in
training.py at core_v0.16.0, 0.16.1, 0.17.0, 0.17.1, 0.18.2, 0.19.0 and main d98e8a64,
tests/integration/test_megatron_patch.py)."""
PATCH_FOR_LAUNCH: dict[str, str] = {
    "providers": "patches/megatron-lm-core_v0.16.1.patch",
    "config_and_provider": "patches/megatron-lm-core_v0.19.0.patch",
    "config_builder": "patches/megatron-lm-core_v0.19.0.patch",
}
"""The patch that fits each launch shape."""


class MegatronVersionError(RuntimeError):
    """This Megatron-LM is not one xirang's launch glue supports, or the glue used does not fit it.

    The message names the megatron-core version found, the versions supported and the fix.
    """


def megatron_version_text() -> str:
    """``megatron.core.package_info.__version__``, or a phrase saying it could not be read."""
    try:
        from megatron.core.package_info import __version__
    except ImportError as e:
        return f"unknown (megatron.core.package_info does not import: {e})"
    return str(__version__)


def megatron_lm_launch(pretrain: Callable[..., Any]) -> str:
    """Which shape of Megatron-LM's ``pretrain`` this is: a key of `LAUNCHES`.

    Read from the parameters of ``pretrain`` (``inspect.signature`` follows the ``functools.wraps``
    wrappers, Megatron-LM's in-process restart included), so it holds for a checkout between tags too.

    Raises:
        MegatronVersionError: the parameters match none of `LAUNCHES` (named with the version found).
    """
    import inspect

    try:
        params = inspect.signature(pretrain).parameters
    except (TypeError, ValueError) as e:
        raise MegatronVersionError(f"cannot read the parameters of {pretrain!r} ({e}); xirang's Megatron-LM glue "
                                   "wraps megatron.training.pretrain") from None
    names = list(params)
    if {"model_provider", "extra_args_provider"} <= set(names):
        return "providers"
    if names[:1] == ["cfg_container"] and "model_provider" in params:
        if params["model_provider"].default is inspect.Parameter.empty:
            return "config_and_provider"
        return "config_builder"
    raise MegatronVersionError(
        f"Megatron-LM's pretrain({', '.join(names)}) (megatron-core {megatron_version_text()}) matches none of the "
        "shapes xirang supports: " + "; ".join(LAUNCHES.values()) + ". Use Megatron-LM core_v0.16.0 to core_v0.19.x "
        "or main as of 2026-08-22 with the patch for it (docs/megatron.md), or call build_session, prepare_model "
        "and attach from xirang_ds.integration.megatron in your own loop")


def megatron_version() -> tuple[int, ...]:
    """The installed megatron-core version as integers (``(0, 16, 1)``)."""
    from megatron.core.package_info import __version__

    return tuple(int(part) for part in __version__.split(".")[:3] if part.isdigit())


def check_version() -> None:
    """Warn once when megatron-core is outside the range whose source was read."""
    global _warned
    version = megatron_version()
    low, high = CHECKED_RANGE
    if not (low <= version[:2] < high) and not _warned:
        _warned = True
        warnings.warn(f"xirang_ds's Megatron integration was checked against megatron-core "
                      f"{low[0]}.{low[1]} to {high[0]}.{high[1] - 1} (tested on {TESTED_VERSION}); found "
                      f"{'.'.join(map(str, version))}. If something fails, the names it reads are listed in "
                      "xirang_ds/compat/megatron.py", stacklevel=2)


def unwrap(module: Any) -> Any:
    """The model under Megatron's wrappers (``DistributedDataParallel``, ``Float16Module``): both keep
    it as ``.module``."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def grad_buffers(model_chunks: Iterable[Any]) -> list[Any]:
    """The ``_ParamAndGradBuffer`` objects of Megatron DDP chunks (dense and expert-parallel;
    distributed_data_parallel.py L291-302). A chunk that is not Megatron's DDP has none."""
    out: list[Any] = []
    for chunk in model_chunks:
        out.extend(getattr(chunk, "buffers", None) or [])
        out.extend(getattr(chunk, "expert_parallel_buffers", None) or [])
    return out


def buffer_tensors(model_chunks: Iterable[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(grad_data, param_data)`` tensors of the chunks' buffers (param_and_grad_buffer.py: ``grad_data``
    holds every ``param.main_grad``; ``param_data`` exists with the distributed optimizer)."""
    grads, params = [], []
    for buffer in grad_buffers(model_chunks):
        if isinstance(getattr(buffer, "grad_data", None), torch.Tensor):
            grads.append(buffer.grad_data)
        if isinstance(getattr(buffer, "param_data", None), torch.Tensor):
            params.append(buffer.param_data)
    return grads, params


def global_memory_buffer_tensors() -> list[torch.Tensor]:
    """Tensors held by Megatron's ``GlobalMemoryBuffer`` (parallel_state.py L139, utils.py L609): the
    persistent arena of sequence-parallel all-gathers, lent to local attention's baddbmm input."""
    from megatron.core import parallel_state

    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is None:
        return []
    return [t for t in getattr(buffer, "buffer", {}).values() if isinstance(t, torch.Tensor)]


def rng_tracker_states() -> dict[str, torch.Tensor]:
    """A copy of Megatron's RNG tracker states (random.py L203 ``get_states``): the generators the
    dropouts of tensor-parallel regions fork into (``get_cuda_rng_tracker().fork()``)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return dict(get_cuda_rng_tracker().get_states())


def set_rng_tracker_states(states: dict[str, torch.Tensor]) -> None:
    """Put ``states`` back into Megatron's RNG tracker (random.py L211 ``set_states``). The tracker keeps
    the dict it is given and ``fork`` writes into it, so it gets a copy and ``states`` stays as it is."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(dict(states))


def agreement_groups() -> list[Any]:
    """The process groups a per-rank decision must be agreed over: the tensor-parallel group (its
    ranks issue the same collectives inside each layer) and the data-parallel group (its ranks run
    the same micro-batch schedule); ``[None]`` (the default group) when Megatron's state is not set up.
    Ranks of other pipeline stages hold other layers and are left out."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return [None]
    return [parallel_state.get_tensor_model_parallel_group(), parallel_state.get_data_parallel_group()]


def optimizer_members(optimizer: Any) -> list[Any]:
    """The ``MegatronOptimizer``s of a Megatron optimizer: ``ChainedOptimizer.chained_optimizers``
    (optimizer.py L1104), or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim`` objects inside a Megatron optimizer (each member's ``.optimizer``)."""
    inner = (getattr(m, "optimizer", None) for m in optimizer_members(optimizer))
    return [o for o in inner if isinstance(o, torch.optim.Optimizer)]


def optimizer_configs(optimizer: Any) -> list[Any]:
    """The ``OptimizerConfig`` of each member of a Megatron optimizer (``MegatronOptimizer.config``)."""
    return [m.config for m in optimizer_members(optimizer) if getattr(m, "config", None) is not None]


def is_megatron_optimizer(optimizer: Any) -> bool:
    from megatron.core.optimizer import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)


def parallel_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """``(name, module, kind)`` of Megatron's tensor-parallel layers in ``model``.

    ``kind`` is ``"column"`` (``ColumnParallelLinear``: weight ``[out/tp, in]``, input replicated on
    the TP group, output split), ``"row"`` (``RowParallelLinear``: weight ``[out, in/tp]``, input
    split, output all-reduced, bias replicated) or ``"vocab"`` (``VocabParallelEmbedding``: rows
    ``[vocab/tp, hidden]``, output all-reduced). tensor_parallel/layers.py.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    kinds = ((ColumnParallelLinear, "column"), (RowParallelLinear, "row"), (VocabParallelEmbedding, "vocab"))
    out = []
    for name, module in model.named_modules():
        kind = next((k for cls, k in kinds if isinstance(module, cls)), None)
        if kind is not None:
            out.append((name, module, kind))
    return out


def gradient(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient Megatron reduces and steps: ``param.main_grad`` under Megatron's DDP (its backward
    hook folds ``param.grad`` into it and drops ``param.grad``; with ``gradient_accumulation_fusion``
    the weight gradient is written there directly), else ``param.grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if isinstance(main_grad, torch.Tensor) else param.grad


REPLICATED_INPUT_CHILDREN = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp")
"""Children of a ``TransformerLayer`` whose input is identical on every tensor-parallel rank without
sequence parallelism, like the layer's own (a norm's input or output; transformer_layer.py)."""


def transformer_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, layer)`` of every ``TransformerLayer`` in ``model``, in order (names local to the chunk:
    ``decoder.layers.0``)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, TransformerLayer)]


def num_microbatches() -> int | None:
    """Megatron's current number of micro-batches per step, when its calculator is initialised."""
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return int(get_num_microbatches())
    except (AssertionError, AttributeError, TypeError, ImportError):
        return None


DUMMY_STATE_INIT = "_init_optimizer_states_with_dummy_values"
"""The distributed optimizer's method (from core_v0.14; wrapped where present) that steps every range's
master with zero gradients outside a training step, to make states a load then overwrites."""


def wrap_range_state_seams(member: Any, read: Callable, write: Callable) -> list:
    """Wrap the distributed optimizer's per-parameter state reader and writer (``read(original, model_param)``,
    ``write(original, model_param, tensors)``): ``_get_main_param_and_optimizer_states`` and
    ``_set_main_param_and_optimizer_states`` (distrib_optimizer.py L883-L940 at 0.16.1; the same names and
    signatures from 0.12 to 0.19), through which every checkpoint format reads and writes a range's states.

    Returns:
        The two `xirang_ds.hooks.MethodWrap` handles.
    """
    return [wrap_method(member, "_get_main_param_and_optimizer_states", read),
            wrap_method(member, "_set_main_param_and_optimizer_states", write)]


__all__ = ["CHECKED_RANGE", "DUMMY_STATE_INIT", "LAUNCHES", "MegatronVersionError", "OFFLOAD_MODULES",
           "PATCH_FOR_LAUNCH", "RECOMPUTE_MODULES", "REPLICATED_INPUT_CHILDREN", "TESTED_VERSION", "UPSTREAM_NAMES",
           "agreement_groups", "buffer_tensors", "check_version", "global_memory_buffer_tensors", "grad_buffers",
           "gradient", "inner_optimizers", "is_megatron_optimizer", "megatron_lm_launch", "megatron_version",
           "megatron_version_text", "num_microbatches", "optimizer_configs", "parallel_layers", "rng_tracker_states",
           "set_rng_tracker_states", "transformer_layers", "unwrap", "wrap_range_state_seams"]
