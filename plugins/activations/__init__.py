"""Activation memory planner: per module, keep / recompute / compress / offload what it saves for
backward, chosen under a byte budget from counted costs; no change to model code.

Lifecycle:

1. ``prepare_model``: globs are checked against the model (a glob matching nothing, one module
   under two options, a lossy option on a module not marked tolerant: errors before DeepSpeed
   runs); ds_config's ``activation_checkpointing`` section is mapped onto the same options.
2. ``attach``: a removable wrapper goes on every candidate and fixed module (a compiled one at its compiled
   call, `compiled.py`) and one on the model (per-pass bookkeeping); a fixed plan alone applies at once.
3. Profiling (the first ``profile_steps`` forward/backward passes): every saved tensor is
   recorded and offloaded (`profile.py`); then all ranks agree on the figures, the budget is
   resolved and the planner (`planner.py`) chooses; the plan is logged on rank 0 and applied from
   the next forward.
4. ``state_dict`` carries the plan, so a resumed run skips profiling and uses the same plan.
5. ``remove``: every wrapper goes; the model runs as without the plugin.

Under Megatron-core (docs/megatron.md) the plugin attaches to the integration's ``MegatronRun``:
``auto`` candidates are the ``TransformerLayer``s and their children; profiles and plan are agreed
over the tensor- and data-parallel groups (a recomputed layer re-issues its all-reduce); a
recomputation restores Megatron's RNG tracker states; ``GlobalMemoryBuffer`` views are never packed.

Seams for other plugins: `raise_recompute` and `raise_compression` (the monitor's actions),
`set_storage_provider` (`storage.py`); with ``memory_pool`` on, other payloads are its blocks.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import ACTIVATIONS, PARAMETERS
from xirang_ds.memory.device_profile import PROFILES, DeviceProfile, profile_for
from xirang_ds.memory.host_ledger import ledger
from xirang_ds.plugins.activations import estimate
from xirang_ds.plugins.activations.compiled import (
    INSIDE_ONLY,
    REGION,
    CompiledWrapper,
    compiled_units,
    fixed_problems,
)
from xirang_ds.plugins.activations.config import ActivationsConfig
from xirang_ds.plugins.activations.head_loss import CHUNK
from xirang_ds.plugins.activations.passes import Passes
from xirang_ds.plugins.activations.planner import Choice, plan_table
from xirang_ds.plugins.activations.pricing import OtherPeak, check_agreed, check_memory_budget, escalation
from xirang_ds.plugins.activations.profile import ModuleProfile
from xirang_ds.plugins.activations.recompute import timings_line
from xirang_ds.plugins.activations.reserve import reserve_of, restore_reserves
from xirang_ds.plugins.activations.run_plan import BEFORE_RUN, twin_for
from xirang_ds.plugins.activations.selection import PATH, find_candidates, fixed_plan, tolerant_names
from xirang_ds.plugins.activations.storage import StorageProvider, use_pool
from xirang_ds.plugins.activations.wrapper import ModuleWrapper, Runtime
from xirang_ds.registry import ACTIVATION_PLAN, Plugin, register_plugin

logger = logging.getLogger("xirang_ds")

HOOKED_OPTIONS = ("compress", "quantize", "sparsify", "offload", "recompute_offload", "recompute_tiled_offload")
"""Options that pack saved tensors inside the module (a kept descendant must shield itself)."""


@register_plugin(ActivationsConfig, section="activations", order=30, summary="Activation memory planner.")
class ActivationsPlugin(Passes, Plugin):
    """Chooses and applies an option per module (see the module docstring).

    Attributes:
        plan: ``{module: option}`` in force (fixed and planned), empty while profiling.
        choices: the planner's `Choice` per module (bytes and estimated added time).
        profiles: the combined `ModuleProfile` per module after profiling.
        budget_bytes: resolved activation budget (``None`` when no planning happened).
        plan_text: the plan table logged on rank 0.
    """

    provides = frozenset({ACTIVATION_PLAN})
    adjusts_last = True
    """The estimate's plan is made within what the other plugins leave (`estimate.adjust_estimate`)."""

    frameworks = ("deepspeed", "megatron")
    paths = {"deepspeed": "xirang_ds.plugins.activations.deepspeed:DeepSpeedActivations",
             "megatron": "xirang_ds.plugins.activations.megatron:MegatronActivations"}

    def __init__(self, config: ActivationsConfig, session: Any):
        super().__init__(config, session)
        self.plan: dict[str, str] = {}
        self.choices: dict[str, Choice] = {}
        self.profiles: dict[str, ModuleProfile] = {}
        self.budget_bytes: Optional[int] = None
        self.reach: Optional[dict] = None
        """Set after planning: see `pricing.reach`."""
        self.outside_bytes = 0
        self.planned_peaks: Optional[tuple[int, int]] = None
        """Planned saved-activation bytes: (end of forward, worst point of backward)."""
        self.planned_step_peak: Optional[int] = None
        """The rank's whole peak the plan made before the run predicts (the monitor checks each step's)."""
        self.plan_text = ""
        self.reserves_taken: dict[str, str] = {}
        """Lossy modules switched to their reserve at run time, and why (`reserve.switch_reserves`)."""
        self.plan_source = "planned on the first profiled passes"
        self.state = "idle"
        self.runtime: Optional[Runtime] = None
        self.wrappers: dict[str, ModuleWrapper] = {}
        self.recompute_timings: list = []
        self._candidates: list[str] = []
        self._fixed: dict[str, str] = {}
        self.traced_heads: tuple = ()
        """Heads the estimator's fake trace ran chunked (`estimate.trace_context`)."""
        self.trace_free: list[str] = []
        self.trace_profiles: dict[str, ModuleProfile] = {}
        self.estimate_plan: Any = None
        """The plan the estimator made on its fake trace (`trace_plan.TracePlan`), in the estimator's session."""
        self.head_names: frozenset = frozenset()
        """Output heads (`head_loss`): deferred while profiling and under chunk."""
        self._ds_settings: dict = {}
        self.tolerant_names = self.token_wise_names = frozenset()
        """Modules whose saved tensors may be stored lossily; modules that work token by token."""
        self._twin: Any = None
        """The model's twin the estimator plans on before the run (`run_plan`), until the first forward."""
        self._passes = 0
        self._other_peak: Optional[OtherPeak] = None
        self._engine: Any = None
        self.region: Optional[str] = None
        """How the engine's whole model runs compiled (then planned as one unit, `compiled.py`), or ``None``."""
        self._forward_handles: list = []
        self._forward_scope: Any = None  # ZeRO-3: gathered weights saved by reference (gathered.py)
        self._model: Any = None
        """The model the names refer to (under Megatron the chunk inside DDP / Float16Module)."""
        self._groups: tuple = (None,)
        """Process groups the profiles and the plan are agreed over."""
        self._bandwidth: Optional[float] = None
        self.device_profile: DeviceProfile = PROFILES["cpu"]  # the run's device's (set at attach)
        self.device_profile_note = ""
        self.options: tuple[str, ...] = config.options
        self.replicated_inputs: frozenset = frozenset()
        """Under Megatron: modules whose inputs are identical on every tensor-parallel rank."""

    # seams ----------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> None:
        problems: list[tuple[str, str]] = []
        path = self.path
        blocks = path.blocks(model, problems)
        without_selective = path.without_selective()
        planned: list[str] = []  # the output heads among the candidates (`auto`), once found

        def heads(found_blocks: list[str]) -> list[str]:
            planned[:] = path.heads(model, found_blocks)
            return planned

        self._candidates = (find_candidates(model, self.config, problems, blocks,
                                            heads=heads if CHUNK in self.config.options else None)
                            if self.config.planner else [])
        if self.config.candidates != "auto" and CHUNK in self.config.options:
            heads([])  # candidates named by hand: any of them may be a head
        self._fixed, self._ds_settings = fixed_plan(model, self.config, path.ds_config(), problems)
        self.options = self.config.options
        fixed_heads = [name for name, option in self._fixed.items() if option == CHUNK]
        for name in fixed_heads:
            why = path.head_problem(model, name)
            if why is not None:
                problems.append((f"{PATH}.chunk", f"{name!r} {why}; remove it from the list"))
        self.head_names = frozenset(fixed_heads + [n for n in self._candidates if n in planned])
        if without_selective is not None:
            self.options = tuple(o for o in self.options if o != "selective_recompute")
            for name, option in self._fixed.items():
                if option == "selective_recompute":
                    problems.append((f"{PATH}.selective_recompute", f"{name!r}: selective recompute is not supported "
                                                                    f"{without_selective}; use recompute"))
        problems = path.stage_problems(problems)
        if problems:
            raise XirangConfigError(problems)
        self.tolerant_names, self.token_wise_names = tolerant_names(model, self.config), path.token_wise(model)
        self._twin = twin_for(self, model)

    def attach(self, engine: Any) -> None:
        from deepspeed.accelerator import get_accelerator

        self._engine = engine
        self.device_profile, self.device_profile_note = profile_for(engine.device)
        acc = get_accelerator()
        tracker = self.session.tracker
        parts = self.path.run_parts(engine)
        self._model, self._groups = parts.model, parts.groups  # the model whose names prepare_model planned for
        self._forward_scope = parts.forward_scope
        if parts.forward_scope is not None:
            self.keep(parts.forward_scope)
        self.runtime = Runtime(
            torch.device(engine.device), self.config.min_tensor_bytes, self.config.offload_prefetch,
            self.config.quantize_block_size, self.config.sparsify_threshold, tracker.host_tier,
            lambda: tracker.scope(ACTIVATIONS),
            mark=lambda t: tracker.mark([t], ACTIVATIONS) if tracker.active else None,
            param_scope=lambda: tracker.scope(PARAMETERS),
            synchronize=acc.synchronize if self._ds_settings.get("synchronize") else None,
            timings=self.recompute_timings if self._ds_settings.get("profile") else None, rng=parts.rng,
            arenas=parts.arenas, distribute=parts.distribute,
            host_ledger=ledger())  # its budget is host_memory_budget, set by the session
        check_memory_budget(self.session.config.memory_budget, engine)
        self.runtime.eligible.refresh(self._model)
        self.region = self.path.compiled(engine)
        self._wrap_modules()
        if callable(getattr(engine, "compile", None)):
            self.keep(wrap_method(engine, "compile", self._compile))
        lender = self.session.storage_lender()
        if lender is not None:
            self.set_storage_provider(lender)  # e.g. the comm_buffers arena between reductions
        if self._ds_settings.get("profile"):
            self.keep(wrap_method(engine, "step", self._step))
        self._begin()
        use_pool(self.session, self.runtime.storage, ready=lambda: self.state != "profiling")

    def _wrap_modules(self) -> None:
        """A wrapper on every candidate and fixed module (a compiled one at its compiled entry, the whole
        model as `REGION` when it runs compiled: `compiled.py`), and the per-pass bookkeeping on the
        model's forward (on the engine's when the model runs compiled)."""
        model, compiled = self._model, {REGION}
        if self.region is not None:
            self._candidates = [REGION] if self.config.planner else []
        else:
            self._candidates, compiled = compiled_units(model, self._candidates)
        problems = fixed_problems(self._fixed, compiled, self.region)
        if problems:
            raise XirangConfigError(problems)
        if self.region is not None or compiled - {REGION}:
            self._twin = None  # compiled code is timed, not counted: planned on profiled passes (`run_plan`)
        self.head_names = frozenset(h for h in self.head_names if h in self._candidates + list(self._fixed)) - compiled
        modules = {**dict(model.named_modules()), REGION: self._engine.module}
        for name in list(self._fixed) + [c for c in self._candidates if c not in self._fixed]:
            if name in compiled:
                self.wrappers[name] = CompiledWrapper(name, modules[name], self.runtime,
                                                      lambda: self.session.started_tracker)
                continue
            self.wrappers[name] = ModuleWrapper(name, modules[name], self.runtime)
            self.wrappers[name].distributable = name in self.replicated_inputs
            self.wrappers[name].head = self.path.defer if name in self.head_names else None
            self.wrappers[name].fixed_chunk = self._fixed.get(name) == CHUNK
            self.wrappers[name].chunk_tokens = (None if self.config.chunk_tokens == "auto"
                                                else int(self.config.chunk_tokens))  # profiled with it
        self._forward_handles = [*self.path.head_hooks(model, self.head_names),
                                 wrap_method(model if self.region is None else self._engine, "forward",
                                             self._root_forward)]
        units, left = [n for n in self.wrappers if n in compiled], [o for o in INSIDE_ONLY if o in self.options]
        if units and left:
            self._log(f"{', '.join(units)} run compiled: planned at the compiled call "
                      f"({' and '.join(left)} do not apply)")

    def _compile(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """``engine.compile()``: from the next forward the compiled model is one unit, profiled anew."""
        result = original(*args, **kwargs)
        region = self.path.compiled(self._engine)
        if region is not None and self.region is None:
            for handle in self._forward_handles + list(self.wrappers.values()):
                handle.remove()
            self.wrappers, self.region = {}, region
            self.plan, self.choices, self.profiles, self._passes = {}, {}, {}, 0
            self.runtime.profiler = None
            self._close_other_peak()
            self._wrap_modules()
            self._begin()
        return result

    def free_candidates(self) -> list[str]:
        """The candidates the planner chooses for: neither fixed nor inside a fixed module."""
        return [c for c in self._candidates if c not in self._fixed and not any(
            c.startswith(f + ".") for f in self._fixed)]


    def _begin(self) -> None:
        """Profile the free candidates, or put the fixed plan in force at once."""
        free = self.free_candidates()
        if free:
            self.state = "profiling"
            self._bandwidth = (self.config.host_bandwidth_gbps * 1e9 if self.config.host_bandwidth_gbps != "auto"
                               else self.device_profile.host_link_bytes_per_s)
        else:
            self._apply({name: option for name, option in self._fixed.items()})
            check_agreed(self.plan, self.runtime.device, self._groups)
            self.state = "planned"
            self._log_plan()

    def remove(self) -> None:
        for handle in self._forward_handles + list(self.wrappers.values()):
            handle.remove()
        self.wrappers.clear()
        self._forward_handles = []
        self._close_other_peak()
        if self.runtime is not None:
            self.runtime.offloader.synchronize()
            self.runtime.profiler = None
            self.runtime.storage.provider = None
        super().remove()

    def trace_context(self, model: torch.nn.Module, tracker: Any) -> Optional[Any]:
        """Heads fixed to ``chunk`` run chunked in the estimator's fake trace (`estimate.trace_context`)."""
        return estimate.trace_context(self, model, tracker)

    def trace_key(self) -> Any:
        """`xirang_ds.roles.ChangesTrace`: the section, the integration's path and the profile the pass prices by."""
        return repr(self.config), type(self.path).__name__, repr(estimate.trace_profile(self))

    def adjust_estimate(self, phases: dict, shape: Any, numels: list) -> Optional[dict]:
        """The plan that keeps every saved tensor, which the planner takes whenever the run fits
        (`estimate.adjust_estimate`); below that its choices come from profiled passes, not modelled."""
        return estimate.adjust_estimate(self, phases, shape)

    def reducible_bytes(self) -> int:
        """Saved-activation bytes a plan can take off the estimator's trace (keep-all less the least any
        plan needs; 0 before a trace or without free candidates), for grad_release's ``states: auto``."""
        return estimate.reducible_bytes(self)

    def step_seconds(self, shape: Any, numels: list, profile: Any) -> Optional[float]:
        """`xirang_ds.roles.TimesStep`: what the estimate's plan adds per micro-step (recompute, encode and decode,
        offload), priced by the estimate's device profile, in every micro-step; ``None`` without a plan."""
        plan = self.estimate_plan
        return plan.added_s * shape.grad_accum if getattr(plan, "device_profile", None) == profile else None

    def settled(self) -> bool:
        return self.state != "profiling"

    def describe(self) -> str:
        if self.state == "profiling":
            return f"profiling {len(self._candidates)} candidates for {self.config.profile_steps} passes, then planning"
        counts: dict[str, int] = {}
        for option in self.plan.values():
            counts[option] = counts.get(option, 0) + 1
        text = ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) or "nothing to do"
        if self.budget_bytes is not None and self.planned_peaks is not None:
            end, worst = self.planned_peaks
            text += (f"; plans {format_bytes(max(end, worst))} of saved activations at most "
                     f"(budget {format_bytes(self.budget_bytes)})")
        return text

    # checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"plan": dict(self.plan), "budget_bytes": self.budget_bytes, "bandwidth_bps": self._bandwidth,
                "device_profile": self.device_profile.as_dict(),
                "choices": {n: c.state() for n, c in self.choices.items()}, "reserves_taken": dict(self.reserves_taken),
                "outside_bytes": self.outside_bytes, "planned_peaks": self.planned_peaks,
                "planned_step_peak": self.planned_step_peak,
                "profiles": {n: p.as_dict() for n, p in self.profiles.items()}}

    def load_state_dict(self, state: dict) -> None:
        plan = state.get("plan") or {}
        if not plan:
            return
        if (REGION in plan) != (self.region is not None):
            self._log(f"the checkpoint's plan is for the model run {'compiled' if REGION in plan else 'eagerly'}; "
                      "this run profiles and plans anew")
            return
        unknown = [n for n in plan if n not in self.wrappers and n not in dict(self._model.named_modules())]
        if unknown:
            raise XirangConfigError([(PATH, f"the checkpoint's activation plan names modules this model does not "
                                            f"have ({', '.join(unknown[:4])}); load it into the same model")])
        self.profiles = {n: ModuleProfile.from_dict(p) for n, p in (state.get("profiles") or {}).items()}
        self.budget_bytes = state.get("budget_bytes")
        self._bandwidth = state.get("bandwidth_bps") or self._bandwidth
        self.choices = {n: Choice.from_state(c) for n, c in (state.get("choices") or {}).items()}
        self.reserves_taken = dict(state.get("reserves_taken") or {})
        restore_reserves(self)  # a checkpoint from before reserves
        self.outside_bytes = int(state.get("outside_bytes") or 0)
        peaks = state.get("planned_peaks")
        self.planned_peaks = tuple(peaks) if peaks else None
        self.planned_step_peak = state.get("planned_step_peak")
        self._close_other_peak()
        self.runtime.profiler = None
        modules = dict(self._model.named_modules())
        for name in plan:
            if name not in self.wrappers:
                self.wrappers[name] = ModuleWrapper(name, modules[name], self.runtime)
        self._apply(plan)
        self.state = "planned"

    # run-time actions (the monitor's raise_recompute / raise_compression) -------------------------
    def raise_recompute(self) -> bool:
        """Switch the kept module that frees most bytes per added second to a recompute option.

        Returns:
            True if the plan changed (every rank takes the same decision: the profiles agree).
        """
        return self._escalate(("selective_recompute", "recompute", "recompute_offload"))

    def raise_compression(self) -> bool:
        """Switch the kept module that frees most bytes per added second to a storage option
        (compress, or quantize / sparsify where tolerant, or offload).

        Returns:
            True if the plan changed.
        """
        return self._escalate(("compress", "quantize", "sparsify", "offload"))

    def _escalate(self, options: tuple[str, ...]) -> bool:
        if self.state != "planned" or not self.profiles:
            return False
        found = escalation(self.profiles, self.plan, list(self.wrappers), tuple(o for o in options if o in self.options),
                           self.tolerant_names, self._bandwidth or 1e10, self.runtime.offloader.stream is not None)
        if found is None:
            return False
        name, choice = found
        freed = self.profiles[name].keep_bytes - choice.device_bytes
        self.choices[name] = choice
        self._apply({**self.plan, name: choice.option})
        self.session.record_event("activations_escalated", module=name, option=choice.option, freed_bytes=freed)
        self._log(f"monitor action: {name} now {choice.option} (frees {format_bytes(freed)})")
        return True

    def set_storage_provider(self, provider: Optional[StorageProvider]) -> None:
        """Let ``provider`` lend device memory to compressed activations (``None``: plain allocations)."""
        if self.runtime is None:
            raise RuntimeError("set_storage_provider() needs the engine; call it from Plugin.attach or later")
        self.runtime.storage.provider = provider

    def figures(self) -> dict:
        """The planner's reach once it planned (`pricing.reach`), the lossy modules' reserves and those taken
        (`reserve.py`), and the offload host buffers (held bytes, most in use at once, bytes trimmed, bytes the
        host budget kept on the device); at ZeRO-3 the gathered weights saved by reference in the last forward
        and those gathered again for it."""
        out = dict(self.reach) if self.reach else {}
        if self.plan:
            out["plan"] = dict(sorted(self.plan.items()))
            out["reserves"] = {n: c.reserve.option for n, c in sorted(self.choices.items()) if c.reserve is not None}
            out["reserves_taken"] = dict(self.reserves_taken)
        if self._forward_scope is not None:
            out["gathered_refs"] = {"saved": self._forward_scope.saved, "regathered": self._forward_scope.regathered}
        if self.runtime is not None:
            pool, offloader = self.runtime.offloader.pool, self.runtime.offloader
            out["host_buffers"] = {"held_bytes": pool.allocated_bytes, "high_water_bytes": pool.high_water_bytes,
                                   "trimmed_bytes": pool.trimmed_bytes,
                                   "kept_on_device_bytes": offloader.kept_on_device_bytes}
        return out

    # applying -------------------------------------------------------------------------------------
    def _apply(self, plan: dict[str, str]) -> None:
        """Put ``plan`` in force from the next forward."""
        self.plan = dict(plan)
        configured = None if self.config.chunk_tokens == "auto" else int(self.config.chunk_tokens)
        for name, wrapper in self.wrappers.items():
            option = plan.get(name)
            choice = self.choices.get(name)
            wrapper.chunk_tokens = choice.rows if option == CHUNK and choice and choice.rows else configured
            hooked_above = any(name.startswith(o + ".") and plan[o] in HOOKED_OPTIONS for o in plan)
            p = self.profiles.get(name)
            must_save = frozenset(p.must_save) if p is not None and p.calls else None
            wrapper.apply(option, must_save, hooked_above and option == "keep", choice.rows if choice else 0)
            wrapper.reserve = reserve_of(wrapper, option, choice, self.runtime.handlers["offload"])

    def _log_plan(self) -> None:
        self.plan_text = plan_table(self.plan, self.choices, self.profiles, self.budget_bytes, self.outside_bytes,
                                    self.planned_peaks, errors_measured=not self.plan_source.startswith(BEFORE_RUN))
        self.plan_text += f"\ntimes priced by the device profile: {self.device_profile_note}" if self.choices else ""
        self.plan_text += f"\n{self.plan_source}" if self.choices else ""
        self._log("plan\n" + self.plan_text)

    def _log(self, message: str) -> None:
        if getattr(self._engine, "global_rank", 0) == 0:
            logger.info("xirang activations: %s", message)

    def _step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's ``activation_checkpointing.profile``: log the step's recomputation times."""
        before = self._engine.global_steps
        result = original(*args, **kwargs)
        if self._engine.global_steps != before and self.recompute_timings:
            self._log(f"step {self._engine.global_steps}: {timings_line(self.recompute_timings)}")
        return result


__all__ = ["ActivationsPlugin"]
