"""The sections of the ``"xirang"`` block as plugins register them, and the block's type built from them.

A plugin registers its section with its class (`xirang_ds.registry.register_plugin` records it here); the
core's own sections (`CORE_SECTIONS`: the tuner's ``autotune``) follow the plugins'. The built-in plugins are
imported on first use from the list their package keeps (``plugins/__init__.py``'s ``BUILTIN``, in the order
the block documents them), third-party plugins from the entry-point group ``xirang_ds.plugins``. The config
layer asks here and imports no plugin (it names their package, as a string, to load it): the layers point
one way (config below the registry and the plugins).
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from xirang_ds.config import schema
from xirang_ds.config.schema import AutotuneConfig
from xirang_ds.version import __version__

logger = logging.getLogger("xirang_ds")

PLUGINS_PACKAGE = "xirang_ds.plugins"
"""The package of the built-in plugins (the repository's ``plugins/``): its ``BUILTIN`` maps each built-in
section to the module whose import registers its plugin, in the order the block documents them."""

ENTRY_POINT_GROUP = "xirang_ds.plugins"

CORE_SECTIONS: dict[str, tuple[type, str]] = {"autotune": (AutotuneConfig, "Auto-tuner.")}
"""Sections of the block that no plugin handles (the tuner is a command, `xirang_ds.tune`): key → (its
dataclass, one line on it); they follow the plugins' sections."""


@dataclass
class _Sections:
    types: dict[str, type] = field(default_factory=dict)
    summaries: dict[str, str] = field(default_factory=dict)
    builtin: tuple[str, ...] = ()
    builtin_loaded: bool = False
    entry_points_loaded: bool = False
    block: Optional[type] = None


_SECTIONS = _Sections()


def register_section(name: str, config_type: type, summary: str = "") -> None:
    """Record ``name`` as a key of the block, validated as ``config_type`` (`xirang_ds.registry.register_plugin`
    calls it for each plugin); ``summary`` is the key's one line (default: the first line of the type's
    docstring)."""
    _SECTIONS.types[name] = config_type
    _SECTIONS.summaries[name] = summary or (config_type.__doc__ or "").strip().split("\n")[0]


def forget_section(name: str) -> Optional[type]:
    """Forget a registered section (for tests of third-party registration); its type, or ``None``."""
    _SECTIONS.summaries.pop(name, None)
    return _SECTIONS.types.pop(name, None)


def section_type(name: str) -> Optional[type]:
    """The dataclass registered for the section ``name``, or ``None``."""
    return _SECTIONS.types.get(name)


def registered() -> dict[str, type]:
    """Every registered section (built-in, then third-party, in registration order) → its dataclass."""
    return dict(_SECTIONS.types)


def load_builtins() -> None:
    """Import the built-in plugins once (each registers itself and what it contributes)."""
    if not _SECTIONS.builtin_loaded:
        _SECTIONS.builtin_loaded = True
        modules = importlib.import_module(PLUGINS_PACKAGE).BUILTIN
        _SECTIONS.builtin = tuple(modules)
        for name in modules.values():
            importlib.import_module(name)


def load_entry_points() -> None:
    """Import the third-party plugins of the entry-point group once (each registers itself)."""
    if _SECTIONS.entry_points_loaded:
        return
    _SECTIONS.entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()  # the module registers its plugin on import, or the object is the class
        except Exception as e:  # a broken third-party plugin must not stop training setups
            logger.warning("xirang_ds: could not load plugin entry point %s (%s): %s", ep.name, ep.value, e)


def section_names() -> tuple[str, ...]:
    """The block's own section keys (the built-in plugins', then `CORE_SECTIONS`) in the order the block
    documents them; third-party sections are `extension_sections`."""
    load_builtins()
    return (*_SECTIONS.builtin, *CORE_SECTIONS)


def extension_sections() -> dict[str, type]:
    """Sections contributed by third-party plugins: key → config dataclass."""
    load_builtins()
    load_entry_points()
    builtin = set(section_names())
    return {k: v for k, v in _SECTIONS.types.items() if k not in builtin}


def block_type() -> type:
    """The concrete type of a validated block: `schema.XirangConfig` with one field per section of `section_names`
    (a frozen dataclass, built once), each defaulting to its section's defaults.

    Its ``__field_docs__`` holds each section key's one line (`register_section`'s ``summary``), for the
    config reference.
    """
    if _SECTIONS.block is None:
        load_builtins()
        sections = {name: (_SECTIONS.types[name], _SECTIONS.summaries[name]) for name in _SECTIONS.builtin}
        sections.update(CORE_SECTIONS)
        cls = dataclasses.make_dataclass(
            "XirangConfig", [(name, kind, field(default_factory=kind)) for name, (kind, _) in sections.items()],
            bases=(schema.XirangConfig,), frozen=True, namespace={"__doc__": schema.XirangConfig.__doc__})
        cls.__module__ = __name__  # pickled by reference: this module's ``XirangConfig`` (`__getattr__`)
        cls.__field_docs__ = {name: doc for name, (_, doc) in sections.items()}
        _SECTIONS.block = cls
    return _SECTIONS.block


def check_available(config: schema.XirangConfig) -> list[tuple[str, str]]:
    """Problems for enabled sections that nothing runs here: the tuner's (a command), and a section whose
    plugin is not built in this version."""
    problems = []
    handled = set(_SECTIONS.types.values())
    for name, section in config.enabled_sections().items():
        if name in CORE_SECTIONS:
            problems.append(("xirang.autotune.enabled",
                             "the search runs before training, as a command: `xirang-ds tune --model ... --ds-config "
                             f"<this file> --budget 40GB` writes the winning ds_config to {section.output!r} "
                             "(xirang.autotune.output); train with that file. Set enabled to false here"))
        elif type(section) not in handled:
            problems.append((f"xirang.{name}.enabled",
                             f"the {name} plugin is not built yet in xirang_ds {__version__}; "
                             f"set it to false or remove the {name!r} section"))
    return problems


def __getattr__(name: str) -> Any:
    if name == "XirangConfig":  # the concrete block type, where pickle looks for it
        return block_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CORE_SECTIONS", "ENTRY_POINT_GROUP", "PLUGINS_PACKAGE", "block_type", "check_available", "extension_sections",
           "forget_section", "load_builtins", "load_entry_points", "register_section", "registered",
           "section_names", "section_type"]
