"""The block against the run's ds_config: a preset adapts, a section the user wrote clashes.

A preset is a proposal: a plugin it turns on that cannot run with the user's ds_config (grad_release
at ZeRO-3, optimizer_states under optimizer offload, ...), or that would save nothing there
(`FitsDsConfig.preset_leave_out`: grad_release in fp32 accumulating at ZeRO-0), is left out, with one line
saying why, in the session summary and in ``xirang-ds validate --show-resolved``. A section the user
wrote in the block (any key of it) is a request: if it cannot run there, that is an error, and
every such problem is reported at once. Each plugin says what it cannot run with through
`FitsDsConfig.check_ds_config`, read on the user's ds_config before any plugin edits it. A key a preset set
that this ds_config cannot take (grad_release's ``masters: none`` without bf16) falls back to the value a plugin's
`FitsDsConfig.preset_fallbacks` names, with its line, unless the user wrote that key. A key of a section
left out is handed to the section that does the same job in this configuration (a `HandOver` its plugin
registered), where that section runs, the user did not write the key and the section's check takes the
value; a section left out whose job another section can do where the preset does not turn that one on
hands the job over (a registered `TakeOver`: grad_release's exact masters, kept by optimizer_states at
ZeRO-3), where that section can run and pays.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from xirang_ds.config.loader import deep_merge, validate_block
from xirang_ds.config.schema import XirangConfig
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.contributions import hand_overs, take_over
from xirang_ds.registry import plugin_for
from xirang_ds.roles import FitsDsConfig

UNKNOWN = object()
"""`fit_block`'s optimizer where the ds_config is all that is known (``xirang-ds validate``)."""


@dataclass(frozen=True)
class LeftOut:
    """A section a preset turned on and the run leaves out.

    Attributes:
        section: the section's key (``"grad_release"``).
        reason: why it cannot run with this ds_config, in the plugin's words.
    """

    section: str
    reason: str

    def line(self, preset: Optional[str]) -> str:
        return f"{self.section}: left out of preset {preset!r}: {self.reason}"


@dataclass(frozen=True)
class FittedBlock:
    """The validated block as this run uses it, and what its preset had to leave out."""

    config: XirangConfig
    left_out: tuple[LeftOut, ...] = ()

    def lines(self) -> list[str]:
        return [item.line(self.config.preset) for item in self.left_out]


def _reason(section: str, message: str) -> str:
    """A plugin's problem message without its fix (the user did not write the section) and without
    the section's name (the line starts with it)."""
    message = message.split(" Fix: ")[0].rstrip(".")
    prefix = f"xirang.{section} "
    return message[len(prefix):] if message.startswith(prefix) else message


def fit_block(block: Any, ds_config: dict, optimizer: Any = UNKNOWN) -> FittedBlock:
    """Validate ``block`` and fit it to ``ds_config`` (the user's, before any plugin edits it) and, where
    known, to the ``optimizer`` ``initialize`` steps (`FitsDsConfig.check_optimizer`).

    Raises:
        XirangConfigError: the block is invalid, or a section the user wrote cannot run with this
            ds_config (every problem at once, each naming the key, the value, what is allowed and
            the fix).
    """
    config = validate_block(block)
    explicit = {key for key in block if key != "preset"} if config.preset is not None else set(block)
    fallbacks: list[LeftOut] = []
    if config.preset is not None:
        block, fallbacks = _fall_back(block, config, ds_config)
        config = validate_block(block)
    problems: list[tuple[str, str]] = []
    left_out: list[LeftOut] = []
    for name, section in config.enabled_sections().items():
        cls = plugin_for(section)
        found = _problems(cls, section, ds_config, optimizer)
        if not found:
            unpaid = _unpaid(cls, section, ds_config) if name not in explicit else None
            if unpaid:
                left_out.append(LeftOut(name, unpaid))
            continue
        if name in explicit:
            problems.extend(found)
        else:
            left_out.append(LeftOut(name, "; ".join(_reason(name, message) for _, message in found)))
    if problems:
        raise XirangConfigError(problems)
    if left_out:
        block = {**block, **{item.section: {"enabled": False} for item in left_out}}
        block, left_out = _take_over(block, config, left_out, ds_config, optimizer)
        block = _hand_over(block, config, {item.section for item in left_out}, ds_config)
        config = validate_block(block)
    dropped = {item.section for item in left_out}
    kept = [item for item in fallbacks if item.section.split(".")[0] not in dropped]
    return FittedBlock(config, tuple(kept + left_out))


def _problems(cls: Any, section: Any, ds_config: dict, optimizer: Any) -> list[tuple[str, str]]:
    """The plugin's problems with the ds_config and the optimizer (none for a section with no plugin)."""
    if cls is None or not issubclass(cls, FitsDsConfig):
        return []
    return cls.check_ds_config(section, ds_config) + ([] if optimizer is UNKNOWN else
                                                      cls.check_optimizer(section, optimizer))


def _unpaid(cls: Any, section: Any, ds_config: dict) -> Optional[str]:
    """Why a preset leaves the plugin out although it can run (`FitsDsConfig.preset_leave_out`), or ``None``."""
    return cls.preset_leave_out(section, ds_config) if cls is not None and issubclass(cls, FitsDsConfig) else None


def _take_over(block: dict, config: XirangConfig, left_out: list[LeftOut], ds_config: dict,
               optimizer: Any) -> tuple[dict, list[LeftOut]]:
    """``block`` with the registered `TakeOver` sections turned on for the left-out sections whose job they
    do, and the left-out lines saying so."""
    out = []
    for item in left_out:
        entry = take_over(item.section)
        target, keys, job = (entry.target, entry.keys, entry.job) if entry else (None, None, None)
        if target is None or target in block or getattr(config, target).enabled:
            out.append(item)  # nothing takes the job over, or the user wrote that section, or it runs already
            continue
        candidate = deep_merge(block, {target: {"enabled": True, **keys}})
        section = getattr(validate_block(candidate), target)
        cls = plugin_for(section)
        if _problems(cls, section, ds_config, optimizer) or _unpaid(cls, section, ds_config):
            out.append(item)
            continue
        block = candidate
        out.append(replace(item, reason=f"{item.reason}; {target} {job}"))
    return block, out


def _hand_over(block: dict, config: XirangConfig, left: set[str], ds_config: dict) -> dict:
    """``block`` with the registered `HandOver` keys of the left-out sections given to the sections that take
    them."""
    for source, key, target, target_key in ((h.source, h.key, h.target, h.target_key) for h in hand_overs()):
        section = getattr(config, target, None)
        written = block.get(target) if isinstance(block.get(target), dict) else {}
        if source not in left or section is None or not section.enabled or target_key in written:
            continue
        value = getattr(getattr(config, source), key)
        if value == getattr(type(section)(), target_key):
            continue  # the default: nothing to hand over
        taken = replace(section, **{target_key: value})
        if not _problems(plugin_for(taken), taken, ds_config, UNKNOWN):
            block = deep_merge(block, {target: {target_key: value}})
    return block


def _fall_back(block: dict, config: XirangConfig, ds_config: dict) -> tuple[dict, list[LeftOut]]:
    """The preset's keys this ds_config cannot take, replaced (the user's own keys stay as written)."""
    over: dict[str, dict] = {}
    lines: list[LeftOut] = []
    for name, section in config.enabled_sections().items():
        cls = plugin_for(section)
        written = block.get(name) if isinstance(block.get(name), dict) else {}
        fits = cls is not None and issubclass(cls, FitsDsConfig)
        for key, value, reason in (cls.preset_fallbacks(section, ds_config) if fits else []):
            if key not in written:
                over.setdefault(name, {})[key] = value
                lines.append(LeftOut(f"{name}.{key}", reason))
    return (deep_merge(block, over) if over else block), lines


__all__ = ["FittedBlock", "LeftOut", "fit_block"]
