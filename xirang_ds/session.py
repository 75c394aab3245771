"""A session: the validated block, its plugins, and the engine they are attached to.

One session per ``xirang_ds.initialize`` call. It is reachable as ``engine.xirang`` so training
code (and tests) can ask what xirang did, read the tracker, or ``remove()`` every plugin, after
which the engine behaves as plain DeepSpeed again.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

from xirang_ds.config.schema import XirangConfig
from xirang_ds.hooks import CallbackHandle, wrap_method
from xirang_ds.registry import Plugin, plugins_for

logger = logging.getLogger("xirang_ds")

CHECKPOINT_KEY = "xirang"
"""Key of the plugins' state inside DeepSpeed's ``client_state``."""


class Session:
    """The plugins of one run and what they share.

    Attributes:
        config: the resolved ``"xirang"`` block.
        ds_config: the ds_config as DeepSpeed received it (after plugin edits).
        plugins: plugin instances in application order.
        engine: the DeepSpeed engine once attached, else ``None``.
    """

    def __init__(self, config: XirangConfig, ds_config: dict):
        self.config = config
        self.ds_config = ds_config
        self.plugins: list[Plugin] = [cls(section, self) for cls, section in plugins_for(config)]
        self.engine: Any = None
        self.model: Any = None
        self._tracker = None
        self._watch = None
        self._handles: list[Any] = []
        self.events: list[dict] = []
        self.memory_roles: list[Callable[[], Iterable[tuple[str, Any]]]] = []

    # ----------------------------------------------------------------------------------------
    def plugin(self, section: str) -> Optional[Plugin]:
        """The attached plugin of a section, or ``None``."""
        return next((p for p in self.plugins if p.section == section), None)

    @property
    def tracker(self):
        """The memory tracker shared by all plugins (created on first use)."""
        if self._tracker is None:
            from xirang_ds.memory.tracker import MemoryTracker

            self._tracker = MemoryTracker()
        return self._tracker

    def track_memory(self):
        """Start the shared tracker on the attached engine (once) and return it.

        Seeds it with the engine's model states by role and drives its phases from the engine's
        hooks (`xirang_ds.memory.engine_roles`).
        """
        if self._watch is None:
            from xirang_ds.memory.engine_roles import watch_engine

            if self.engine is None:
                raise RuntimeError("track_memory() needs the engine; call it from Plugin.attach")
            self._watch = watch_engine(self.tracker, self.engine, roles=self.memory_roles)
            self.tracker.start()
        return self.tracker

    def add_memory_roles(self, provider: Callable[[], Iterable[tuple[str, Any]]]) -> CallbackHandle:
        """Declare tensors a plugin holds outside DeepSpeed's structures (its own master weights,
        optimizer states) so the tracker counts them by role.

        Args:
            provider: returns ``(category, tensors)`` pairs; called whenever the tracker marks the
                engine's model states (when tracking starts, after each backward and before the
                optimizer step).

        Returns:
            A handle whose ``remove()`` withdraws the provider.
        """
        self.memory_roles.append(provider)
        return CallbackHandle(lambda: self.memory_roles.remove(provider))

    def record_event(self, kind: str, **fields: Any) -> None:
        """Remember something a plugin did; `summary` and the monitor report these."""
        event = {"kind": kind, **fields}
        self.events.append(event)

    # seams, in plugin order -----------------------------------------------------------------
    def prepare_ds_config(self) -> None:
        for p in self.plugins:
            p.prepare_ds_config(self.ds_config)

    def prepare_model(self, model: Any) -> None:
        self.model = model
        for p in self.plugins:
            p.prepare_model(model)

    def prepare_optimizer(self, optimizer: Any) -> Any:
        for p in self.plugins:
            optimizer = p.prepare_optimizer(optimizer)
        return optimizer

    def attach(self, engine: Any) -> None:
        self.engine = engine
        engine.xirang = self
        self._handles.append(wrap_method(engine, "save_checkpoint", self._save_checkpoint))
        self._handles.append(wrap_method(engine, "load_checkpoint", self._load_checkpoint))
        for p in self.plugins:
            p.attach(engine)

    def remove(self) -> None:
        """Detach every plugin (reverse order) and the checkpoint wrappers."""
        for p in reversed(self.plugins):
            p.remove()
        while self._handles:
            self._handles.pop().remove()
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self._tracker is not None:
            self._tracker.stop()
        if self.engine is not None and getattr(self.engine, "xirang", None) is self:
            del self.engine.xirang

    # checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {p.section: p.state_dict() for p in self.plugins}

    def load_state_dict(self, state: dict) -> None:
        for p in self.plugins:
            if p.section in state:
                p.load_state_dict(state[p.section])

    def _save_checkpoint(self, original, save_dir, tag=None, client_state=None, *args, **kwargs):
        client_state = dict(client_state or {})
        client_state[CHECKPOINT_KEY] = self.state_dict()
        return original(save_dir, tag, client_state, *args, **kwargs)

    def _load_checkpoint(self, original, *args, **kwargs):
        load_path, client_state = original(*args, **kwargs)
        if client_state and CHECKPOINT_KEY in client_state:
            self.load_state_dict(client_state.pop(CHECKPOINT_KEY))
        return load_path, client_state

    def summary(self) -> str:
        """One line per plugin saying what it does in this run."""
        lines = [f"xirang: {len(self.plugins)} plugin(s): " + ", ".join(p.section for p in self.plugins)]
        for p in self.plugins:
            describe = getattr(p, "describe", None)
            if describe is not None:
                lines.append(f"  {p.section}: {describe()}")
        return "\n".join(lines)
