"""Megatron-core integration: the ``"xirang"`` block for Megatron-LM and megatron-core training loops.

Megatron builds a run in three moments, and the integration has one call for each:

1. **Arguments.** `add_arguments` (Megatron's ``extra_args_provider``) adds ``--xirang-config PATH``:
   a ds_config-style JSON/YAML with a ``"xirang"`` block, for example the very file a DeepSpeed run
   uses (only the block is read). The file is validated while arguments are parsed, so a bad block
   stops the run with argparse's message naming the flag.
2. **Model.** `prepare_model` runs after the model provider built a chunk and before Megatron's DDP
   wraps it: it refuses Megatron settings that clash with the block (`megatron_conflicts`), lets the
   plugins size ``DistributedDataParallelConfig`` (``bucket_size``) and hook the model.
3. **Optimizer.** `attach` runs once Megatron's optimizer exists: optimizer-side plugins see it
   (``prepare_optimizer``), then every plugin attaches to a `MegatronRun` (the chunks, the optimizer,
   the step count) the way it attaches to a DeepSpeed engine.

Megatron-LM's ``pretrain_gpt.py`` reaches 1 and 2 through `wrap_pretrain` (core_v0.16-0.17) or
``megatron_lm.wrap_launch`` (core_v0.18, 0.19 and main), and 3 through `prepare_optimizer` (the calls
``patches/`` inserts). A megatron-core loop calls `build_session`,
`prepare_model` and `attach` itself (``examples/megatron_gpt.py``).

megatron is imported inside the functions only: ``import xirang_ds`` stays light.

Example:
    >>> session = build_session("ds_config.json")           # None without a "xirang" block
    >>> ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True)
    >>> prepare_model(session, gpt, ddp_config)              # before DDP wraps the model
    >>> model = DistributedDataParallel(gpt.config, ddp_config, gpt)
    >>> optimizer = attach(session, [model], get_megatron_optimizer(opt_config, [model]))
"""
from __future__ import annotations

import argparse
import functools
import inspect
import logging
import os
from typing import Any, Callable, Optional, Sequence, Union

from xirang_ds.compat.megatron import (
    LAUNCHES,
    PATCH_FOR_LAUNCH,
    MegatronVersionError,
    check_version,
    is_megatron_optimizer,
    megatron_lm_launch,
    megatron_version_text,
    num_microbatches,
    unwrap,
)
from xirang_ds.config.loader import BLOCK_KEY, DsConfig, read_ds_config
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import CallbackHandle
from xirang_ds.integration.megatron_conflicts import check_args, check_model, check_optimizer
from xirang_ds.integration.megatron_run import MegatronRun, watch_run
from xirang_ds.planning import estimator
from xirang_ds.planning.preset import process_rank, resolve
from xirang_ds.session import Session

logger = logging.getLogger("xirang_ds")

FLAG = "--xirang-config"
"""The Megatron-LM flag; its value lands in ``args.xirang_config``."""
FRAMEWORK = "megatron"
ArgsGetter = Callable[[], argparse.Namespace]


def validate_for_megatron(block: Any) -> Any:
    """The block validated for a Megatron run (`xirang_ds.planning.preset.resolve` with ``framework="megatron"``).

    Raises:
        XirangConfigError: the block is invalid, or a plugin the user enabled does not run here.
    """
    return resolve({BLOCK_KEY: block}, framework=FRAMEWORK).config


# 1. arguments ------------------------------------------------------------------------------------
def _config_file(path: str) -> str:
    """argparse ``type=`` of `FLAG`: the path, once its block validates (else argparse's error)."""
    try:
        data = read_ds_config(path)
        if BLOCK_KEY not in data:
            raise XirangConfigError([("", f"{path} has no \"{BLOCK_KEY}\" block; add one (for example "
                                          f"{{\"{BLOCK_KEY}\": {{\"preset\": \"balanced\"}}}}) or drop {FLAG}")])
        resolve(data, framework=FRAMEWORK)
    except XirangConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--xirang-config PATH`` to Megatron-LM's parser (an ``extra_args_provider``).

    Args:
        parser: Megatron-LM's argument parser.

    Returns:
        The same parser (Megatron's providers return it).
    """
    group = parser.add_argument_group("xirang_ds", "device-memory plugins (docs/megatron.md)")
    group.add_argument(FLAG, type=_config_file, default=None, metavar="PATH",
                       help="ds_config-style JSON/YAML whose \"xirang\" block turns plugins on; the same file a "
                            "DeepSpeed run uses works (only the block is read)")
    return parser


def extra_args_provider(inner: Optional[Callable[[Any], Any]] = None) -> Callable[[Any], Any]:
    """An ``extra_args_provider`` that runs ``inner`` (the script's own, may be None), then `add_arguments`."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if inner is not None:
            parser = inner(parser)
        return add_arguments(parser)

    return provider


# the session ---------------------------------------------------------------------------------------
def build_session(config: Union[DsConfig, None], world_size: Optional[int] = None) -> Optional[Session]:
    """Read and validate the block and build the session's plugins for a Megatron run.

    Args:
        config: path (JSON/YAML) or dict of a ds_config-style file; ``None`` means no xirang.
        world_size: ranks of the run (default: ``WORLD_SIZE``).

    Returns:
        The session, or ``None`` when ``config`` is None or has no ``"xirang"`` block.

    Raises:
        XirangConfigError: the block is invalid, or an enabled plugin does not run under Megatron.
    """
    if config is None:
        return None
    data = read_ds_config(config)
    if BLOCK_KEY not in data:
        return None
    xcfg = resolve(data, framework=FRAMEWORK).config

    check_version()
    others = sorted(k for k in data if k != BLOCK_KEY)
    if others and process_rank() == 0:
        logger.info("Megatron run: reading the \"%s\" block only; the DeepSpeed keys next to it (%s) do not "
                    "apply (Megatron's own flags set those)", BLOCK_KEY, ", ".join(others))
    return Session(xcfg, data, world_size, framework=FRAMEWORK, estimator=estimator)


def session_of(model: Union[Any, Sequence[Any]]) -> Optional[Session]:
    """The session `prepare_model` attached to a model (or to any chunk of a list), else ``None``."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        session = getattr(unwrap(chunk), "xirang", None)
        if isinstance(session, Session):
            return session
    return None


# 2. model ------------------------------------------------------------------------------------------
def prepare_model(session: Session, model: Any, ddp_config: Any = None) -> None:
    """Check the model's Megatron settings against the block, let plugins size DDP and hook the model.

    Call it on each model chunk after the model provider built it and before Megatron's DDP (or
    ``Float16Module``) wraps it.

    Args:
        session: from `build_session`.
        model: the chunk (``GPTModel``); it gets ``model.xirang = session`` until ``session.remove()``.
        ddp_config: the ``DistributedDataParallelConfig`` DDP will get; plugins may edit it
            (``comm_buffers`` sets ``bucket_size``). Pass it for the first chunk only.

    Raises:
        XirangConfigError: a Megatron setting clashes with the block (both named), or a plugin
            refuses the DDP config.
    """
    problems = check_model(session.config, model)
    if problems:
        raise XirangConfigError(problems)
    session.prepare_model(model)
    if ddp_config is not None:
        session.prepare_ddp_config(ddp_config)
    model.xirang = session
    session.keep(CallbackHandle(lambda: vars(model).pop("xirang", None)))


# 3. optimizer --------------------------------------------------------------------------------------
def attach(session: Session, model: Union[Any, Sequence[Any]], optimizer: Any, *,
           micro_batch_size: Optional[int] = None, num_microbatches: Optional[int] = None) -> Any:
    """Hand Megatron's optimizer to the optimizer-side plugins, then attach every plugin.

    Args:
        session: the session `prepare_model` used.
        model: the DDP-wrapped chunk or the list of chunks training runs.
        optimizer: Megatron's optimizer (``megatron.core.optimizer.get_megatron_optimizer``).
        micro_batch_size, num_microbatches: for reports (the profiler's metadata).

    Returns:
        The optimizer training should use (a plugin may replace it).

    Raises:
        TypeError: ``optimizer`` is not a Megatron optimizer.
        XirangConfigError: Megatron's optimizer settings clash with the block (both named).
    """
    if not is_megatron_optimizer(optimizer):
        raise TypeError(f"xirang's Megatron integration attaches to Megatron's optimizer "
                        f"(megatron.core.optimizer.get_megatron_optimizer); got {type(optimizer).__name__}. "
                        "Build it with get_megatron_optimizer, or train with DeepSpeed and xirang_ds.initialize")
    problems = check_optimizer(session.config, optimizer)
    if problems:
        raise XirangConfigError(problems)
    optimizer = session.prepare_optimizer(optimizer)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    run = session.keep(MegatronRun(chunks, optimizer, micro_batch_size, num_microbatches))
    session.attach(run, watch=watch_run)
    if run.global_rank == 0:
        logger.info(session.summary())
    return optimizer


# Megatron-LM glue (the calls patches/ inserts) ---------------------------------------------------
def megatron_lm_args() -> argparse.Namespace:
    """Megatron-LM's parsed arguments (``megatron.training.get_args``)."""
    from megatron.training import get_args

    return get_args()


def ddp_config_from_args(args: argparse.Namespace, model: Any) -> Any:
    """The bucket-related part of the ``DistributedDataParallelConfig`` Megatron-LM's ``get_model``
    builds from ``args`` (training.py, core_v0.16.1 L1290-1322): ``--ddp-num-buckets`` N stands for
    a bucket of the model's parameters divided by N."""
    from megatron.core.distributed import DistributedDataParallelConfig

    bucket_size = getattr(args, "ddp_bucket_size", None)
    if getattr(args, "ddp_num_buckets", None):
        bucket_size = sum(p.numel() for p in model.parameters()) // int(args.ddp_num_buckets)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False)),
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
        use_distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        bucket_size=bucket_size)


class ModelProvider:
    """Megatron-LM model provider with xirang: builds the chunk, then `prepare_model` on it.

    The first chunk also sizes DDP: the plugins edit a ``DistributedDataParallelConfig`` made from
    ``args`` and a changed ``bucket_size`` is written back to ``args.ddp_bucket_size``, which
    Megatron-LM's ``get_model`` reads after the provider returns. Chunks built after the optimizer
    is attached (MoE upcycling's dense copy) pass through untouched.

    Args:
        provider: Megatron-LM's model provider.
        get_args: returns Megatron-LM's parsed arguments (default ``megatron.training.get_args``).
    """

    def __init__(self, provider: Callable[..., Any], get_args: Optional[ArgsGetter] = None):
        functools.update_wrapper(self, provider)
        self.provider = provider
        self.get_args = get_args or megatron_lm_args
        self.session: Optional[Session] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.provider(*args, **kwargs)
        margs = self.get_args()
        path = getattr(margs, "xirang_config", None)
        if path is None or (self.session is not None and self.session.engine is not None):
            return model
        ddp_config = None
        if self.session is None:
            self.session = build_session(path)
            if self.session is None:
                return model
            ddp_config = ddp_config_from_args(margs, model)
        prepare_model(self.session, model, ddp_config)
        if (ddp_config is not None and not getattr(margs, "ddp_num_buckets", None)
                and ddp_config.bucket_size != getattr(margs, "ddp_bucket_size", None)):
            margs.ddp_bucket_size = ddp_config.bucket_size
        return model


def wrap_model_provider(provider: Callable[..., Any], get_args: Optional[ArgsGetter] = None) -> ModelProvider:
    """Megatron-LM's model provider with xirang (see `ModelProvider`)."""
    return ModelProvider(provider, get_args)


def prepare_optimizer(optimizer: Any, model: Sequence[Any], get_args: Optional[ArgsGetter] = None) -> Any:
    """Megatron-LM's optimizer hook: `attach` the session `prepare_model` left on ``model``.

    Inserted by the patch into ``setup_model_and_optimizer`` right after the optimizer is built
    (before the LR scheduler and checkpoint loading). Without ``--xirang-config`` it returns
    ``optimizer`` untouched.

    Args:
        optimizer: what ``get_megatron_optimizer`` returned.
        model: the list of DDP-wrapped chunks.
        get_args: returns Megatron-LM's parsed arguments (default ``megatron.training.get_args``).

    Returns:
        The optimizer Megatron-LM should use from here on.

    Raises:
        XirangConfigError: a Megatron-LM argument clashes with the block (`megatron_conflicts.check_args`).
    """
    session = session_of(model)
    if session is None or optimizer is None:
        return optimizer
    margs = (get_args or megatron_lm_args)()

    problems = check_args(session.config, margs)
    if problems:
        raise XirangConfigError(problems)

    return attach(session, model, optimizer, micro_batch_size=getattr(margs, "micro_batch_size", None),
                  num_microbatches=num_microbatches())


def wrap_pretrain(pretrain: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM's ``pretrain`` with ``--xirang-config`` added to its arguments and its model
    provider wrapped (`ModelProvider`); the call ``patches/megatron-lm-core_v0.16.1.patch`` inserts in
    ``pretrain_gpt.py`` (Megatron-LM core_v0.16 and 0.17, whose ``pretrain`` parses the arguments).

    Raises:
        MegatronVersionError: this ``pretrain`` has another shape (core_v0.18 and later parse the
            arguments before ``pretrain``: ``megatron_lm.wrap_launch`` and its patch serve those); the
            message names the version found, the supported ones and the patch to apply.
    """
    launch = megatron_lm_launch(pretrain)
    if launch != "providers":
        raise MegatronVersionError(
            f"wrap_pretrain serves Megatron-LM core_v0.16-0.17 ({LAUNCHES['providers']}); this Megatron-LM "
            f"(megatron-core {megatron_version_text()}) is {LAUNCHES[launch]}. Fix: undo "
            f"patches/megatron-lm-core_v0.16.1.patch (git checkout pretrain_gpt.py megatron/training/training.py) "
            f"and apply {PATCH_FOR_LAUNCH[launch]}, which calls xirang_ds.integration.megatron_lm.wrap_launch")
    signature = inspect.signature(pretrain)  # follows __wrapped__ through functools.wraps wrappers

    @functools.wraps(pretrain)
    def run(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["extra_args_provider"] = extra_args_provider(bound.arguments.get("extra_args_provider"))
        bound.arguments["model_provider"] = wrap_model_provider(bound.arguments["model_provider"])
        return pretrain(*bound.args, **bound.kwargs)

    return run


__all__ = ["FLAG", "ModelProvider", "add_arguments", "attach", "build_session", "ddp_config_from_args",
           "extra_args_provider", "megatron_lm_args", "prepare_model", "prepare_optimizer", "session_of",
           "wrap_model_provider", "wrap_pretrain"]
