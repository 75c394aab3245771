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
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from xirang_ds.config.schema import XirangConfig
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import CallbackHandle, wrap_method
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
)

if TYPE_CHECKING:  # pragma: no cover
    from xirang_ds.checkpoints.param_states import ParamStates
    from xirang_ds.checkpoints.tags import RunFacts
    from xirang_ds.config.fit import LeftOut
    from xirang_ds.memory.calibration import Calibration
    from xirang_ds.memory.engine_roles import TrainingWatch
    from xirang_ds.memory.tracker import MemoryTracker
    from xirang_ds.plugins.activations import ActivationsPlugin
    from xirang_ds.plugins.activations.storage import StorageProvider
    from xirang_ds.plugins.grad_release.plugin import GradReleasePlugin
    from xirang_ds.plugins.memory_pool import MemoryPoolPlugin
    from xirang_ds.plugins.optimizer_states.plugin import OptimizerStatesPlugin

logger = logging.getLogger("xirang_ds")

FRAMEWORKS = ("deepspeed", "megatron")
"""Training frameworks a session drives plugins through."""

WatchFactory = Callable[..., "TrainingWatch"]
"""``watch(tracker, engine, roles=...)``: builds the `TrainingWatch` that drives the shared tracker."""

CHECKPOINT_KEY = "xirang"
"""Key of the plugins' state inside DeepSpeed's ``client_state``."""


def load_checkpoint_options(engine: Any, *args: Any, **kwargs: Any) -> dict:
    """The arguments of a call ``engine.load_checkpoint(*args, **kwargs)`` by name, DeepSpeed's
    defaults filled in (``load_dir``, ``tag``, ``load_optimizer_states``, ``load_module_only``, ...)."""
    import inspect

    bound = inspect.signature(type(engine).load_checkpoint).bind(engine, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


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
                 framework: str = "deepspeed", left_out: Iterable["LeftOut"] = ()):
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
        """With ``"preset": "auto"``: which preset it took and why (`xirang_ds.config.auto`)."""
        self.left_out: tuple["LeftOut", ...] = tuple(left_out)
        """Sections the preset turned on that this run's ds_config leaves out (`xirang_ds.config.fit`)."""
        self.engine: Any = None
        self.model: Any = None
        self._tracker = None
        self._watch = None
        self._watch_factory: Optional[WatchFactory] = None
        self._handles: list[Any] = []
        self.events: list[dict] = []
        self.memory_roles: list[Callable[[], Iterable[tuple[str, Any]]]] = []
        self.oom_guard: Optional[Any] = None
        """The monitor's `xirang_ds.oom.OomGuard` with ``on_oom = "halve_micro_batch"``: a plugin that
        applies an update inside backward calls its ``confirm_update()`` first."""
        self.calibration: Optional["Calibration"] = None
        """This run's peak prediction, calibrated on its first steady measured step (with the monitor,
        under DeepSpeed: `xirang_ds.memory.calibration`); the monitor feeds it at each check."""

    # ----------------------------------------------------------------------------------------
    def plugin(self, section: str) -> Optional[Plugin]:
        """The attached plugin of a section, or ``None``."""
        return next((p for p in self.plugins if p.section == section), None)

    # what the plugins offer each other (`xirang_ds.registry.FACTS`) ---------------------------------
    def _provider(self, fact: str) -> Optional[Plugin]:
        return next((p for p in self.plugins if fact in p.provides), None)

    @property
    def stepper(self) -> Optional["GradReleasePlugin"]:
        """The plugin that applies the optimizer update during backward (grad_release), or ``None``."""
        return self._provider(UPDATE_IN_BACKWARD)

    @property
    def state_quantizer(self) -> Optional["OptimizerStatesPlugin"]:
        """The plugin that keeps the optimizer states in its own formats (optimizer_states), or ``None``."""
        return self._provider(LOW_BIT_STATES)

    @property
    def pool_owner(self) -> Optional["MemoryPoolPlugin"]:
        """The plugin whose pool the others allocate from (memory_pool; its ``add_client``), or ``None``."""
        return self._provider(SHARED_POOL)

    @property
    def activation_planner(self) -> Optional["ActivationsPlugin"]:
        """The plugin that plans the saved activations (activations), or ``None``."""
        return self._provider(ACTIVATION_PLAN)

    def storage_lender(self) -> Optional["StorageProvider"]:
        """Idle device memory another plugin lends now for encoded activations (comm_buffers' arena between
        reductions), or ``None``."""
        lender = self._provider(STORAGE_LENDER)
        return lender.lent_storage() if lender is not None else None

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
            from xirang_ds.memory.device_peak import device_peak

            window = device_peak().open()
        self._handles.append(CallbackHandle(window.close))
        return window

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
        for p in self.plugins:
            p.prepare_ds_config(self.ds_config)

    def prepare_ddp_config(self, ddp_config: Any) -> None:
        """Megatron-core: let plugins edit the ``DistributedDataParallelConfig`` (bucket sizes)."""
        for p in self.plugins:
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
        if checkpoints:
            self._handles.append(wrap_method(engine, "save_checkpoint", self._save_checkpoint))
        for p in self.plugins:
            p.attach(engine)
        if checkpoints:  # outermost: it decides how the plugins' wrappers load
            from xirang_ds.checkpoints.schedulers import install

            self._handles.append(wrap_method(engine, "load_checkpoint", self._load_checkpoint))
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

    # checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {p.section: p.state_dict() for p in self.plugins}

    def load_state_dict(self, state: dict) -> None:
        for p in self.plugins:
            if p.section in state:
                p.load_state_dict(state[p.section])

    def _save_checkpoint(self, original, save_dir, tag=None, client_state=None, *args, **kwargs):
        """The plugins' state into ``client_state``, the marker, and (``deepspeed_files``) DeepSpeed's own
        ZeRO files, all before DeepSpeed writes its files and then ``latest``: a save that dies midway
        leaves ``latest`` on the previous checkpoint."""
        from xirang_ds import __version__
        from xirang_ds.checkpoints import codes
        from xirang_ds.checkpoints.tags import facts_of_run, layout_record, write_marker

        client_state = dict(client_state or {})
        client_state[CHECKPOINT_KEY] = self.state_dict()
        tag_dir = os.path.join(save_dir, str(tag) if tag is not None else f"global_step{self.engine.global_steps}")
        marker = {"xirang_ds": __version__, "preset": self.config.preset, "sections": [p.section for p in self.plugins]}
        facts = facts_of_run(self)
        codes_beside = facts is not None and self.stepper is None
        if facts is not None:
            marker["deepspeed_files"] = layout_record(facts)
        if codes_beside:
            marker["optimizer_states_codes"] = codes.FOLDER
        if int(getattr(self.engine, "local_rank", self.engine.global_rank)) == 0:
            # by the first rank of every node: each node reads its own copy when checkpoints are node-local
            write_marker(tag_dir, marker)
        if facts is not None and facts.stage == 0:
            return self._save_with_stage0_entry(original, tag_dir, marker, facts, save_dir, tag, client_state,
                                                *args, **kwargs)
        if codes_beside:
            with codes.saving_beside(self.engine, tag_dir, marker, facts):
                return original(save_dir, tag, client_state, *args, **kwargs)
        if facts is not None:
            client_state.update(self._write_deepspeed_files(save_dir, tag_dir, marker, facts))
        return original(save_dir, tag, client_state, *args, **kwargs)

    def _save_with_stage0_entry(self, original, tag_dir: str, marker: dict, facts: "RunFacts", save_dir, tag,
                                client_state: dict, *args, **kwargs):
        """A stage-0 save whose model-states file holds plain DeepSpeed's optimizer entry, built by the
        writing rank from every rank's grad_release shard (written just before); the basic optimizer's
        own groups go under `BASIC_GROUPS` for this block's resume."""
        import deepspeed.comm as dist

        from xirang_ds.checkpoints import BASIC_GROUPS
        from xirang_ds.checkpoints.tags import stage0_optimizer_entry

        client_state[BASIC_GROUPS] = facts.optimizer_groups
        dist.barrier()  # every rank's shard is on disk
        if not self.engine.save_non_zero_checkpoint:
            return original(save_dir, tag, client_state, *args, **kwargs)
        entry, _ = stage0_optimizer_entry(tag_dir, marker, facts)
        handle = wrap_method(self.engine.optimizer, "state_dict", lambda _original: entry)
        try:  # DeepSpeed's _save_checkpoint writes optimizer.state_dict() into the model-states file
            return original(save_dir, tag, client_state, *args, **kwargs)
        finally:
            handle.remove()

    def _write_deepspeed_files(self, save_dir: str, tag_dir: str, marker: dict, facts: "RunFacts") -> dict:
        """This rank's ZeRO file, from every rank's grad_release shard (written just before); returns the
        model-states entries a ZeRO run records (``param_shapes``, ...), for DeepSpeed to write."""
        import deepspeed.comm as dist

        from xirang_ds.checkpoints.deepspeed_writer import copy_recovery_script, zero_model_entries
        from xirang_ds.checkpoints.tags import write_deepspeed_files
        from xirang_ds.compat.deepspeed import shared_params

        dist.barrier()  # every rank's shard is on disk
        _, groups = write_deepspeed_files(tag_dir, marker, facts, ranks=[self.stepper.comm.rank])
        if self.engine.global_rank == 0:
            copy_recovery_script(save_dir)
        frozen = [(n, p) for n, p in self.engine.module.named_parameters() if not p.requires_grad]
        return zero_model_entries(groups, facts.params, frozen, shared_params(self.engine))

    def _load_checkpoint(self, original, *args, **kwargs):
        """DeepSpeed's load; when the checkpoint's optimizer state belongs to another owner (plain
        DeepSpeed's ZeRO files under grad_release, grad_release's shards without it, torch AdamW's
        states under optimizer_states and back, another grad_release layout), DeepSpeed loads all but
        the optimizer state and this run's owner takes it over from the whole per-parameter states
        (docs/checkpoints.md)."""
        import contextlib

        from xirang_ds.checkpoints import codes

        options = load_checkpoint_options(self.engine, *args, **kwargs)
        own_codes = self._own_codes(options)
        foreign = None if own_codes else self._foreign_optimizer_state(options)
        if foreign is None:
            with codes.loading(self.engine, own_codes) if own_codes else contextlib.nullcontext():
                load_path, client_state = original(*args, **kwargs)
        else:
            states = self._read_states(*foreign)  # before anything is modified: a refusal leaves the run as it was
            call = {k: v for k, v in options.items() if k != "self"}
            load_path, client_state = original(**{**call, "load_optimizer_states": False})
            if load_path is not None:
                self._take_over(states)
                self.record_event("optimizer_state_taken_over", source=states.source, params=len(states.params))
                if int(getattr(self.engine, "global_rank", 0)) == 0:
                    logger.info("xirang: optimizer state taken over from %s (%d parameters)", states.source,
                                len(states.params))
        if client_state and CHECKPOINT_KEY in client_state:
            self.load_state_dict(client_state.pop(CHECKPOINT_KEY))
        return load_path, client_state

    def _foreign_optimizer_state(self, options: dict) -> Optional[tuple[str, dict]]:
        """``(tag folder, its marker)`` when the optimizer state of the checkpoint DeepSpeed is about to
        load is not this run's owner's own, else ``None``."""
        from xirang_ds.checkpoints.tags import OWNERS, read_marker, resolve_tag, state_owners

        if not options["load_optimizer_states"] or options["load_module_only"]:
            return None
        tag_dir = resolve_tag(options["load_dir"], options["tag"])
        if tag_dir is None:
            return None  # DeepSpeed's own message for a folder without a checkpoint
        marker = read_marker(tag_dir)
        current = {p.section for p in self.plugins} & set(OWNERS)
        if state_owners(marker) != current:
            return tag_dir, marker
        stepper = self.stepper
        if stepper is not None and stepper.layout_differs(tag_dir):
            return tag_dir, marker
        return None

    def _own_codes(self, options: dict) -> Optional[str]:
        """The tag folder whose optimizer_states codes this run resumes as its own, through DeepSpeed's own
        load (`codes.resumes_own`); ``None`` otherwise."""
        from xirang_ds.checkpoints import codes
        from xirang_ds.checkpoints.tags import read_marker, resolve_tag

        if not options["load_optimizer_states"] or options["load_module_only"]:
            return None
        tag_dir = resolve_tag(options["load_dir"], options["tag"])
        if tag_dir is None or not codes.resumes_own(self.engine, {p.section for p in self.plugins},
                                                     read_marker(tag_dir)):
            return None
        return tag_dir

    def _read_states(self, tag_dir: str, marker: dict) -> "ParamStates":
        """The checkpoint's optimizer state per parameter.

        Raises:
            XirangConfigError: it cannot be read, or lacks parameters this run trains; the message names
                the checkpoint's block, this run's and the fix.
        """
        from xirang_ds.checkpoints.deepspeed_files import CheckpointReadError
        from xirang_ds.checkpoints.tags import read_states

        trainable = [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad]
        saved = marker.get("sections", [])
        written = ("xirang sections " + ", ".join(saved)) if saved else "plain DeepSpeed"
        running = ", ".join(p.section for p in self.plugins)
        fix = ("Fix: engine.load_checkpoint(..., load_optimizer_states=False) loads the weights, the LR schedule and "
               "the step counters and restarts the optimizer's moments from the loaded weights; or resume with the "
               "block the checkpoint was written with")
        try:
            states = read_states(tag_dir, marker, [n for n, _ in trainable], {n: p.shape for n, p in trainable})
        except (CheckpointReadError, FileNotFoundError, ValueError, KeyError) as e:
            raise XirangConfigError([("checkpoint", f"{tag_dir} (written by {written}) cannot be taken over by this "
                                      f"run's sections ({running}): {e}. {fix}")],
                                    title="cannot resume from this checkpoint") from None
        if self.stepper is None:
            from xirang_ds.checkpoints.deepspeed_slots import UnknownOptimizerError, engine_slots

            try:
                engine_slots(self.engine)  # the target is known before DeepSpeed loads anything
            except UnknownOptimizerError as e:
                raise XirangConfigError([("checkpoint", f"{tag_dir} (written by {written}): {e}. {fix}")],
                                        title="cannot resume from this checkpoint") from None
        absent = [n for n, _ in trainable if n not in states.params]
        if absent:
            raise XirangConfigError([("checkpoint", f"{tag_dir} (written by {written}) has no optimizer state for "
                                      f"{len(absent)} parameter(s) this run trains ({', '.join(absent[:3])}"
                                      f"{', ...' if len(absent) > 3 else ''}). {fix}")],
                                    title="cannot resume from this checkpoint")
        return states

    def _take_over(self, states: "ParamStates") -> None:
        """Put the whole per-parameter states into whichever optimizer steps this run."""
        from xirang_ds.checkpoints.deepspeed_slots import load_engine_states

        stepper = self.stepper
        if stepper is not None:
            stepper.take_over(states)
        else:
            load_engine_states(self.engine, states)

    def figures(self) -> dict[str, dict]:
        """Each plugin's `Plugin.figures`, by section (plugins with nothing to report left out)."""
        return {p.section: f for p in self.plugins if (f := p.figures())}

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
