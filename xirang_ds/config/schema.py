"""The typed schema of the ``"xirang"`` block: the top-level keys, and the block built from the sections.

Each plugin keeps its section beside it (``plugins/<section>/config.py``, one frozen dataclass with a
docstring under every field) and registers it with the plugin (`xirang_ds.registry.register_plugin`); the
block's concrete type is built from `XirangConfig` and the registered sections
(`xirang_ds.config.sections.block_type`), in the order the block documents them. docs/config.md's config reference
is generated from the docstrings (`xirang_ds.config.reference`). Sections are off by default: a block that
only says ``{"preset": "balanced"}`` turns on what the preset lists.

Cross-field rules live in each section's ``check()``, which returns ``[(field, message)]`` so the
validator can report them together with type and range problems; rules across sections are
`xirang_ds.config.rules`. The ``autotune`` section is the core's own: the tuner (`xirang_ds.tune`) is a
command, not a plugin.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

from xirang_ds.config.rules import check
from xirang_ds.config.section import Issues, Section
from xirang_ds.config.types import AutoBytes, PositiveInt, Range


@dataclass(frozen=True)
class AutotuneConfig(Section):
    """Search the block's options under the memory budget and write the winning ds_config."""

    objective: Literal["fastest", "largest_micro_batch"] = "fastest"
    """What to optimise under the budget."""
    time_limit_s: Annotated[float, Range(0.0, low_exclusive=True)] = 600.0
    """Wall-clock limit of the search."""
    measure_top: PositiveInt = 3
    """How many best candidates of the cost model are measured for real."""
    output: str = "ds_config.tuned.json"
    """Where the winning ds_config is written."""


# --------------------------------------------------------------------------------------------
# the block
# --------------------------------------------------------------------------------------------

PresetName = Literal["conservative", "balanced", "aggressive"]


@dataclass(frozen=True)
class XirangConfig:
    """The whole ``"xirang"`` block of a ds_config: the top-level keys here, and one field per section in
    the type built from this one and the registered sections (`xirang_ds.config.sections.block_type`), which `load_config`
    returns."""

    preset: Optional[PresetName] = None
    """Start from a preset; keys written next to it override the preset's key by key. ``"auto"``
    takes the least aggressive preset whose estimated model states fit ``memory_budget``, among those
    the block's ``"sensitivity"`` allows (``lossless``: conservative; ``normal``, the default: up to
    balanced; ``tolerant``: up to aggressive), and says which in the session summary."""
    memory_budget: AutoBytes = "auto"
    """Per-rank device memory the run may use; ``auto`` = the device's capacity."""
    host_memory_budget: AutoBytes = "auto"
    """Per-rank host bytes every host tier may hold together: activation offload's buffers, grad_release's
    host states and stash, and arena evictions, counted as the host holds them (pinned on accelerators:
    power-of-two blocks that stay pinned after they are dropped; `xirang_ds.memory.host_ledger`). A saved
    tensor that would not fit stays on the device (counted in the activations figures); grad_release's host
    states and stash are estimated before the run, and a block whose estimate exceeds the budget is refused
    at initialize; an arena eviction over it is counted and says once that it went over. ``auto`` = no cap:
    offload's buffers are reused by size class and its cache never holds more than the most in use at once."""
    deepspeed_files: bool = True
    """Every checkpoint of a run whose grad_release (ZeRO 0-2) or optimizer_states (inside DeepSpeed's ZeRO
    1-3 optimizer) holds the optimizer state also gets plain DeepSpeed's files: at ZeRO 1-3 its ZeRO
    files (fp32 masters and Adam moments in DeepSpeed's layout, ``param_shapes``, ``zero_to_fp32.py``),
    each rank writing its own partition; at stage 0 (grad_release) the model-states file's optimizer
    entry of DeepSpeed's stage-0 optimizer; all before DeepSpeed writes ``latest``. Plain DeepSpeed,
    ``zero_to_fp32.py`` and ``ds_to_universal`` then read it. optimizer_states' int8/int4 codes move to
    the tag's ``xirang_optimizer_states/`` folder. Costs 12 bytes per parameter of disk (8 at stage 0 in
    fp32) and the time to write them (docs/checkpoints.md); ``false`` leaves them out (``xirang-ds
    checkpoint export`` writes them later). xirang's own files stay and a run with the same sections
    resumes from them."""
    extensions: dict = field(default_factory=dict, init=False, compare=False)
    """Sections of third-party plugins, by section name (filled by the loader, not written)."""

    def sections(self) -> dict[str, Section]:
        """Every section by its key, built-in and third-party, in the order the block documents them."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.init and isinstance(getattr(self, f.name), Section)}
        out.update(self.extensions)
        return out

    def enabled_sections(self) -> dict[str, Section]:
        return {name: s for name, s in self.sections().items() if s.enabled}

    def check(self) -> Issues:
        """Rules across sections (`xirang_ds.config.rules`)."""
        return check(self)


def glob_matches(pattern: str, name: str) -> bool:
    """Whole-name glob match: ``"layers.2"`` does not match ``"layers.20"``."""
    return fnmatch.fnmatchcase(name, pattern)


__all__ = ["AutotuneConfig", "Issues", "PresetName", "Section", "XirangConfig", "glob_matches"]
