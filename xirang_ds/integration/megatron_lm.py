"""Megatron-LM core_v0.18, core_v0.19 and main: the block from ``pretrain_gpt.py`` through Megatron's own seams.

From core_v0.18 ``pretrain_gpt.py`` parses the arguments before ``pretrain`` with
``parse_and_validate_args(extra_args_provider=...)`` and hands ``pretrain`` a config container; from
core_v0.19 the model is built from ``cfg_container.model`` by its builder, whose ``pre_wrap_hooks`` run
on the model chunks before Float16Module and DDP/FSDP wrap them (megatron/training/models/dist_utils.py
``unimodal_build_distributed_models``, 0.19.2). ``patches/megatron-lm-core_v0.19.0.patch`` inserts one
call, `wrap_launch`, before the arguments are parsed; it returns both callables wrapped:

* ``parse_and_validate_args``: its ``extra_args_provider`` also adds ``--xirang-config`` (the script's
  own provider still runs first), so the flag is parsed and validated with Megatron's own.
* ``pretrain``: at core_v0.18 its ``model_provider`` becomes `megatron.ModelProvider` (as at 0.16); at
  0.19 and main `PreWrapHook` is appended to ``cfg_container.model.pre_wrap_hooks`` (or, when a caller
  passes a ``model_provider`` and no model config, that provider is wrapped instead).

Which of these applies is read from ``pretrain``'s parameters (`xirang_ds.compat.megatron.megatron_lm_launch`);
a shape it does not know stops with `MegatronVersionError` naming the version and the fix. The optimizer
is reached as at 0.16, by the ``prepare_optimizer`` call the patch inserts in ``training.py``.

Example (what the patch inserts in ``pretrain_gpt.py``, before ``args = parse_and_validate_args(``):
    >>> from xirang_ds.integration.megatron_lm import wrap_launch
    >>> pretrain, parse_and_validate_args = wrap_launch(pretrain, parse_and_validate_args)
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Optional

from xirang_ds.compat.megatron import (
    LAUNCHES,
    PATCH_FOR_LAUNCH,
    MegatronVersionError,
    megatron_lm_launch,
    megatron_version_text,
)
from xirang_ds.integration.megatron import (
    ArgsGetter,
    megatron_lm_args,
    build_session,
    extra_args_provider,
    prepare_model,
    wrap_model_provider,
)
from xirang_ds.session import Session

LAUNCHES_SERVED = ("config_and_provider", "config_builder")
"""The `LAUNCHES` `wrap_launch` serves (core_v0.18 and later)."""


def wrap_parse_args(parse_and_validate_args: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM's ``parse_and_validate_args`` with ``--xirang-config`` added to its ``extra_args_provider``.

    Raises:
        MegatronVersionError: it takes no ``extra_args_provider`` (named with the version found).
    """
    signature = inspect.signature(parse_and_validate_args)
    if "extra_args_provider" not in signature.parameters:
        raise MegatronVersionError(
            f"Megatron-LM's parse_and_validate_args({', '.join(signature.parameters)}) (megatron-core "
            f"{megatron_version_text()}) takes no extra_args_provider, through which xirang adds --xirang-config "
            "(core_v0.18.2 to main take it: megatron/training/arguments.py). Use a Megatron-LM whose "
            "parse_and_validate_args takes it, or build the session yourself (xirang_ds.integration.megatron."
            "build_session)")

    @functools.wraps(parse_and_validate_args)
    def parse(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["extra_args_provider"] = extra_args_provider(bound.arguments.get("extra_args_provider"))
        return parse_and_validate_args(*bound.args, **bound.kwargs)

    return parse


def _bucket_sizing(ddp_config: Any, chunks: list[Any]) -> Any:
    """A copy of ``ddp_config`` whose ``bucket_size`` is what Megatron will use for it before its
    default: ``num_buckets`` N stands for the chunks' parameters divided by N (dist_utils ``_ddp_wrap``)."""
    if getattr(ddp_config, "num_buckets", None):
        numel = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        return dataclasses.replace(ddp_config, bucket_size=numel // int(ddp_config.num_buckets))
    return dataclasses.replace(ddp_config)


class PreWrapHook:
    """A ``pre_wrap_hooks`` entry of Megatron-LM's model config (core_v0.19+): `prepare_model` on each chunk.

    Megatron's builder calls it with the list of model chunks it built, before Float16Module and
    DDP/FSDP wrap them. The first call builds the session from ``--xirang-config`` and lets the plugins
    size the ``DistributedDataParallelConfig`` the builder will wrap with (``cfg_container.ddp``); a
    changed ``bucket_size`` is written to it unless ``num_buckets`` decides the size (as
    `megatron.ModelProvider` does with ``args.ddp_bucket_size`` at 0.16-0.18). Chunks built after the
    optimizer is attached (MoE upcycling's dense copy) pass through untouched.

    Args:
        ddp_config: the ``DistributedDataParallelConfig`` the builder gets (``cfg_container.ddp``); None
            when the model is not wrapped with Megatron's DDP (then nothing is sized).
        get_args: returns Megatron-LM's parsed arguments (default ``megatron.training.get_args``).
    """

    def __init__(self, ddp_config: Any = None, get_args: Optional[ArgsGetter] = None):
        self.ddp_config = ddp_config
        self.get_args = get_args or megatron_lm_args
        self.session: Optional[Session] = None

    def __call__(self, chunks: list[Any]) -> list[Any]:
        path = getattr(self.get_args(), "xirang_config", None)
        if path is None or (self.session is not None and self.session.engine is not None):
            return chunks
        sized = None
        if self.session is None:
            self.session = build_session(path)
            if self.session is None:
                return chunks
            sized = _bucket_sizing(self.ddp_config, chunks) if self.ddp_config is not None else None
        for index, chunk in enumerate(chunks):
            prepare_model(self.session, chunk, sized if index == 0 else None)
        if (sized is not None and not getattr(self.ddp_config, "num_buckets", None)
                and sized.bucket_size != self.ddp_config.bucket_size):
            self.ddp_config.bucket_size = sized.bucket_size
        return chunks


def wrap_config_pretrain(pretrain: Callable[..., Any], get_args: Optional[ArgsGetter] = None) -> Callable[..., Any]:
    """Megatron-LM's ``pretrain`` (core_v0.18 and later) with the model reaching `prepare_model`.

    At core_v0.18 (``model_provider`` required) the provider is wrapped (`megatron.ModelProvider`); at
    0.19 and main a `PreWrapHook` joins ``cfg_container.model.pre_wrap_hooks`` when the container has a
    model config, else a given ``model_provider`` is wrapped. Without ``--xirang-config`` nothing is added.

    Raises:
        MegatronVersionError: ``pretrain`` is not one of `LAUNCHES_SERVED`, or at the call the container
            has no model config and no model provider is given.
    """
    launch = megatron_lm_launch(pretrain)
    if launch not in LAUNCHES_SERVED:
        raise MegatronVersionError(
            f"wrap_launch serves Megatron-LM core_v0.18 and later; this Megatron-LM (megatron-core "
            f"{megatron_version_text()}) is {LAUNCHES[launch]}. Fix: undo patches/megatron-lm-core_v0.19.0.patch "
            f"and apply {PATCH_FOR_LAUNCH[launch]} (xirang_ds.integration.megatron.wrap_pretrain)")
    signature = inspect.signature(pretrain)
    args_getter = get_args or megatron_lm_args

    @functools.wraps(pretrain)
    def run(*args: Any, **kwargs: Any) -> Any:
        if getattr(args_getter(), "xirang_config", None) is None:
            return pretrain(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        cfg = bound.arguments["cfg_container"]
        model_cfg = getattr(cfg, "model", None) if launch == "config_builder" else None
        if model_cfg is not None:
            if not isinstance(getattr(model_cfg, "pre_wrap_hooks", None), list):
                raise MegatronVersionError(
                    f"cfg_container.model ({type(model_cfg).__name__}, megatron-core {megatron_version_text()}) "
                    "has no pre_wrap_hooks list, where xirang prepares the model before DDP wraps it "
                    "(megatron/training/models/base.py, core_v0.19). Pass a model_provider instead of a model "
                    "config, or use a Megatron-LM whose model configs have pre_wrap_hooks")
            if not any(isinstance(hook, PreWrapHook) for hook in model_cfg.pre_wrap_hooks):
                model_cfg.pre_wrap_hooks.append(PreWrapHook(getattr(cfg, "ddp", None), get_args))
        elif bound.arguments.get("model_provider") is not None:
            bound.arguments["model_provider"] = wrap_model_provider(bound.arguments["model_provider"], get_args)
        else:
            raise MegatronVersionError(
                "--xirang-config is set but pretrain got neither a model config (cfg_container.model) nor a "
                "model_provider, so xirang cannot reach the model before DDP wraps it; build the container "
                "with pretrain_cfg_container_from_args(args, gpt_config_from_args(args)) as pretrain_gpt.py does")
        return pretrain(*bound.args, **bound.kwargs)

    return run


def wrap_launch(pretrain: Callable[..., Any], parse_and_validate_args: Callable[..., Any],
                get_args: Optional[ArgsGetter] = None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``pretrain`` and ``parse_and_validate_args`` of Megatron-LM core_v0.18+ with xirang; the patch's call.

    Args:
        pretrain: ``megatron.training.pretrain`` (possibly wrapped for in-process restart).
        parse_and_validate_args: ``megatron.training.arguments.parse_and_validate_args``.
        get_args: returns Megatron-LM's parsed arguments (default ``megatron.training.get_args``).

    Returns:
        ``(pretrain, parse_and_validate_args)``, wrapped (`wrap_config_pretrain`, `wrap_parse_args`).

    Raises:
        MegatronVersionError: this Megatron-LM is not core_v0.18 or later in a shape xirang knows; the
            message names the version found, what is supported and the patch to apply.
    """
    return wrap_config_pretrain(pretrain, get_args), wrap_parse_args(parse_and_validate_args)


__all__ = ["LAUNCHES_SERVED", "PreWrapHook", "wrap_config_pretrain", "wrap_launch", "wrap_parse_args"]
