"""Every private DeepSpeed name xirang_ds uses, in one version-guarded place.

setup.py allows ``deepspeed>=0.16,<0.21``; the names were read in 0.19.8 (the tested version), with the
lines below at that release. `UPSTREAM_NAMES` lists, per file of the installed package, the lines relied
on; ``tests/structure/test_compat.py`` reads them in the installed DeepSpeed and fails when one moves.

grad_release's engine protocol (``runtime/engine.py``):

* ``_backward_epilogue`` (l. 3153) all-reduces every gradient at stage 0 when
  ``engine.enable_backward_allreduce`` is true, creating zero gradients for parameters whose
  ``grad`` is None (``buffered_allreduce_fallback``, l. 3921). grad_release reduces itself and
  drops gradients, so it clears the flag while attached (the pipeline engine clears it too).
* ``_take_model_step`` (l. 3505) calls ``self.optimizer.step()`` (at stage 0 without a precision
  wrapper ``self.optimizer`` is the basic optimizer), then reads ``self.optimizer.overflow`` to skip
  the LR scheduler and count ``skipped_steps``, and ``self.optimizer._global_grad_norm`` for
  ``get_global_grad_norm()``. `step_protocol` empties the basic optimizer's param groups for that
  call (the update already happened in backward) and sets both attributes, the way DeepSpeed's own
  fp16/ZeRO wrappers expose them.
* ``gradient_clipping()`` (l. 1778) returns ``engine._config.gradient_clipping``; DeepSpeed's copy
  of the ds_config says 0 while grad_release clips, and `restore_gradient_clipping` gives the
  engine the user's value back when grad_release is removed.

``tests/grad_release/test_units.py::test_deepspeed_protocol_still_holds`` also runs `protocol_holds`.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Optional

from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import COMM_BUFFERS, GRADIENTS, PARAMETERS

UPSTREAM_NAMES: dict[str, tuple[str, ...]] = {
    "deepspeed/runtime/engine.py": (
        "def _backward_epilogue(self)", "def _take_model_step(self", "self._config.gradient_clipping",
        "self._is_gradient_accumulation_boundary = is_boundary", "def _get_zero_ckpt_name(self, checkpoints_path, tag)",
        "def _get_all_zero_checkpoint_names(self, load_dir, tag, bf16_mode)", "def _get_zero_param_shapes(self)",
        "def _get_shared_params(self)", "def _save_zero_checkpoint(self, save_path, tag)",
        "self.optimizer._restore_from_bit16_weights()"),
    "deepspeed/runtime/zero/stage_1_and_2.py": (
        "def _link_all_hp_params(self)", "def _release_ipg_buffers(self)", "def _gradient_reduction_buffer_dtype(self)",
        "def _release_preflattened_grad_buffers(self", "self._offload_accumulated_param_ids = set()",
        "self.temp_grad_buffer_for_gpu_offload = torch.zeros(largest_param_numel,",
        "self.param_buffer_of_bit16_for_cpu_offload_groups.append(temp_buffer_bit16)",
        "self.accumulated_grads_in_cpu[param_id] = buffer_to_accumulate_to_in_cpu()"),
    "deepspeed/runtime/bf16_optimizer.py": ("def _link_all_hp_params(self)",),
    "deepspeed/runtime/base_optimizer.py": ("self._backward_hook_state = BackwardHookStateManager()",),
    "deepspeed/runtime/zero/partitioned_param_coordinator.py": ("def _invalidate_trace(self)",),
    "deepspeed/runtime/zero/stage3.py": (
        "def _set_fp32_optimizer_param_groups(self)", "def _clear_fp32_optimizer_param_groups(self)",
        "self.__param_id_to_grad_partition", "def _prepare_sub_group(self, sub_group_id, timer_names)",
        "def _release_sub_group(self, sub_group_id, timer_names)",
        "self.fp16_partitioned_groups_flat[sub_group_id].data.copy_(",
        "state_dict[FP32_FLAT_GROUPS] = self.fp32_partitioned_groups_flat",
        "self.optimizer = torch.optim.Adagrad(self.fp32_partitioned_groups_flat, **self.optimizer.defaults)",
        "self.fp32_partitioned_groups_flat[i].grad = subgroup_gradient_buffer.to(self.subgroup_to_device[i])"),
    "deepspeed/utils/mixed_precision_linkage.py": ("lp_param._hp_mapping = get_hp_fragment_mapping(",),
    "deepspeed/runtime/zero/parameter_offload.py": (
        "return apply_to_tensors_only(module.pre_bwd_fn.apply,", "module.pre_bwd_fn = PreBackwardFunctionForModule",
        "return outputs.detach()"),
}
"""File of the installed DeepSpeed → lines that must be in it (lines of 0.19.8 in the docstrings below)."""

PROTOCOL_ATTRIBUTES = ("overflow", "_global_grad_norm")
"""Attributes ``_take_model_step`` reads from ``engine.optimizer``."""


def protocol_holds() -> list[str]:
    """What of the relied-on engine behaviour is missing in the installed DeepSpeed (empty: all there)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    missing = []
    take = inspect.getsource(DeepSpeedEngine._take_model_step)
    for needle in ("self.optimizer.step()", "self.optimizer.overflow", "_global_grad_norm"):
        if needle not in take:
            missing.append(f"DeepSpeedEngine._take_model_step no longer uses {needle}")
    if "enable_backward_allreduce" not in inspect.getsource(DeepSpeedEngine._backward_epilogue):
        missing.append("DeepSpeedEngine._backward_epilogue no longer checks enable_backward_allreduce")
    if "self._config.gradient_clipping" not in inspect.getsource(DeepSpeedEngine.gradient_clipping):
        missing.append("DeepSpeedEngine.gradient_clipping no longer reads self._config.gradient_clipping")
    return missing


def restore_gradient_clipping(engine: Any, value: float) -> None:
    """Make the engine clip at ``value`` again (its ds_config copy said 0 while grad_release clipped)."""
    engine._config.gradient_clipping = value


@contextlib.contextmanager
def step_protocol(optimizer: Any, skipped: bool, grad_norm: Optional[float]) -> Iterator[None]:
    """Around ``engine.step()`` at a boundary: the basic optimizer steps nothing and reports the outcome.

    Args:
        optimizer: ``engine.optimizer`` (the basic optimizer at stage 0).
        skipped: the step was skipped (DeepSpeed then skips the scheduler and counts it).
        grad_norm: the global gradient norm for ``engine.get_global_grad_norm()`` (None: unknown).
    """
    saved_params = [group["params"] for group in optimizer.param_groups]
    saved_attrs = {name: vars(optimizer)[name] for name in PROTOCOL_ATTRIBUTES if name in vars(optimizer)}
    for group in optimizer.param_groups:
        group["params"] = []
    optimizer.overflow = skipped
    if grad_norm is not None:
        optimizer._global_grad_norm = grad_norm
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved_params):
            group["params"] = params
        for name in PROTOCOL_ATTRIBUTES:
            vars(optimizer).pop(name, None)
        vars(optimizer).update(saved_attrs)




# the engine ------------------------------------------------------------------------------------------
def accumulation_boundary(engine: Any) -> Any:
    """The engine's own boundary flag (``None`` until ``set_gradient_accumulation_boundary`` or a step
    sets it; engine.py L3491)."""
    return engine._is_gradient_accumulation_boundary


def restore_accumulation_boundary(engine: Any, value: Any) -> None:
    """Put back a flag read with `accumulation_boundary` (``None`` included, which the public setter refuses)."""
    engine._is_gradient_accumulation_boundary = value


def shared_params(engine: Any) -> dict:
    """The tied weights' names as DeepSpeed records them in ZeRO checkpoints (engine.py L5490)."""
    return engine._get_shared_params()


def zero_param_shapes(engine: Any) -> Any:
    """What DeepSpeed writes as ``param_shapes`` (engine.py L5448)."""
    return engine._get_zero_param_shapes()


def redirect_zero_files(engine: Any, path_of: Callable[[], str]) -> Any:
    """While the handle lives, DeepSpeed writes this rank's ZeRO file at ``path_of()`` (engine.py L4331
    ``_get_zero_ckpt_name``); returns the handle (``remove()``)."""
    return wrap_method(engine, "_get_zero_ckpt_name", lambda _original, *_: path_of())


def around_zero_save(engine: Any, save: Callable[..., Any]) -> Any:
    """Wrap DeepSpeed's write of this rank's ZeRO file (engine.py L5549 ``_save_zero_checkpoint``, called
    before ``latest`` is written): ``save(original, save_path, tag)``; returns the handle."""
    return wrap_method(engine, "_save_zero_checkpoint", save)


def around_zero_file_names(engine: Any, names: Callable[..., list[str]]) -> Any:
    """Wrap the list of ZeRO files DeepSpeed's load reads (engine.py L4785 ``_get_all_zero_checkpoint_names``):
    ``names(original, load_dir, tag, bf16_mode)``; returns the handle."""
    return wrap_method(engine, "_get_all_zero_checkpoint_names", names)


# ZeRO optimizers ---------------------------------------------------------------------------------------
OPTIMIZER_ATTRIBUTES_BY_ROLE: dict[str, tuple[str, ...]] = {
    PARAMETERS: (
        "bit16_groups_flat", "single_partition_of_fp32_groups", "fp16_groups", "fp32_groups",
        "fp16_groups_flat", "fp32_groups_flat", "fp16_partitioned_groups_flat",
        "fp32_partitioned_groups_flat", "lp_param_buffer", "bf16_groups", "bf16_groups_flat",
        "fp32_groups_flat_partition", "bit16_groups",
    ),
    GRADIENTS: (
        "averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer",
        "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", "fp32_groups_gradients_flat",
        "fp32_groups_gradient_flat_partition", "fp32_groups_gradients", "fp32_groups_actual_gradients_flat",
        "temp_grad_buffer_for_gpu_offload",
    ),
    COMM_BUFFERS: (
        "ipg_buckets", "ipg_buffer", "_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer",
    ),
}
"""Memory category → attributes of DeepSpeed's optimizer wrappers (ZeRO 1/2/3, bf16, fp16) holding that
category's buffers, at any stage and precision mode (``_DeepSpeedZeroOptimizer_Stage3__*`` are stage3.py's
name-mangled ``self.__param_id_to_grad_partition`` and ``self.__ipg_bucket_flat_buffer``; the latter is
absent from 0.19.8 and read where an older release has it)."""

OFFLOADED_OPTIMIZER_ATTRIBUTES = (
    "single_partition_of_fp32_groups", "param_buffer_of_bit16_for_cpu_offload_groups",
    "temp_grad_buffer_for_cpu_offload", "accumulated_grads_in_cpu", "fp32_partitioned_groups_flat",
)
"""The buffers in host memory under ``offload_optimizer`` (with the optimizer's states): ZeRO 1/2's (stage_1_and_2.py
with ``cpu_offload``) fp32 partition and its ``.grad``, the 16-bit partition staged for the copy back, the gradient
staging buffer, and the 16-bit gradients carried between micro-steps under accumulation; ZeRO 3's (stage3.py with
``offload_optimizer``) fp32 sub-group partitions and their ``.grad``. ZeRO 1/2's ``temp_grad_buffer_for_gpu_offload``
(its device-side staging buffer, the largest parameter in 16 bits) stays on the device, a gradient buffer."""


OFFLOADED_PARAM_ATTRIBUTES = ("param_groups_fp16_flat_cpu_memory",)
"""The buffers in host memory under ZeRO 3's ``offload_param`` (stage3.py
``_create_param_groups_fp16_flat_cpu_memory``): one flat 16-bit buffer per parameter group holding every parameter's
partition (``ds_tensor`` is a view of it)."""


def offloads_params(wrapper: Any) -> bool:
    """ZeRO 3 keeps its 16-bit partitions in host memory (``offload_param``; stage3.py ``self.offload_param``)."""
    return bool(getattr(wrapper, "offload_param", False))


def sub_groups_kept_on_device(wrapper: Any) -> list:
    """ZeRO 3's fp32 sub-group partitions a partial offload (``offload_optimizer.ratio`` below 1) keeps on the device
    (stage3.py ``subgroup_to_device``); empty at ZeRO 1/2 and for a whole offload."""
    where = getattr(wrapper, "subgroup_to_device", None) or {}
    return [t for i, t in enumerate(getattr(wrapper, "fp32_partitioned_groups_flat", None) or [])
            if where.get(i, "cpu") != "cpu"]


def offloads_optimizer(wrapper: Any) -> bool:
    """ZeRO keeps its fp32 partition, gradients and optimizer states in host memory (``offload_optimizer``;
    stage_1_and_2.py ``self.cpu_offload``, stage3.py ``self.offload_optimizer``)."""
    return bool(getattr(wrapper, "cpu_offload", False)) or bool(getattr(wrapper, "offload_optimizer", False))


def can_relink_hp_params(optimizer: Any) -> bool:
    """Whether `relink_hp_params` rebuilds anything for this optimizer."""
    return hasattr(optimizer, "_link_all_hp_params")


def gradient_reduction_dtype(optimizer: Any) -> Any:
    """The dtype ZeRO-1/2 reduces gradients in (stage_1_and_2.py L1253)."""
    return optimizer._gradient_reduction_buffer_dtype()


def relink_hp_params(optimizer: Any) -> None:
    """Rebuild DeepSpeed's per-parameter views of the fp32 partition and its optimizer states
    (``_link_all_hp_params``: stage_1_and_2.py L824, bf16_optimizer.py L336; ZeRO-3's of that name only
    tags parameters). Nothing for an optimizer without it."""
    relink = getattr(optimizer, "_link_all_hp_params", None)
    if relink is not None:
        relink()


def hp_mapping(param: Any) -> Any:
    """A 16-bit parameter's fragment of the fp32 partition under ZeRO-1/2 or the bf16 optimizer
    (mixed_precision_linkage.py L29), or ``None``."""
    return getattr(param, "_hp_mapping", None)


def settle_zero3_adagrad(engine: Any) -> bool:
    """Empty the param groups of a torch Adagrad that DeepSpeed's ZeRO-3 rebuilt over its fp32 partitions.

    ``initialize_optimizer_states`` (stage3.py L1358) builds a new Adagrad over the partitions (Adagrad makes
    its state in its constructor) and leaves them in its groups, where every other optimizer's groups are
    empty between steps (``_optimizer_step``, ``_clear_fp32_optimizer_param_groups``). Saving appends the
    partitions once more (``_rigid_state_dict``), so a fresh engine's group never matches a saved one and
    ``load_checkpoint`` fails ("loaded state dict contains a parameter group that doesn't match the size of
    optimizer's group"), plain DeepSpeed too. Emptied as a step leaves them, save and load agree.

    Returns:
        Whether there was such an optimizer to settle.
    """
    import torch

    optimizer = getattr(engine, "optimizer", None)
    inner = getattr(optimizer, "optimizer", None)
    if not (isinstance(inner, torch.optim.Adagrad) and hasattr(optimizer, "_clear_fp32_optimizer_param_groups")):
        return False
    if not any(group["params"] for group in inner.param_groups):
        return False
    optimizer._clear_fp32_optimizer_param_groups()
    return True


@contextlib.contextmanager
def zero3_param_groups(optimizer: Any) -> Iterator[None]:
    """ZeRO-3's flat fp32 partitions in the basic optimizer's param groups, as around its own step
    (stage3.py L3403 and L3409)."""
    optimizer._set_fp32_optimizer_param_groups()
    try:
        yield
    finally:
        optimizer._clear_fp32_optimizer_param_groups()


def around_zero3_update(optimizer: Any, before: Callable[[int], None], after: Callable[[int], None]) -> list[Any]:
    """ZeRO-3 updates one sub-group at a time (stage3.py L2873 ``step``): ``_prepare_sub_group(i, ...)``
    gives its fp32 partition a gradient (L2702, reading the partition's size), ``_optimizer_step(i)``
    steps it, ``_reassign_or_swap_out_partitioned_parameters(i)`` copies it into the 16-bit partition
    and ``_release_sub_group(i, ...)`` drops the gradient (L2731). ``before(i)`` runs before the first,
    ``after(i)`` after the last. Returns the handles (``remove()``)."""
    def prepare(original: Callable[..., Any], sub_group_id: int, *args: Any) -> Any:
        before(sub_group_id)
        return original(sub_group_id, *args)

    def release(original: Callable[..., Any], sub_group_id: int, *args: Any) -> Any:
        out = original(sub_group_id, *args)
        after(sub_group_id)
        return out

    return [wrap_method(optimizer, "_prepare_sub_group", prepare),
            wrap_method(optimizer, "_release_sub_group", release)]


ZERO3_WHOLE_MASTERS = ("load_state_dict", "_restore_from_bit16_weights",
                       "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
                       "load_module_checkpoint_state_from_checkpoint_dir_stage3")
"""ZeRO-3 optimizer methods that read or write every fp32 partition outside a step: the loaders and
``_restore_from_bit16_weights`` (stage3.py L3484, behind ``refresh_fp32_params`` and called by the
engine's ``load_checkpoint`` without optimizer states, engine.py L4467)."""


# gradients of the step, dropped as DeepSpeed drops them when it skips a step ----------------------------
_ZERO_1_2_STATE = ("averaged_gradients", "ipg_buckets", "params_already_reduced", "micro_step_id",
                   "reset_partition_gradient_structures", "_release_ipg_buffers",
                   "_release_preflattened_grad_buffers", "_backward_hook_state")
"""What `drop_step_gradients` resets in DeepSpeed's ZeRO-1/2 optimizer (checked at attach)."""


_ZERO_3_STATE = ("averaged_gradients", "ipg_buckets", "params_already_reduced", "fp16_groups",
                 "_backward_hook_state", "parameter_offload")
_ZERO_3_COORDINATOR = ("release_backward_leftovers", "release_and_reset_all", "is_invalid_trace", "_invalidate_trace")
"""What `drop_step_gradients` resets in DeepSpeed's ZeRO-3 optimizer and its parameter coordinator."""


def zero_state_missing(optimizer: Any) -> list[str]:
    """Names `drop_step_gradients` needs that this DeepSpeed ZeRO optimizer lacks (none for others)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        missing = [name for name in _ZERO_3_STATE if not hasattr(optimizer, name)]
        if not missing:
            coordinator = optimizer.parameter_offload.get_param_coordinator()
            missing = [f"coordinator.{name}" for name in _ZERO_3_COORDINATOR if not hasattr(coordinator, name)]
        return missing
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return [name for name in _ZERO_1_2_STATE if not hasattr(optimizer, name)]
    return []


def drop_step_gradients(engine: Any) -> None:
    """Forget every gradient of the step in progress, including an interrupted backward's partial
    reductions, so its micro-batches can run again from the first."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID, DeepSpeedZeroOptimizer

    get_accelerator().synchronize()  # reductions in flight on side streams finish first
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        _drop_zero3(engine, optimizer)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer):
        optimizer.zero_grad(set_to_none=True)
        optimizer._release_preflattened_grad_buffers()
        for group in list(optimizer.averaged_gradients):
            optimizer.averaged_gradients[group] = None
            if hasattr(optimizer, "all_grad_tensors"):
                optimizer.all_grad_tensors[group] = None
        for bucket in optimizer.ipg_buckets.values():
            bucket.clear()
        optimizer.params_already_reduced = [False] * len(optimizer.params_already_reduced)
        optimizer.reset_partition_gradient_structures()
        for pending in getattr(optimizer, "previous_reduced_grads", {}).values():
            pending.clear()
        if isinstance(getattr(optimizer, "extra_large_param_to_reduce", None), dict):
            optimizer.extra_large_param_to_reduce.clear()
        optimizer._release_ipg_buffers()
        optimizer.micro_step_id = INITIAL_MICRO_STEP_ID
        if getattr(optimizer, "cpu_offload", False):
            optimizer.reset_cpu_buffers()
            optimizer.accumulated_grads_in_cpu = {}
            optimizer._offload_accumulated_param_ids = set()
        state = optimizer._backward_hook_state
        state.backward_active_depth = 0
        state.reset_for_new_step()
    elif optimizer is not None and hasattr(optimizer, "zero_grad"):
        optimizer.zero_grad(set_to_none=True)  # BF16_Optimizer clears its fp32 gradients too
    engine.zero_grad()


def _drop_zero3(engine: Any, optimizer: Any) -> None:
    """ZeRO-3: release every gathered parameter, forget the interrupted pass's trace and module stack,
    and clear the gradient partitions' state (as its overflow path does, plus the ipg buckets)."""
    from deepspeed.runtime.zero import parameter_offload

    module = engine.module
    coordinator = optimizer.parameter_offload.get_param_coordinator()
    coordinator.release_backward_leftovers()
    coordinator.release_and_reset_all(module)
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()  # the failed pass recorded part of an order; record anew
    stack = parameter_offload.FWD_MODULE_STACK
    if module in stack:  # the interrupted forward's sub-modules are still pushed
        del stack[len(stack) - stack[::-1].index(module):]
    for sub in module.modules():
        if hasattr(sub, "ds_grads_remaining"):
            sub.ds_grads_remaining = 0
    for group in optimizer.fp16_groups:  # an interrupted backward leaves some; zero_grad's record_stream
        for param in group:              # would fail on them on CPU
            param.grad = None
    optimizer.zero_grad(set_to_none=True)
    optimizer.averaged_gradients = {}
    for bucket in optimizer.ipg_buckets.values():
        bucket.clear_params()
    for key in optimizer.params_already_reduced:
        optimizer.params_already_reduced[key] = False
    state = optimizer._backward_hook_state
    state.backward_active_depth = 0
    state.reset_for_new_step()



class _PassPreBackward:
    """A module's ZeRO-3 pre-backward marker that returns the tensors ``passes`` accepts as they are."""

    def __init__(self, marker: Any, passes: Callable[[Any], bool]):
        self.marker, self.passes = marker, passes

    def apply(self, value: Any) -> Any:
        return value if self.passes(value) else self.marker.apply(value)


def pass_pre_backward(model: Any, passes: Callable[[Any], bool]) -> Callable[[], None]:
    """At ZeRO-3 every tensor a module returns goes through the module's pre-backward marker
    (``module.pre_bwd_fn``, an autograd Function whose forward is ``outputs.detach()``, applied by the
    forward hook ``_pre_backward_module_hook``: parameter_offload.py l. 410-414 and 466-485 in 0.19.8);
    the tensors ``passes`` accepts are returned unmarked instead. Returns the undo."""
    changed = []
    for module in model.modules():
        marker = module.__dict__.get("pre_bwd_fn")
        if marker is not None and not isinstance(marker, _PassPreBackward):
            module.pre_bwd_fn = _PassPreBackward(marker, passes)
            changed.append((module, marker))

    def undo() -> None:
        for module, marker in changed:
            if isinstance(module.__dict__.get("pre_bwd_fn"), _PassPreBackward):
                module.pre_bwd_fn = marker
        changed.clear()

    return undo


__all__ = [
    "OFFLOADED_OPTIMIZER_ATTRIBUTES", "OFFLOADED_PARAM_ATTRIBUTES", "OPTIMIZER_ATTRIBUTES_BY_ROLE", "UPSTREAM_NAMES",
    "ZERO3_WHOLE_MASTERS", "accumulation_boundary", "around_zero3_update", "around_zero_file_names",
    "around_zero_save", "can_relink_hp_params", "drop_step_gradients", "gradient_reduction_dtype", "hp_mapping",
    "offloads_optimizer", "offloads_params", "pass_pre_backward", "protocol_holds", "redirect_zero_files",
    "relink_hp_params", "restore_accumulation_boundary", "restore_gradient_clipping", "shared_params",
    "step_protocol", "sub_groups_kept_on_device", "zero3_param_groups", "zero_param_shapes", "zero_state_missing"
]
