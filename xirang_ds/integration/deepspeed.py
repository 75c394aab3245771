"""DeepSpeed integration: `initialize` (same arguments and 4-tuple as ``deepspeed.initialize``)
and `patch_deepspeed` for code that calls ``deepspeed.initialize`` itself (HF Trainer, Accelerate,
Lightning).

Without a ``"xirang"`` block the call is passed to DeepSpeed untouched. With one, the session
reads the block, lets each enabled plugin edit a private copy of the ds_config, attach to the
model and choose the basic optimizer, calls DeepSpeed, then attaches the plugins to the engine.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import deepspeed
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

from xirang_ds.compat.accelerate import protect_block, unprotect_block
from xirang_ds.compat.deepspeed import settle_zero3_adagrad
from xirang_ds.compat.torch import is_optimized_module, uncompiled
from xirang_ds.config.loader import BLOCK_KEY, read_ds_config
from xirang_ds.integration.process_groups import shut_down_at_exit
from xirang_ds.planning import estimator
from xirang_ds.planning.preset import resolve
from xirang_ds.registry import OptimizerSpec
from xirang_ds.session import Session

logger = logging.getLogger("xirang_ds")

_ORIGINAL_INITIALIZE = deepspeed.initialize


def _find_config(args: Any, config: Any, config_params: Any) -> tuple[Any, bool]:
    """The ds_config the way ``deepspeed.initialize`` finds it; True if it came from ``args``."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None and config is None:
        return from_args, True
    return config, False


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
):
    """``deepspeed.initialize`` with the ds_config's ``"xirang"`` block honoured.

    Takes exactly the arguments of ``deepspeed.initialize`` and returns the same 4-tuple
    ``(engine, optimizer, training_dataloader, lr_scheduler)``. The session is reachable as
    ``engine.xirang``.

    Raises:
        XirangConfigError: the block is invalid (every problem listed), before DeepSpeed runs.

    Example:
        >>> engine, optimizer, _, _ = xirang_ds.initialize(model=model, config="ds_config.json",
        ...                                                 model_parameters=model.parameters())
    """
    passthrough = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                       training_data=training_data, lr_scheduler=lr_scheduler,
                       distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
                       collate_fn=collate_fn, config=config, mesh_param=mesh_param,
                       config_params=config_params)
    found, from_args = _find_config(args, config, config_params)
    if found is None:
        return _ORIGINAL_INITIALIZE(**passthrough)
    ds_config = read_ds_config(found)
    if BLOCK_KEY not in ds_config:
        if isinstance(found, (str, os.PathLike)) and str(found).endswith((".yaml", ".yml")):
            passthrough.update(config=ds_config, config_params=None)
            return _call_with_dict(passthrough, from_args)
        return _ORIGINAL_INITIALIZE(**passthrough)

    # The basic optimizer: the client's, or the ds_config block as a spec a plugin may replace.
    client = optimizer
    if client is None and isinstance(ds_config.get("optimizer"), dict):
        block = ds_config["optimizer"]
        client = OptimizerSpec(type=str(block.get("type", "")), params=dict(block.get("params", {})))
    if model is None:
        resolve(ds_config, optimizer=client)  # the block's own problems first
        return _ORIGINAL_INITIALIZE(**passthrough)  # DeepSpeed's own error for a missing model
    resolved = resolve(ds_config, model=uncompiled(model), optimizer=client, world_size=_world_size(),
                       more_problems=_model_problems(model, ds_config))
    ds_config = resolved.ds_config
    session = Session(resolved.config, ds_config, left_out=resolved.left_out, estimator=estimator)
    session.preset_choice = resolved.choice
    session.model = uncompiled(model)  # a model compiled before initialize: plugins attach to its modules inside
    session.prepare_ds_config()
    session.start_calibration(session.model)  # the model's structure, before any plugin hooks it
    session.prepare_model(session.model)
    chosen = session.prepare_optimizer(client)
    if isinstance(chosen, OptimizerSpec):
        chosen = optimizer  # no plugin replaced it: DeepSpeed builds it from the block as usual
    passthrough.update(optimizer=chosen, config=session.ds_config, config_params=None)
    engine, opt, loader, sched = _call_with_dict(passthrough, from_args)
    shut_down_at_exit()
    settle_zero3_adagrad(engine)  # so that its checkpoints load (plain DeepSpeed's do not)
    session.attach(engine, checkpoints=True)
    if engine.global_rank == 0:
        logger.info(session.summary())
    return engine, opt, loader, sched


def _model_problems(model: Any, ds_config: dict) -> list[tuple[str, str]]:
    """What DeepSpeed cannot run with this model, said at ``initialize`` with the block's problems instead of
    a failure deep inside DeepSpeed at the first forward."""
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if is_optimized_module(model) and str(stage) == "3":
        return [("zero_optimization.stage", "3 with a model compiled before initialize (torch.compile(model)): "
                 "DeepSpeed's ZeRO-3 engine does not run a compiled wrapper (plain DeepSpeed fails at the "
                 "first forward: 'dict' object has no attribute '_in_forward'); pass the model uncompiled "
                 "and call engine.compile() after initialize, which ZeRO-3 runs with every preset")]
    return []


def _world_size() -> int:
    """Ranks of the run as the launcher states it (DeepSpeed's process group is not up yet)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _call_with_dict(kwargs: dict, from_args: bool):
    """Call DeepSpeed with ``kwargs['config']`` as a dict, even when the user passed
    ``args.deepspeed_config`` (DeepSpeed refuses both at once, so it is cleared for the call)."""
    args = kwargs.get("args")
    if from_args:
        saved = args.deepspeed_config
        args.deepspeed_config = None
        try:
            return _ORIGINAL_INITIALIZE(**kwargs)
        finally:
            args.deepspeed_config = saved
    return _ORIGINAL_INITIALIZE(**kwargs)


def _patched_initialize(*args: Any, **kwargs: Any):
    return initialize(*args, **kwargs)


_patched_initialize.__xirang__ = True  # type: ignore[attr-defined]
_patched_initialize.__wrapped__ = _ORIGINAL_INITIALIZE  # type: ignore[attr-defined]
_patched_initialize.__doc__ = initialize.__doc__


def patch_deepspeed() -> None:
    """Make plain ``deepspeed.initialize`` honour the ``"xirang"`` block.

    For training code you do not own (HF Trainer, Accelerate, Lightning), which calls
    ``deepspeed.initialize`` itself. Call it once before that code builds its engine; calling it
    again is harmless. Code that did ``from deepspeed import initialize`` before the patch keeps
    the original. `unpatch_deepspeed` undoes it.

    Accelerate (and HF Trainer through it) fills every ``"auto"`` string of the ds_config with its own
    values and stops at one it has none for; the patch makes it leave the block alone, so
    ``"preset": "auto"`` and every other ``"auto"`` of the block reach xirang as written.
    """
    protect_block(BLOCK_KEY)
    if getattr(deepspeed.initialize, "__xirang__", False):
        return
    deepspeed.initialize = _patched_initialize


def unpatch_deepspeed() -> None:
    """Restore the original ``deepspeed.initialize`` (and Accelerate's own ``"auto"`` filling)."""
    deepspeed.initialize = _ORIGINAL_INITIALIZE
    unprotect_block()


def is_patched() -> bool:
    return getattr(deepspeed.initialize, "__xirang__", False)
