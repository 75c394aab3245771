"""One pipeline from a ds_config's ``"xirang"`` block to the concrete block a run uses, for DeepSpeed and
Megatron-core alike.

`resolve` is the only place a preset becomes a concrete block: ``"auto"`` is decided for the model
(`xirang_ds.planning.auto`), a preset's sections that cannot run under the framework are left off
(Megatron), and the block is fitted to the ds_config and the optimizer (`xirang_ds.planning.fit`). The
config layer below only expands a named preset and validates; it knows no model, estimator or session.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from xirang_ds.config.loader import BLOCK_KEY, validate_block
from xirang_ds.config.presets import PRESETS
from xirang_ds.config.schema import XirangConfig
from xirang_ds.config.validate import XirangConfigError, describe_value
from xirang_ds.planning.auto import choose_for_spec, choose_preset
from xirang_ds.planning.fit import UNKNOWN, FittedBlock, LeftOut, fit_block
from xirang_ds.registry import built_sections, check_framework, plugin_class

logger = logging.getLogger("xirang_ds")

MEGATRON = "megatron"


@dataclass(frozen=True)
class ResolvedBlock:
    """A ds_config's block as the run uses it.

    Attributes:
        ds_config: the ds_config with its block concrete (``"auto"`` replaced by the preset taken).
        config: the validated, fitted block.
        left_out: what the preset had to leave out with this ds_config (DeepSpeed).
        choice: with ``"preset": "auto"``, which preset it took and why; else ``None``.
    """

    ds_config: dict
    config: XirangConfig
    left_out: tuple[LeftOut, ...] = ()
    choice: Optional[str] = None

    def lines(self) -> list[str]:
        """One line for each section (or key) the preset left out, for ``xirang-ds validate``."""
        return FittedBlock(self.config, self.left_out).lines()


def resolve(ds_config: dict, *, framework: str = "deepspeed", model: Any = None, spec: Any = None,
            optimizer: Any = UNKNOWN, world_size: int = 1, device: str = "cpu",
            more_problems: Sequence[tuple[str, str]] = ()) -> ResolvedBlock:
    """The ds_config's block made concrete, once: ``"auto"`` decided, fitted to the framework and ds_config.

    Args:
        ds_config: the ds_config as read (`xirang_ds.config.loader.read_ds_config`), with a block.
        framework: ``"deepspeed"`` (the block is fitted to this ds_config and ``optimizer``) or
            ``"megatron"`` (a preset's sections that do not run there are left off, keys that do nothing
            there are set to their inert value; the DeepSpeed keys beside the block do not apply).
        model: the model, for ``"preset": "auto"`` (only its parameters' sizes are read).
        spec: a ``--model`` spec instead of ``model`` (built on the meta device).
        optimizer: the optimizer ``initialize`` steps, where known (`xirang_ds.planning.fit.fit_block`).
        more_problems: problems found beside the block (the model's), reported with the block's.

    Raises:
        XirangConfigError: every problem of the block (and ``more_problems``).
    """
    choice = None
    if framework == MEGATRON:
        config = _megatron_config(ds_config[BLOCK_KEY])
        return ResolvedBlock(ds_config, config)
    if spec is not None:
        ds_config, choice = choose_for_spec(ds_config, spec, world_size, device)
    elif model is not None:
        block, choice = choose_preset(ds_config[BLOCK_KEY], ds_config, model, world_size=world_size, device=device)
        ds_config = {**ds_config, BLOCK_KEY: block}
    try:
        fitted = fit_block(ds_config[BLOCK_KEY], ds_config, optimizer)
    except XirangConfigError as e:
        raise XirangConfigError(list(e.problems) + list(more_problems)) from None
    if more_problems:
        raise XirangConfigError(list(more_problems))
    return ResolvedBlock(ds_config, fitted.config, fitted.left_out, choice)


def _megatron_config(block: Any) -> XirangConfig:
    """Validate a block for a Megatron run: what a preset turned on that does not run under Megatron
    yet (and the user did not write next to it) is left off, and said once; everything the user
    enabled by name must run here.

    Raises:
        XirangConfigError: the block is invalid, or a plugin the user enabled does not run here.
    """
    if isinstance(block, dict) and block.get("preset") in PRESETS:
        block = dict(block)
        left_off = []
        for name, section in PRESETS[block["preset"]].items():
            cls = plugin_class(name)
            if name not in block and isinstance(section, dict) and section.get("enabled") and cls is not None \
                    and MEGATRON not in (cls.preset_frameworks or cls.frameworks):
                block[name] = {"enabled": False}
                left_off.append(name)
        if left_off and process_rank() == 0:
            logger.info("xirang: preset %r under Megatron: %s are left off (not run under Megatron yet, or only "
                        "when named: docs/megatron.md)",
                        block["preset"], ", ".join(left_off))
    block, problems = _inert_keys_off(block)
    try:
        config = validate_block(block)
    except XirangConfigError as e:
        raise XirangConfigError(problems + list(e.problems)) from None
    problems += check_framework(config, MEGATRON)
    if problems:
        raise XirangConfigError(problems)
    return config


def _inert_keys_off(block: Any) -> tuple[Any, list[tuple[str, str]]]:
    """The block with each section's keys that do nothing under Megatron (`Plugin.inert_keys`) set to
    the value that asks for nothing, where the user did not write them; the problems of those the user
    wrote with another value (such a key would be accepted and ignored)."""
    if not isinstance(block, dict):
        return block, []
    block, problems = dict(block), []
    for cls in filter(None, map(plugin_class, sorted(built_sections()))):
        keys = cls.inert_keys.get(MEGATRON) or {}
        written = block.get(cls.section)
        if not keys or (written is not None and not isinstance(written, dict)):
            continue
        written = written or {}
        wrong = [(key, off, why) for key, (off, why) in keys.items() if key in written and written[key] != off]
        for key, off, why in wrong:
            fix = f"drop the key (or set it to {describe_value(off)})" if off is not None else "drop the key"
            problems.append((f"{BLOCK_KEY}.{cls.section}.{key}", f"{describe_value(written[key])} does nothing "
                             f"under Megatron: {why}. Fix: {fix} for Megatron runs"))
        if not wrong:  # else the section is checked as written, so its own checks do not follow from ours
            block[cls.section] = {**{k: off for k, (off, _) in keys.items() if off is not None}, **written}
    return block, problems


def process_rank() -> int:
    """This process's rank: the process group's once it is up, else ``RANK`` (0 without one)."""
    import torch.distributed as dist  # torch is heavy, and the config paths need it only here

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


__all__ = ["ResolvedBlock", "process_rank", "resolve"]
