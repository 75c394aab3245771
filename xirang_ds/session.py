"""A session: the validated block, its plugins, and the engine they are attached to.

One session per ``xirang_ds.initialize`` call (DeepSpeed) or per Megatron-core model
(`xirang_ds.integration.megatron`). It is reachable as ``engine.xirang`` so training code (and
tests) can ask what xirang did, read the tracker, or ``remove()`` every plugin, after which the
engine behaves as plain DeepSpeed (or plain Megatron) again.

Under Megatron-core there is no DeepSpeed engine: the integration attaches a
`xirang_ds.integration.megatron_run.MegatronRun` (the model chunks, Megatron's optimizer and a
step counter) in its place, with the `TrainingWatch` that suits it; ``framework`` says which.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, TypeVar

from xirang_ds.checkpoints import engine_files
from xirang_ds.config.schema import XirangConfig
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import CallbackHandle, wrap_method
from xirang_ds.memory.device_peak import device_peak
from xirang_ds.memory.host_ledger import ledger
from xirang_ds.registry import (
    ACTIVATION_PLAN,
    LOW_BIT_STATES,
    MEMORY_WATCH,
    SHARED_POOL,
    STORAGE_LENDER,
    UPDATE_IN_BACKWARD,
    Plugin,
    check_framework,
    plugins_for,
    provider_section,
)
from xirang_ds.roles import Checkpoints, EditsDdpConfig, EditsDsConfig, LendsStorage, ReportsFigures

if TYPE_CHECKING:  # pragma: no cover
    from xirang_ds.memory.calibration import Calibration
    from xirang_ds.memory.engine_roles import TrainingWatch
    from xirang_ds.memory.tracker import MemoryTracker
    from xirang_ds.memory.usage import MemoryReport
    from xirang_ds.memory.lending import StorageProvider

logger = logging.getLogger("xirang_ds")
R = TypeVar("R")
"""A role of `xirang_ds.roles` (`Session.plugins_with`)."""

FRAMEWORKS = ("deepspeed", "megatron")
"""Training frameworks a session drives plugins through."""

WatchFactory = Callable[..., "TrainingWatch"]
"""``watch(tracker, engine, roles=...)``: builds the `TrainingWatch` that drives the shared tracker."""

class Session:
    """The plugins of one run and what they share.

    Attributes:
        config: the resolved ``"xirang"`` block.
        ds_config: the ds_config as DeepSpeed received it (after plugin edits); under Megatron the
            file's content, read for the block only.
        plugins: plugin instances in application order.
        engine: the DeepSpeed engine once attached (under Megatron the ``MegatronRun``), else ``None``.
        framework: ``"deepspeed"`` or ``"megatron"``: which seams the plugins are driven through.
    """

    def __init__(self, config: XirangConfig, ds_config: dict, world_size: Optional[int] = None,
                 framework: str = "deepspeed", left_out: Iterable[Any] = (), estimator: Any = None):
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {FRAMEWORKS}; got {framework!r}")
        problems = check_framework(config, framework)
        if problems:
            raise XirangConfigError(problems)
        self.framework = framework
        self.config = config
        self.ds_config = ds_config
        self.requested_ds_config = copy.deepcopy(ds_config)
        """The ds_config as the user wrote it, before any plugin edited the copy DeepSpeed receives (under
        grad_release DeepSpeed runs at stage 0 without bf16/fp16 or clipping: its engine's
        ``zero_optimization_stage()`` and the like describe that copy, docs/grad_release.md)."""
        self.world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        """Ranks of the run (the estimator sets it; at initialize it comes from the launcher)."""
        self.plugins: list[Plugin] = [cls(section, self) for cls, section in plugins_for(config)]
        self.preset_choice: Optional[str] = None
        """With ``"preset": "auto"``: which preset it took and why (`xirang_ds.planning.auto`)."""
        self.left_out: tuple[Any, ...] = tuple(left_out)
        """Sections the preset turned on that this run's ds_config leaves out (`xirang_ds.planning.fit`)."""
        self.estimator: Any = estimator
        """What predicts this run's memory before it runs (`xirang_ds.planning.estimator`: its ``estimate_states``
        and ``estimate_run``), handed down by the integration that builds the session, which sits above the
        estimator; grad_release's ``states: auto`` and the calibration ask it. ``None`` where nothing estimates."""
        self.device_profile: Any = None
        """The `xirang_ds.memory.device_profile.DeviceProfile` an estimate is priced by (``--gpu``, or the run's
        device when a run asks the estimator for its plan); ``None``: the CPU's."""
        self.device_total_bytes: Optional[int] = None
        """What ``memory_budget: auto`` stands for in an estimate for a device this machine does not have."""
        self.trace: Any = None
        """The estimator's fake trace (`xirang_ds.memory.trace.Trace`) while plugins adjust its phases."""
        self.engine: Any = None
        self.model: Any = None
        self._tracker = None
        self._watch = None
        self._watch_factory: Optional[WatchFactory] = None
        self._handles: list[Any] = []
        self.events: list[dict] = []
        self.memory_roles: list[Callable[[], Iterable[tuple[str, Any]]]] = []
        self.oom_guard: Any = None
        """The monitor's `xirang_ds.plugins.monitor.oom.OomGuard` with ``on_oom = "halve_micro_batch"``: a plugin that
        applies an update inside backward calls its ``confirm_update()`` first."""
        self.calibration: Optional["Calibration"] = None
        """This run's peak prediction, calibrated on its first steady measured step (with the monitor,
        under DeepSpeed: `xirang_ds.memory.calibration`); the monitor feeds it at each check."""

    # ----------------------------------------------------------------------------------------
    def plugin(self, section: str) -> Optional[Plugin]:
        """The attached plugin of a section, or ``None``."""
        return next((p for p in self.plugins if p.section == section), None)

    def plugins_with(self, role: type[R]) -> list[R]:
        """The plugins that play ``role`` (a protocol of `xirang_ds.roles`), in plugin order."""
        return [p for p in self.plugins if isinstance(p, role)]

    # what the plugins offer each other (`xirang_ds.registry.FACTS`) ---------------------------------
    def _provider(self, fact: str) -> Optional[Plugin]:
        return next((p for p in self.plugins if fact in p.provides), None)

    @property
    def stepper(self) -> Optional[Plugin]:
        """The plugin that applies the optimizer update during backward (grad_release), or ``None``."""
        return self._provider(UPDATE_IN_BACKWARD)

    @property
    def state_quantizer(self) -> Optional[Plugin]:
        """The plugin that keeps the optimizer states in its own formats (optimizer_states), or ``None``."""
        return self._provider(LOW_BIT_STATES)

    @property
    def pool_owner(self) -> Optional[Plugin]:
        """The plugin whose pool the others allocate from (memory_pool; its ``add_client``), or ``None``."""
        return self._provider(SHARED_POOL)

    @property
    def activation_planner(self) -> Optional[Plugin]:
        """The plugin that plans the saved activations (activations), or ``None``."""
        return self._provider(ACTIVATION_PLAN)

    def storage_lender(self) -> Optional["StorageProvider"]:
        """Idle device memory another plugin lends now for encoded activations (comm_buffers' arena between
        reductions), or ``None``."""
        lender = self._provider(STORAGE_LENDER)
        return lender.lent_storage() if isinstance(lender, LendsStorage) else None

    def pool(self) -> Any:
        """The `xirang_ds.memory.pool.MemoryPool` plugins allocate from, or ``None`` (the
        ``memory_pool`` section is off, or not attached yet: call it from ``attach`` or later)."""
        return getattr(self.pool_owner, "pool", None)

    @property
    def started_tracker(self) -> Optional["MemoryTracker"]:
        """The shared tracker if something made it (`tracker` makes it on first use), else ``None``."""
        return self._tracker

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
        hooks (`xirang_ds.memory.engine_roles`; under Megatron the watch given to `attach`).
        """
        if self._watch is None:
            if self.engine is None:
                raise RuntimeError("track_memory() needs the engine; call it from Plugin.attach")
            self._watch = self.watch(self.tracker, self.engine, roles=self.memory_roles)
            self.tracker.start()
        return self.tracker

    def watch(self, tracker: "MemoryTracker", engine: Any, **kwargs: Any) -> "TrainingWatch":
        """A `TrainingWatch` driving ``tracker`` from ``engine``'s phases, as this run's framework gives it
        (the ``watch`` given to `attach`; `xirang_ds.memory.engine_roles.watch_engine` by default)."""
        from xirang_ds.memory.engine_roles import watch_engine

        return (self._watch_factory or watch_engine)(tracker, engine, **kwargs)

    def open_peak_window(self) -> Any:
        """A window on this rank's device peak for one reader (the monitor, comm_buffers, the bench):
        the live-storage tracker's window on CPU (exact bytes, with a breakdown), the allocator's
        counter through its one owner elsewhere (`xirang_ds.memory.device_peak`). A reader resets
        only its own window, never what another reads. Closed when the session is removed.

        Returns:
            An object with ``peak_bytes``, ``reset()`` and ``close()``; on CPU a
            `xirang_ds.memory.tracker.Window` (also ``report()``).
        """
        import torch

        if self.engine is None:
            raise RuntimeError("open_peak_window() needs the engine; call it from Plugin.attach")
        if torch.device(self.engine.device).type == "cpu":
            window = self.track_memory().open_window()
        else:
            window = device_peak().open()
        self._handles.append(CallbackHandle(window.close))
        return window

    def memory(self) -> "MemoryReport":
        """This rank's device-memory peak over the run so far and its breakdown by category, as the monitor
        measures it (the CPU's live-storage tracker; on CUDA the allocator's peak, without a breakdown).

        Raises:
            XirangConfigError: the block has no monitor (``xirang.monitor.enabled``, on in every preset).

        Example:
            >>> report = engine.xirang.memory()
            >>> report.peak_bytes, report.by_category["activations"], report.host_bytes
        """
        watch = self._provider(MEMORY_WATCH)
        if watch is None:
            name = provider_section(MEMORY_WATCH)
            raise XirangConfigError([(f"xirang.{name}.enabled", f"memory() reads the {name}'s measurements; this "
                                      f"block has no {name}. Fix: set \"{name}\": {{\"enabled\": true}} (every "
                                      "preset has it)")])
        return watch.peak()

    def keep(self, handle: Any) -> Any:
        """Keep a removable handle (anything with ``.remove()``) that `remove` undoes after the plugins."""
        self._handles.append(handle)
        return handle

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
        for p in self.plugins_with(EditsDsConfig):
            p.prepare_ds_config(self.ds_config)

    def prepare_ddp_config(self, ddp_config: Any) -> None:
        """Megatron-core: let plugins edit the ``DistributedDataParallelConfig`` (bucket sizes)."""
        for p in self.plugins_with(EditsDdpConfig):
            p.prepare_ddp_config(ddp_config)

    def start_calibration(self, model: Any) -> None:
        """Calibrate this run's peak prediction on its first steady measured step, when a plugin watches the
        peak (`xirang_ds.registry.MEMORY_WATCH`); call it with the model as built, before any plugin hooks it
        (the DeepSpeed integration does; `xirang_ds.memory.calibration` traces a DeepSpeed run)."""
        if self._provider(MEMORY_WATCH) is not None:
            from xirang_ds.memory.calibration import Calibration

            self.calibration = Calibration(self, model)

    def prepare_model(self, model: Any) -> None:
        self.model = model
        for p in self.plugins:
            p.prepare_model(model)

    def prepare_optimizer(self, optimizer: Any) -> Any:
        for p in self.plugins:
            optimizer = p.prepare_optimizer(optimizer)
        return optimizer

    def attach(self, engine: Any, watch: Optional[WatchFactory] = None, checkpoints: bool = False) -> None:
        """Attach every plugin to ``engine``.

        Args:
            engine: the DeepSpeed engine, or under Megatron the integration's ``MegatronRun``.
            watch: ``watch(tracker, engine)`` builds the `TrainingWatch` behind `track_memory`;
                default: `xirang_ds.memory.engine_roles.watch_engine` (DeepSpeed's buffers by role).
            checkpoints: the engine's ``save_checkpoint``/``load_checkpoint`` carry the plugins' state
                (DeepSpeed; Megatron saves its own, docs/megatron.md).
        """
        self.engine = engine
        self._watch_factory = watch
        engine.xirang = self
        host = self.config.host_memory_budget  # over every host tier (`xirang_ds.memory.host_ledger`)
        ledger().budget_bytes = None if host == "auto" else int(host)
        if checkpoints:
            self._handles.append(wrap_method(engine, "save_checkpoint", functools.partial(engine_files.save, self)))
        for p in self.plugins:
            p.attach(engine)
        if checkpoints:  # outermost: it decides how the plugins' wrappers load
            from xirang_ds.checkpoints.schedulers import install

            self._handles.append(wrap_method(engine, "load_checkpoint", functools.partial(engine_files.load, self)))
            self._handles.append(CallbackHandle(install()))  # LR schedulers fit this run's param groups

    def remove(self) -> None:
        """Detach every plugin (reverse order) and the checkpoint wrappers."""
        for p in reversed(self.plugins):
            p.remove()
        if self.calibration is not None:
            self.calibration.remove()
        while self._handles:
            self._handles.pop().remove()
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self._tracker is not None:
            self._tracker.stop()
        if self.engine is not None and getattr(self.engine, "xirang", None) is self:
            del self.engine.xirang
            ledger().budget_bytes = None

    # checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Each plugin's checkpoint state by section (``{}`` for a plugin that keeps none)."""
        return {p.section: p.state_dict() if isinstance(p, Checkpoints) else {} for p in self.plugins}

    def load_state_dict(self, state: dict) -> None:
        for p in self.plugins_with(Checkpoints):
            if p.section in state:
                p.load_state_dict(state[p.section])

    def figures(self) -> dict[str, dict]:
        """Each plugin's `xirang_ds.roles.ReportsFigures.figures`, by section (plugins with nothing to report
        left out)."""
        return {p.section: f for p in self.plugins_with(ReportsFigures) if (f := p.figures())}

    def summary(self) -> str:
        """One line per plugin saying what it does in this run."""
        lines = [f"xirang: {len(self.plugins)} plugin(s): " + ", ".join(p.section for p in self.plugins)]
        if self.preset_choice:
            lines.append(f"  {self.preset_choice}")
        for p in self.plugins:
            line = p.describe()
            if line:
                lines.append(f"  {p.section}: {line}")
        if self.calibration is not None:
            lines.append(f"  {self.calibration.describe()}")
        lines += [f"  {line}" for line in self.summary_left_out()]
        return "\n".join(lines)

    def summary_left_out(self) -> list[str]:
        """One line per section the preset turned on and this run leaves out, saying why."""
        return [item.line(self.config.preset) for item in self.left_out]
