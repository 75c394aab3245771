"""The grad_release plugin: the optimizer step fused into backward (the design is in docs/grad_release.md).

What both frameworks share is here; each framework's path is beside it:

* ``prepare_ds_config`` (DeepSpeed): read precision, ZeRO stage and clipping from the ds_config,
  refuse what cannot work, hand DeepSpeed a copy without them (`ds_config.py`).
* ``prepare_model``: cast parameters to fp16/bf16 as DeepSpeed would have.
* ``attach``: the framework's path (`deepspeed.DeepSpeedRelease`, `megatron.MegatronRelease`) plans
  buckets over the basic optimizer's parameters (`plan_buckets`), starts the pipeline with one
  post-accumulate-grad hook per parameter (`start_pipeline`) and takes over the framework's backward,
  step and checkpoints; a finished pass is acted on here (`after_pass`).
* ``remove``: hand the optimizer state back to the basic optimizer, undo every hook and wrapper.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any, Callable, Optional

import torch

from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import CallbackHandle
from xirang_ds.links import backend_link, efficient_numel
from xirang_ds.memory.categories import GRADIENTS, OPTIMIZER_STATES, PARAMETERS
from xirang_ds.plugins.grad_release import embedding_rows, estimate, rows
from xirang_ds.plugins.grad_release.bucket import Bucket
from xirang_ds.plugins.grad_release.config import GradReleaseConfig
from xirang_ds.plugins.grad_release.ds_config import cast_model, hand_over, parameter_dtype, read_setup
from xirang_ds.plugins.grad_release.handback import hand_back
from xirang_ds.plugins.grad_release.layout import BucketLayout, auto_bucket_numel, plan_buckets
from xirang_ds.plugins.grad_release.optimizers import optimizer_problems, state_tensors
from xirang_ds.plugins.grad_release.pipeline import Pass, ReleasePipeline
from xirang_ds.plugins.grad_release.rows import owners as rows_owners
from xirang_ds.plugins.grad_release.states_tier import StatesTier
from xirang_ds.plugins.grad_release.step_ops import extra_backwards, step_ops
from xirang_ds.registry import UPDATE_IN_BACKWARD, Plugin, register_plugin

logger = logging.getLogger("xirang_ds")


@register_plugin(GradReleaseConfig, section="grad_release", order=50,
                 summary="Per-layer gradient release (optimizer step in backward).")
class GradReleasePlugin(StatesTier, Plugin):
    """Optimizer step fused into backward, with data parallel, accumulation, clipping and fp16.

    Under Megatron-core it replaces DDP's gradient buffer and Megatron's optimizer step
    (`megatron.py` has the design).

    Attributes:
        setup: what the user's ds_config asked for (`ds_config.TrainingSetup`).
        buckets: this rank's buckets in launch order (after ``attach``).
        pipeline: the per-backward machinery (`pipeline.ReleasePipeline`).
        policy: passes, multipliers, loss scale and step outcomes (`policy.ReleasePolicy`).
    """

    frameworks = ("deepspeed", "megatron")
    provides = frozenset({UPDATE_IN_BACKWARD})
    paths = {"deepspeed": "xirang_ds.plugins.grad_release.deepspeed:DeepSpeedRelease",
             "megatron": "xirang_ds.plugins.grad_release.megatron:MegatronRelease"}
    preset_frameworks = ("deepspeed",)
    """Under Megatron it needs Megatron's fp32 optimizer, no gradient-accumulation fusion (Megatron-LM's
    GPU default), no sequence or pipeline parallelism: settings a preset cannot see, so it runs there
    only when the block names it."""

    def __init__(self, config: GradReleaseConfig, session: Any) -> None:
        super().__init__(config, session)
        self.setup: Any = None
        self.engine: Any = None
        self.comm: Any = None
        self.buckets: list[Any] = []
        self.pipeline: Any = None
        self.policy: Any = None
        self.bucket_numel = 0
        self._owners: Counter = Counter()  # parameter id -> modules holding it (a tied weight has two)
        self._embeddings: list[torch.nn.Embedding] = []
        self.freed_bytes = 0  # Megatron: bytes of DDP's gradient buffer freed
        self._applied_at_micro_step: Optional[int] = None
        self._micro = 0  # Megatron: backwards since the last optimizer step
        self.parked_why: Optional[str] = None  # states: auto, in host memory (`states_tier.StatesTier`)
        self.stash_chosen = False  # exact_method auto: the held shard in host memory (`states_tier.StatesTier`)
        self.estimate_note: Optional[str] = None  # what adjust_estimate chose for the states (the estimate's notes)
        self.estimate_plan: Optional[dict] = None  # the same as a record (`Estimate.plans`)
        # the gradient bytes its buckets hold mid-backward once given gradients are taken (set by the estimate)
        self.estimate_gradients_held: Optional[Callable[[list], int]] = None

    @classmethod
    def check_ds_config(cls, config: GradReleaseConfig, ds_config: dict) -> list[tuple[str, str]]:
        try:
            read_setup(ds_config, config)
        except XirangConfigError as e:
            return list(e.problems)
        return []

    @classmethod
    def preset_leave_out(cls, config: GradReleaseConfig, ds_config: dict) -> Optional[str]:
        """fp32 at ZeRO-0 with accumulation: the accumulator is the whole model's fp32 gradients, what
        plain DeepSpeed holds there, so nothing falls (gpt-small, 2 ranks, accumulation 4: peak 1.00x,
        step 1.07x; docs/grad_release.md "Gradient accumulation"). With bf16/fp16 the masters'
        remainders and the 16-bit gradients still pay, and at stage 1/2 the accumulator is sharded."""
        setup = read_setup(ds_config, config)  # asked only where check_ds_config found nothing
        accumulation = ds_config.get("gradient_accumulation_steps", 1)
        if (setup.zero_stage == 0 and isinstance(accumulation, int) and accumulation > 1
                and setup.param_dtype == torch.float32):
            return (f"fp32 at zero_optimization.stage 0 with gradient_accumulation_steps {accumulation}: the "
                    "accumulator is the whole model's fp32 gradients, as in plain DeepSpeed, so it would lower "
                    "nothing and only cost time; write a grad_release section to run it anyway, or use stage 1/2")
        return None

    @classmethod
    def preset_fallbacks(cls, config: GradReleaseConfig, ds_config: dict) -> list[tuple[str, Any, str]]:
        dtype = parameter_dtype(ds_config)
        kinds = {"none": "no master, bf16 weights rounded stochastically",
                 "remainders_8bit": "the master's second byte beside its bf16 rounding"}
        if config.masters in kinds and dtype != torch.bfloat16:
            return [("masters", "auto", f"{config.masters!r} ({kinds[config.masters]}) needs bf16 "
                                        f"parameters and this run trains in {str(dtype).replace('torch.', '')}; "
                                        "masters stay \"auto\"")]
        return []

    @classmethod
    def check_optimizer(cls, config: GradReleaseConfig, optimizer: Any) -> list[tuple[str, str]]:
        """Nothing asked in advance: the buckets step whatever optimizer there is, and a missing one is
        refused where `prepare_optimizer` meets it."""
        return []

    # seams before DeepSpeed -----------------------------------------------------------------
    def prepare_ds_config(self, ds_config: dict) -> None:
        self.setup = read_setup(ds_config, self.config)
        hand_over(ds_config)

    def prepare_model(self, model: Any) -> None:
        if self.setup is None:
            return  # Megatron: its own modules decide the dtype (only fp32 is taken over, see attach)
        cast_model(model, self.setup.param_dtype)
        self.choose_states_tier(model)

    def prepare_optimizer(self, optimizer: Any) -> Any:
        if optimizer is None:
            raise XirangConfigError([("", "xirang.grad_release needs an optimizer to step during backward, and "
                                          "neither a client optimizer nor an \"optimizer\" block was given. Fix: pass "
                                          "optimizer= to initialize or add an \"optimizer\" block")])
        return optimizer

    # attach: the framework's path -------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        self.path.attach(engine)

    def start_pipeline(self, on_grad: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """The pipeline over the planned buckets, fed by one post-accumulate-grad hook per parameter
        (``on_grad``, default the pipeline's own), and the buckets' tensors declared by role."""
        tracker = self.session.tracker
        by_rows = [rows.fits(b, b.params[0], self._owners.get(id(b.params[0]), 0)) for b in self.buckets]
        self.pipeline = ReleasePipeline(self.buckets, self.config.overlap_comm, stash_held=self.stashes_held(),
                                        on_grad_seen=lambda g: tracker.mark(g, GRADIENTS) if tracker.active else None,
                                        by_rows=by_rows)
        copies, stash_copies = self.copy_stream(), self.stash_copy_stream()
        for bucket in self.buckets:
            bucket.copies, bucket.stash_copies = copies, stash_copies
        hook = on_grad or self.pipeline.on_grad
        for bucket in self.buckets:
            for param in bucket.params:
                self.keep(param.register_post_accumulate_grad_hook(hook))
        hands = {}
        for bucket, ok in zip(self.buckets, by_rows):
            if ok:  # the chunked head asks it in backward (`rows.RowSink`)
                param = bucket.params[0]
                hands[param] = rows.RowHandOver(self.pipeline, param)
                setattr(param, rows.ATTR, hands[param])
                self.keep(CallbackHandle(lambda param=param: delattr(param, rows.ATTR)))
        for module in self._embeddings:  # an input embedding gives its gradient by rows itself
            if module.weight in hands and embedding_rows.plain(module):
                self.keep(embedding_rows.wrap(module, hands[module.weight]))
        self.keep(self.session.add_memory_roles(self._memory_roles))

    def plan_buckets(self, module: torch.nn.Module, optimizers: list[Any], sharded: bool) -> list[Any]:
        """Buckets over ``module``'s trainable parameters in reverse registration order, each within one
        dtype and one of ``optimizers`` (cloned for the bucket; Megatron has one per param-group kind)."""
        problems = [p for basic in optimizers for p in optimizer_problems(basic, sharded, self.setup.zero_stage)]
        if problems:
            raise XirangConfigError([("", f"xirang.grad_release: {p}") for p in dict.fromkeys(problems)])
        group_of = {p: (basic, gi) for basic in optimizers for gi, g in enumerate(basic.param_groups)
                    for p in g["params"]}
        order = [(n, p) for n, p in reversed(list(module.named_parameters())) if p.requires_grad]
        missing = [n for n, p in order if p not in group_of]
        if missing:
            raise XirangConfigError([("", f"xirang.grad_release: parameter {missing[0]} requires grad but is in no "
                                          f"param group of the optimizer ({len(missing)} such); grad_release would drop "
                                          "its gradient. Fix: give the optimizer every trainable parameter or set "
                                          "requires_grad=False on the others")])
        odd = [n for n, p in order if not p.is_contiguous() or p.is_sparse]
        if odd:
            raise XirangConfigError([("", f"xirang.grad_release: parameter {odd[0]} is not a dense contiguous tensor")])
        total = sum(p.numel() for _, p in order)
        self._owners = rows_owners(module)
        self._embeddings = [m for m in module.modules() if type(m) is torch.nn.Embedding]
        world = self.comm.world if sharded else 1
        self.bucket_numel = self._bucket_numel(total, self.setup.comm_dtype.itemsize, self.comm.world)
        tracker = self.session.tracker
        buckets: list[Any] = []
        for run in _dtype_runs(order, lambda p: group_of[p][0]):
            basic = group_of[run[0][1]][0]
            for indices in plan_buckets([p.numel() for _, p in run], self.bucket_numel):
                chosen = [run[i] for i in indices]
                params = [p for _, p in chosen]
                try:
                    buckets.append(Bucket(len(buckets), params, [n for n, _ in chosen],
                                          [group_of[p][1] for p in params],
                                          BucketLayout.build([p.numel() for p in params], world), self.comm, basic,
                                          self.setup.comm_dtype, tracker.scope, tracker.host_tier,
                                          masters=self._masters, states=self.states_tier()))
                except TypeError as e:
                    raise XirangConfigError([("", f"xirang.grad_release: the optimizer {type(basic).__name__} cannot "
                                                  f"be rebuilt as type(opt)(param_groups, **opt.defaults) for each "
                                                  f"bucket ({e}). Fix: use a torch.optim optimizer, or disable "
                                                  "xirang.grad_release")]) from None
        return buckets

    def _bucket_numel(self, total: int, comm_bytes: int, ranks: int) -> int:
        """``bucket_size_numel``, or its ``auto`` value for ``total`` trainable elements reduced in
        ``comm_bytes``-byte elements over ``ranks`` ranks on this run's collective backend."""
        if self.config.bucket_size_numel != "auto":
            return int(self.config.bucket_size_numel)
        _, latency, bandwidth = backend_link()
        return auto_bucket_numel(total, efficient_numel(comm_bytes, ranks, latency, bandwidth) if ranks > 1 else 0)

    def adjust_estimate(self, phases: dict, shape: Any, numels: list) -> Optional[dict]:
        """The phases as the buckets hold memory (`estimate.adjust_estimate`)."""
        return estimate.adjust_estimate(self, phases, shape, numels)

    def gradient_ops(self, shape: Any, numels: list, profile: Any) -> Optional[tuple[Any, Any]]:
        """`xirang_ds.roles.TimesGradients`: its own ops in one step, run on fake tensors (`step_ops.step_ops`)."""
        return step_ops(self, shape, numels, profile)

    def extra_backwards(self, shape: Any) -> int:
        """`xirang_ds.roles.TimesGradients`: ``two_pass``'s norm-only backward (`step_ops.extra_backwards`)."""
        return extra_backwards(self)

    def _rows_numels(self, world: int, bucket_numel: int) -> list[int]:
        return estimate.rows_numels(self, world, bucket_numel)

    def rows_round(self, weight: torch.Tensor, shape: Any) -> Optional[tuple[int, int]]:
        """Where a chunked head's ``weight`` gives its gradient by rows: ``(ranks, comm bytes)``
        (`estimate.rows_round`)."""
        return estimate.rows_round(self, weight, shape)

    def describe(self) -> str:
        return self.path.describe()

    # a DeepSpeed checkpoint of another owner (the session's take-over) -------------------------------
    def layout_differs(self, tag_dir: str) -> bool:
        """True if the tag holds grad_release shards of another layout (world size, stage, buckets)."""
        return self.path.layout_differs(tag_dir)

    def take_over(self, states: Any) -> None:
        """Continue from another owner's whole per-parameter optimizer state (`deepspeed.DeepSpeedRelease`)."""
        self.path.take_over(states)

    # a finished pass --------------------------------------------------------------------------
    def after_pass(self, kind: Any, sumsq: Optional[torch.Tensor]) -> bool:
        """Act on a finished pass; False stops the passes of this backward (step skipped)."""
        if kind is Pass.ACCUMULATE:
            return True
        policy, pipeline = self.policy, self.pipeline
        norm = policy.global_norm(sumsq)
        finite = math.isfinite(norm)
        if kind in (Pass.NORM, Pass.HOLD) and not finite:
            pipeline.discard_all()
            policy.finish_step(norm, applied=False)
            if not policy.skip_nonfinite:
                self._raise_nonfinite(norm, applied=False)
            self._log_skip(norm)
            return False
        if kind is Pass.NORM:
            policy.known_norm = norm
            return True
        if kind is Pass.HOLD:
            policy.known_norm = norm
            if self.session.oom_guard is not None:
                self.session.oom_guard.confirm_update()  # every rank's backward succeeded
            pipeline.apply_all(policy.rule())
        policy.finish_step(norm, applied=True)
        if not finite:
            self._raise_nonfinite(norm, applied=True)
        return True

    @property
    def _masters(self) -> str:
        """How bf16 parameters' masters are kept (`Bucket`'s ``masters``): ``auto`` is ``remainders``."""
        return "remainders" if self.config.masters == "auto" else self.config.masters

    def retries_oom(self) -> bool:
        """``monitor.on_oom`` retries a failed backward, so no update may begin before backward ends."""
        monitor = self.session.config.monitor
        return monitor.enabled and monitor.on_oom == "halve_micro_batch"

    def drop_gradients(self) -> None:
        if self.pipeline is not None:
            self.pipeline.abort()
            self.pipeline.discard_all()

    def _raise_nonfinite(self, norm: float, applied: bool) -> None:
        local = [b for b, s in zip(self.buckets, self.pipeline.bucket_sumsq)
                 if s is not None and not math.isfinite(float(s))]
        where = (f"in the bucket of {', '.join(local[0].names[:3])}{', ...' if len(local[0].names) > 3 else ''}"
                 if local else "in a bucket sharded to another rank")
        state = ("every bucket was applied as it was reduced, this one included" if applied
                 else "no parameter was updated")
        raise RuntimeError(f"xirang.grad_release: non-finite gradient at step {self.engine.global_steps + 1} "
                           f"(global norm {norm}) {where}; {state}. Set xirang.grad_release.nonfinite to "
                           "\"skip_step\" to skip such steps as DeepSpeed does (costs a global pass every step, "
                           "see exact_method)")

    def _log_skip(self, norm: float) -> None:
        if self.engine.global_rank == 0:
            scale = self.policy.loss_scale
            logger.info("xirang grad_release: step %d skipped (gradient norm %s); no parameter updated%s",
                        self.engine.global_steps + 1, norm,
                        f", loss scale now {scale:g}" if self.policy.loss_scaler is not None else "")

    # memory roles -------------------------------------------------------------------------------
    def _memory_roles(self) -> list[tuple[str, Any]]:
        masters = [t for b in self.buckets for t in (b.master, b.remainder, b.ties) if t is not None]
        states = [t for b in self.buckets for t in state_tensors(b.optimizer)]
        return [(PARAMETERS, masters), (OPTIMIZER_STATES, states)]

    # checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"world": self.comm.world, "zero_stage": self.setup.zero_stage, "buckets": len(self.buckets),
                "states_pending": self.tier_pending, "states_why": self.parked_why}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run whose activation plan comes from the checkpoint (no profiling) keeps the states
        where the saved run's planner settled them (`StatesTier.settle_tier`)."""
        if self.tier_pending and state.get("states_pending") is False:
            self.settle_tier(bool(state.get("states_why")), state.get("states_why") or "")

    # removal ------------------------------------------------------------------------------------
    def remove(self) -> None:
        """Hand the optimizer state back to the engine's basic optimizer, then undo every hook."""
        if self.engine is not None and self.buckets:
            self.pipeline.discard_all()
            for bucket in self.buckets:
                bucket.materialize()  # the optimizer's views hold the masters again
            hand_back(self.buckets)
            self.path.remove()
            self.buckets = []
        super().remove()


def _dtype_runs(order: list[tuple[str, torch.nn.Parameter]],
                owner: Callable[[torch.nn.Parameter], Any] = lambda p: None) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive parameters of one dtype and one ``owner`` (a bucket holds a single dtype and is
    stepped by a clone of one optimizer)."""
    runs: list[list[tuple[str, torch.nn.Parameter]]] = []
    for name, param in order:
        if runs and runs[-1][-1][1].dtype == param.dtype and owner(runs[-1][-1][1]) is owner(param):
            runs[-1].append((name, param))
        else:
            runs.append([(name, param)])
    return runs


__all__ = ["GradReleasePlugin"]
