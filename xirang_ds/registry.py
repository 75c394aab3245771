"""Plugins: the base class, the registry keyed by config type, and entry-point discovery.

The config type is the plugin key (torchao's ``register_quantize_module_handler``): a plugin class
is registered with ``@register_plugin(SomeConfig, section="some")`` and the session dispatches on
``type(config)``. Third-party plugins ship a section dataclass and a plugin class and expose the
class under the entry-point group ``xirang_ds.plugins``; their section then becomes a key of the
block.

Order: plugins are applied in ascending ``order`` at every seam and removed in reverse. The
built-in order is documented in docs/config.md:

    10 comm_buffers   (ds_config edits come first: bucket sizes)
    20 precision      (module casts and op lists, before anything reads dtypes)
    25 memory_pool    (the pool its clients below find through ``session.pool()``)
    30 activations    (saved-tensor hooks and recompute wrappers on the model)
    40 optimizer_states (the basic optimizer)
    50 grad_release   (hooks on parameters, needs the final optimizer)
    80 profiler       (observes everything above)
    90 monitor        (acts on what the tracker sees)
    100 autotune
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Protocol, runtime_checkable

from xirang_ds.config import schema, sections
from xirang_ds.config.schema import Section


logger = logging.getLogger("xirang_ds")

# what a plugin offers the others (`Plugin.provides`); the session's typed accessors find the plugin by these
UPDATE_IN_BACKWARD = "update_in_backward"
"""It applies the optimizer update during backward and owns the masters and states meanwhile (grad_release:
`xirang_ds.session.Session.stepper`)."""
LOW_BIT_STATES = "low_bit_states"
"""It keeps the optimizer states in its own formats (optimizer_states: `Session.state_quantizer`)."""
SHARED_POOL = "shared_pool"
"""It reserves the pool the others allocate from (memory_pool: `Session.pool_owner`)."""
ACTIVATION_PLAN = "activation_plan"
"""It plans the saved activations and can move more of them off the device (activations:
`Session.activation_planner`)."""
STORAGE_LENDER = "storage_lender"
"""It lends idle device memory for other plugins' tensors (comm_buffers' arena: `Session.storage_lender`)."""
MEMORY_WATCH = "memory_watch"
"""It checks the device peak against the budget each step and feeds the session's calibrated prediction
(monitor: `Session.start_calibration`); its ``peak()`` is `Session.memory`."""
FACTS = (UPDATE_IN_BACKWARD, LOW_BIT_STATES, SHARED_POOL, ACTIVATION_PLAN, STORAGE_LENDER, MEMORY_WATCH)


@dataclass
class OptimizerSpec:
    """The ds_config ``optimizer`` block, handed to plugins when no client optimizer is given.

    A plugin that returns it unchanged lets DeepSpeed build the optimizer from the block as usual;
    a plugin that replaces it returns a ``torch.optim`` object or a callable
    ``f(model_parameters) -> optimizer`` (what ``deepspeed.initialize`` accepts).

    Attributes:
        type: the block's ``type`` as written (``"AdamW"``).
        params: the block's ``params`` as written.
    """

    type: str
    params: dict


@runtime_checkable
class TrainingRun(Protocol):
    """What every plugin seam's ``engine`` offers under both frameworks: the DeepSpeed engine, and the
    `xirang_ds.integration.megatron_run.MegatronRun` that stands in for one under Megatron-core (tested
    against both in ``tests/structure/test_plugin_seams.py``). Shared plugin code reads only these; a
    path reads whatever its framework's run has besides."""

    module: Any
    """The model (under DeepSpeed the engine's module; under Megatron the first chunk, wrapped by DDP)."""
    optimizer: Any
    """The optimizer the run steps (DeepSpeed's wrapper; Megatron's optimizer)."""
    device: Any
    global_rank: int
    world_size: int
    global_steps: int
    """Optimizer steps taken."""

    def step(self, *args: Any, **kwargs: Any) -> Any: ...

    def train_micro_batch_size_per_gpu(self) -> Any: ...

    def gradient_accumulation_steps(self) -> Any: ...

    def zero_optimization_stage(self) -> int: ...


class FrameworkPath:
    """What a plugin does under one training framework: the seams where DeepSpeed and Megatron-core differ.

    A plugin that runs under both keeps one subclass per framework beside its shared core (its
    ``deepspeed.py`` and ``megatron.py``), named in `Plugin.paths`. The core calls ``self.path`` where the
    frameworks differ and never tests the framework itself; the session drives both runs through the same
    plugin seams, whose ``engine`` argument is a `TrainingRun` (the DeepSpeed engine, or the `MegatronRun`
    that stands in for one). Override what the framework needs; each default does nothing.

    Attributes:
        plugin: the plugin this path belongs to (its state lives there).
        session: the plugin's session.
    """

    def __init__(self, plugin: "Plugin"):
        self.plugin = plugin
        self.session = plugin.session

    @classmethod
    def check(cls, config: Section) -> list[tuple[str, str]]:
        """Problems of ``config`` under this framework only (`Plugin.check_framework`)."""
        return []

    def prepare_model(self, model: Any) -> None:
        """What the plugin does to the model before this framework wraps it, beyond its shared part."""

    def prepare_optimizer(self, optimizer: Any) -> Any:
        """The optimizer this framework should step (default: unchanged)."""
        return optimizer

    def attach(self, engine: Any) -> None:
        """Attach the plugin to this framework's run (the DeepSpeed engine or a ``MegatronRun``)."""

    def describe(self) -> str:
        """One line on what the plugin does in this run."""
        return ""

    def remove(self) -> None:
        """Undo what `attach` did beyond the plugin's kept handles (which the plugin removes)."""


class Plugin:
    """Base class of every plugin: the seams every plugin has. Override the ones you need; each default
    does nothing. What only some plugins do (edit the ds_config, say whether they fit it, adjust the
    estimate, keep checkpoint state, lend storage, ...) is a role in `xirang_ds.roles`: a plugin plays
    it by defining the role's methods, and the session asks for the plugins that play it.

    Seams, called by the session in plugin order:

    * ``prepare_model(model)``: hooks or module swaps before DeepSpeed (or Megatron's DDP) wraps
      the model.
    * ``prepare_optimizer(optimizer)``: receive the basic optimizer (a ``torch.optim`` object, an
      `OptimizerSpec`, or ``None``) and return it or a replacement.
    * ``attach(engine)``: after ``deepspeed.initialize``; under Megatron-core ``engine`` is a
      `xirang_ds.integration.megatron_run.MegatronRun`; what differs between the two is in the plugin's
      `FrameworkPath` for each (`Plugin.paths`).
    * ``remove()``: undo everything; the run behaves as without the plugin afterwards.
    * ``describe()``: one line for the session summary.

    Attributes:
        config: this plugin's validated section.
        session: the `Session` that owns the plugin (config, tracker, engine).
    """

    section: ClassVar[str] = ""
    config_type: ClassVar[type] = Section
    order: ClassVar[int] = 50
    memory_neutral: ClassVar[bool] = False
    """True for plugins that only observe: without `xirang_ds.roles.Estimates` the estimate keeps its phases
    (otherwise it notes that the plugin's effect is not modelled)."""
    time_neutral: ClassVar[bool] = False
    """True for plugins whose work takes no time a device profile can price (observing, sizing buffers):
    without `xirang_ds.roles.TimesStep` the predicted step time counts nothing for them (otherwise it notes
    that the plugin's time is not priced)."""
    frameworks: ClassVar[tuple[str, ...]] = ("deepspeed",)
    """Training frameworks the plugin attaches to: ``"deepspeed"``, ``"megatron"``. A plugin lists
    ``"megatron"`` once it handles Megatron-core's seams (docs/megatron.md)."""
    preset_frameworks: ClassVar[Optional[tuple[str, ...]]] = None
    """Frameworks where a preset turns the plugin on (None: all of `frameworks`). A plugin whose
    requirements on a framework's settings a preset cannot check in advance leaves that framework
    out: there it runs only when the user names it."""
    paths: ClassVar[dict[str, str]] = {}
    """framework → ``"module:Class"`` of the plugin's `FrameworkPath` there, imported when first used (a
    Megatron path only under Megatron); empty for a plugin with one way of attaching."""
    provides: ClassVar[frozenset[str]] = frozenset()
    """What this plugin offers the others, from `FACTS` (at most one plugin of a run provides each)."""
    inert_keys: ClassVar[dict[str, dict[str, tuple[Any, str]]]] = {}
    """framework → {key: (the value that asks for nothing, why the key does nothing there)}: keys of
    the section that have no effect under that framework. A key the user wrote with another value is an
    error; the others are set to that value, so the validated section says what runs
    (`xirang_ds.integration.megatron.validate_for_megatron`). ``None``: any written value is an error."""

    def __init__(self, config: Section, session: Any):
        self.config = config
        self.session = session
        self._handles: list[Any] = []
        self._path: Optional[FrameworkPath] = None

    @classmethod
    def path_class(cls, framework: str) -> Optional[type[FrameworkPath]]:
        """The plugin's `FrameworkPath` class under ``framework``, or ``None`` when it has none there."""
        target = cls.paths.get(framework)
        if target is None:
            return None
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)

    @property
    def path(self) -> FrameworkPath:
        """This plugin's path under the session's framework (made on first use).

        Raises:
            RuntimeError: the plugin names no path for that framework.
        """
        if self._path is None:
            cls = self.path_class(self.session.framework)
            if cls is None:
                raise RuntimeError(f"xirang {self.section}: no {self.session.framework} path (Plugin.paths)")
            self._path = cls(self)
        return self._path

    # seams ---------------------------------------------------------------------------------
    def prepare_model(self, model: Any) -> None:
        """Attach to the model before DeepSpeed wraps it."""

    def prepare_optimizer(self, optimizer: Any) -> Any:
        """Return the basic optimizer DeepSpeed should wrap (default: unchanged)."""
        return optimizer

    def attach(self, engine: Any) -> None:
        """Attach to the DeepSpeed engine after it is built."""

    def remove(self) -> None:
        """Remove every hook and wrapper this plugin added."""
        while self._handles:
            self._handles.pop().remove()

    def describe(self) -> str:
        """One line for the session summary on what the plugin does in this run (after ``attach``); ``""``
        leaves the plugin out of the summary."""
        return ""

    @classmethod
    def check_framework(cls, config: Section, framework: str) -> list[tuple[str, str]]:
        """Problems running this plugin, configured as ``config``, under ``framework`` (``"deepspeed"`` or
        ``"megatron"``): ``[(field, message)]`` with fields relative to the section; empty when it can run."""
        if framework in cls.frameworks:
            path = cls.path_class(framework)
            return path.check(config) if path is not None else []
        return [("enabled", f"the {cls.section} plugin does not run under {framework} yet (it supports "
                            f"{', '.join(cls.frameworks)}); set it to false for {framework} runs")]

    # helpers --------------------------------------------------------------------------------
    def keep(self, handle: Any) -> Any:
        """Keep a removable handle (anything with ``.remove()``) for `remove`."""
        self._handles.append(handle)
        return handle


@dataclass
class _Registry:
    by_type: dict[type, type[Plugin]] = field(default_factory=dict)


_REGISTRY = _Registry()


def register_plugin(config_type: type, section: str, order: int = 50,
                    summary: str = "") -> Callable[[type], type]:
    """Class decorator: register a `Plugin` subclass as the handler of ``config_type``.

    Args:
        config_type: the section dataclass (a `Section` subclass) that selects this plugin.
        section: the key of the section in the ``"xirang"`` block.
        order: position among plugins at every seam (see the module docstring).
        summary: one line on the section, the docstring of its key in the block (default: the first line of
            ``config_type``'s docstring).

    Raises:
        ValueError: another plugin already handles this config type or section.

    Example:
        >>> @register_plugin(MyConfig, section="my_plugin", order=70)
        ... class MyPlugin(Plugin):
        ...     def attach(self, engine): ...
    """

    def wrap(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Plugin)):
            raise TypeError(f"@register_plugin expects a Plugin subclass; got {cls!r}")
        known = sections.section_type(section)
        if known is not None and known is not config_type:
            raise ValueError(f"section {section!r} is already handled by {_REGISTRY.by_type[known].__name__}")
        cls.section, cls.config_type, cls.order = section, config_type, order
        _REGISTRY.by_type[config_type] = cls
        sections.register_section(section, config_type, summary)
        return cls

    return wrap


def plugin_for(config: Section) -> Optional[type[Plugin]]:
    """The plugin class registered for ``type(config)``, or ``None`` if none is built."""
    sections.load_builtins()
    sections.load_entry_points()
    return _REGISTRY.by_type.get(type(config))


def plugin_class(section: str) -> Optional[type[Plugin]]:
    """The plugin class that handles the section named ``section``, or ``None`` if none is built."""
    sections.load_builtins()
    config_type = sections.section_type(section)
    return _REGISTRY.by_type.get(config_type) if config_type is not None else None


def plugin_classes() -> list[type[Plugin]]:
    """Every registered plugin class (built-in, then third-party), for the planners that ask a role of the
    class before any plugin is built."""
    sections.load_builtins()
    sections.load_entry_points()
    return [_REGISTRY.by_type[kind] for kind in sections.registered().values() if kind in _REGISTRY.by_type]


def provider_section(fact: str) -> Optional[str]:
    """The section of the registered plugin that provides ``fact`` (one of `FACTS`), or ``None``: how the core
    names, in a message, the section a missing capability would come from."""
    return next((cls.section for cls in plugin_classes() if fact in cls.provides), None)


def built_sections() -> set[str]:
    """Names of the sections whose plugin is built (built-in or registered)."""
    sections.load_builtins()
    return {name for name in sections.registered() if plugin_class(name) is not None}


def check_framework(config: schema.XirangConfig, framework: str) -> list[tuple[str, str]]:
    """Problems for enabled sections whose plugin cannot run under ``framework`` (dotted paths)."""
    problems = []
    for name, section in config.enabled_sections().items():
        cls = plugin_for(section)
        if cls is not None:
            problems.extend((f"xirang.{name}.{field}", message) for field, message in
                            cls.check_framework(section, framework))
    return problems


def plugins_for(config: schema.XirangConfig) -> list[tuple[type[Plugin], Section]]:
    """Enabled sections with their plugin classes, in application order."""
    pairs = [(plugin_for(s), s) for s in config.enabled_sections().values()]
    return sorted(((cls, s) for cls, s in pairs if cls is not None), key=lambda p: p[0].order)


def unregister(section: str) -> None:
    """Forget a registered plugin (for tests of third-party registration)."""
    config_type = sections.forget_section(section)
    if config_type is not None:
        _REGISTRY.by_type.pop(config_type, None)
