"""What plugins contribute to the core's tables beyond their class: the fit planner's hand-overs and take-overs,
and who holds the optimizer state in a checkpoint.

A plugin's module registers its entries at import, for its own section (`register_fit`,
`register_checkpoint`); the core asks here (`hand_overs`, `take_over`, `state_files`, `state_codes`) and
names no plugin. The built-in plugins are loaded first
(`xirang_ds.config.sections.load_builtins`), so an entry is there before anyone asks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from xirang_ds.config.sections import load_builtins


@dataclass(frozen=True)
class HandOver:
    """A key of a section a preset leaves out, handed to the section that does the same job there
    (`xirang_ds.planning.fit`): grad_release's ``masters: none`` becomes optimizer_states' at ZeRO-3."""

    source: str
    key: str
    target: str
    target_key: str


@dataclass(frozen=True)
class TakeOver:
    """A section that takes over the job of a section a preset leaves out, where the preset does not turn it
    on itself (`xirang_ds.planning.fit`): ``keys`` are what it is turned on with, ``job`` what it then does."""

    source: str
    target: str
    keys: dict
    job: str


_HAND_OVERS: list[HandOver] = []
_TAKE_OVERS: dict[str, TakeOver] = {}


def register_fit(entry: Any) -> None:
    """Register a `HandOver` or a `TakeOver` (a plugin's module does, at import, for its own section)."""
    if isinstance(entry, TakeOver):
        _TAKE_OVERS[entry.source] = entry
    elif entry not in _HAND_OVERS:
        _HAND_OVERS.append(entry)


def hand_overs() -> tuple[HandOver, ...]:
    """Every registered `HandOver`."""
    load_builtins()
    return tuple(_HAND_OVERS)


def take_over(section: str) -> Optional[TakeOver]:
    """The `TakeOver` of ``section`` when a preset leaves it out, or ``None``."""
    load_builtins()
    return _TAKE_OVERS.get(section)


@dataclass(frozen=True)
class StateFiles:
    """A plugin that keeps the optimizer state in files of its own in a checkpoint tag, one per rank, instead
    of DeepSpeed's (grad_release's shards); the tag's readers ask it (`xirang_ds.checkpoints.tags`)."""

    section: str
    folder: str
    """Its folder in a tag; a tag with it and no marker was written by it before markers existed."""
    read_states: Callable[[str, Optional[list]], Any]
    """``(tag_dir, optimizer_groups) -> ParamStates``: the tag's optimizer state per parameter."""
    basic_groups: Callable[[dict], Optional[list]]
    """The basic optimizer's param groups that a model-states file of its run records."""
    layout: Callable[[str], tuple[int, int]]
    """``tag_dir -> (ZeRO stage, data-parallel ranks)`` of the run that wrote the tag."""
    holder: str
    """What holds the state, as ``xirang-ds checkpoint show`` says it."""
    tools: str
    """What plain DeepSpeed's tools can do with its tags, as the same says it."""


@dataclass(frozen=True)
class StateCodes:
    """A plugin whose optimizer keeps its states as codes inside DeepSpeed's own ZeRO files (optimizer_states'
    `DynamicAdamW`): `xirang_ds.checkpoints.codes` writes them beside plain files, and the readers decode
    them (`xirang_ds.checkpoints.deepspeed_files`)."""

    section: str
    marker: str
    """The key of the tag's marker that names `folder` when the codes sit there, beside plain files."""
    folder: str
    """The tag's folder of the codes, one DeepSpeed ZeRO file per rank."""
    codes: str
    """What they are, as ``xirang-ds checkpoint show`` says it."""
    is_coded: Callable[[dict], bool]
    """Whether a saved per-parameter state is in its format."""
    moment_range: Callable[[dict, str, int, int], Any]
    """``(state, moment, start, end)``: elements ``[start, end)`` of a coded state's moment as fp32."""
    torch_layout: Callable[[dict, int], dict]
    """``(state, numel)``: a coded state of ``numel`` elements in ``torch.optim`` layout."""


_CHECKPOINT: dict[type, Any] = {}


def register_checkpoint(entry: Any) -> None:
    """Register a `StateFiles` or a `StateCodes` (at most one of each; a plugin's module does, at import)."""
    known = _CHECKPOINT.get(type(entry))
    if known is not None and known.section != entry.section:
        raise ValueError(f"{type(entry).__name__} is already registered by {known.section!r}")
    _CHECKPOINT[type(entry)] = entry


def state_files() -> Optional[StateFiles]:
    """The registered `StateFiles`, or ``None``."""
    load_builtins()
    return _CHECKPOINT.get(StateFiles)


def state_codes() -> Optional[StateCodes]:
    """The registered `StateCodes`, or ``None``."""
    load_builtins()
    return _CHECKPOINT.get(StateCodes)


__all__ = ["HandOver", "StateCodes", "StateFiles", "TakeOver", "hand_overs", "register_checkpoint", "register_fit",
           "state_codes", "state_files", "take_over"]
