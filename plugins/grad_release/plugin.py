"""The grad_release plugin: attaches the fused step to a DeepSpeed engine.

Seams (the design is in ``docs/grad_release.md``):

* ``prepare_ds_config``: read precision, ZeRO stage and clipping from the ds_config, refuse what
  cannot work, hand DeepSpeed a copy without them (`ds_config.py`).
* ``prepare_model``: cast parameters to fp16/bf16 as DeepSpeed would have.
* ``attach``: plan buckets over the basic optimizer's parameters, build each bucket's master slices
  and optimizer, register one post-accumulate-grad hook per parameter, wrap ``engine.backward``,
  ``engine.step``, ``save_checkpoint`` and ``load_checkpoint`` on this engine instance.
* ``remove``: hand the optimizer state back to the basic optimizer, undo every hook and wrapper.

``engine.backward(loss)`` keeps its meaning: it runs backward; in the last micro-step of an
accumulation it also applies the optimizer update, bucket by bucket. ``engine.step()`` keeps its
meaning for everything around the update: it advances ``global_steps``, ``global_samples`` and
``micro_steps``, steps the LR scheduler unless the step was skipped, and counts ``skipped_steps``.
"""
from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from xirang_ds.config.schema import GradReleaseConfig
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import CallbackHandle, wrap_method
from xirang_ds.memory.categories import GRADIENTS, OPTIMIZER_STATES, PARAMETERS
from xirang_ds.registry import Plugin, register_plugin

if TYPE_CHECKING:  # pragma: no cover
    from xirang_ds.checkpoints.param_states import ParamStates

logger = logging.getLogger("xirang_ds")


@register_plugin(GradReleaseConfig, section="grad_release", order=50)
class GradReleasePlugin(Plugin):
    """Optimizer step fused into backward, with data parallel, accumulation, clipping and fp16.

    Under Megatron-core it replaces DDP's gradient buffer and Megatron's optimizer step
    (`megatron.py` has the design; `_attach_megatron`).

    Attributes:
        setup: what the user's ds_config asked for (`ds_config.TrainingSetup`).
        buckets: this rank's buckets in launch order (after ``attach``).
        pipeline: the per-backward machinery (`pipeline.ReleasePipeline`).
        policy: passes, multipliers, loss scale and step outcomes (`policy.ReleasePolicy`).
    """

    frameworks = ("deepspeed", "megatron")
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
        self.freed_bytes = 0  # Megatron: bytes of DDP's gradient buffer freed
        self._applied_at_micro_step: Optional[int] = None
        self._micro = 0  # Megatron: backwards since the last optimizer step

    @classmethod
    def check_framework(cls, config: GradReleaseConfig, framework: str) -> list[tuple[str, str]]:
        problems = super().check_framework(config, framework)
        if framework == "megatron" and config.exact_method == "two_pass":
            problems.append(("exact_method", "xirang.grad_release.exact_method = \"two_pass\" runs backward twice, "
                                             "and under Megatron backward is Megatron's schedule's; allowed there: "
                                             "\"hold\". Fix: set exact_method to \"hold\""))
        return problems

    @classmethod
    def check_ds_config(cls, config: GradReleaseConfig, ds_config: dict) -> list[tuple[str, str]]:
        from xirang_ds.plugins.grad_release.ds_config import read_setup

        try:
            read_setup(ds_config, config)
        except XirangConfigError as e:
            return list(e.problems)
        return []

    @classmethod
    def preset_fallbacks(cls, config: GradReleaseConfig, ds_config: dict) -> list[tuple[str, Any, str]]:
        from xirang_ds.plugins.grad_release.ds_config import parameter_dtype

        dtype = parameter_dtype(ds_config)
        if config.masters == "none" and dtype != torch.bfloat16:
            return [("masters", "auto", f"'none' (no master, bf16 weights rounded stochastically) needs bf16 "
                                        f"parameters and this run trains in {str(dtype).replace('torch.', '')}; "
                                        "masters stay \"auto\"")]
        return []

    # seams before DeepSpeed -----------------------------------------------------------------
    def prepare_ds_config(self, ds_config: dict) -> None:
        from xirang_ds.plugins.grad_release.ds_config import hand_over, read_setup

        self.setup = read_setup(ds_config, self.config)
        hand_over(ds_config)

    def prepare_model(self, model: Any) -> None:
        from xirang_ds.plugins.grad_release.ds_config import cast_model

        if self.setup is None:
            return  # Megatron: its own modules decide the dtype (only fp32 is taken over, see attach)
        cast_model(model, self.setup.param_dtype)

    def prepare_optimizer(self, optimizer: Any) -> Any:
        if optimizer is None:
            raise XirangConfigError([("", "xirang.grad_release needs an optimizer to step during backward, and "
                                          "neither a client optimizer nor an \"optimizer\" block was given. Fix: pass "
                                          "optimizer= to initialize or add an \"optimizer\" block")])
        return optimizer

    # attach ------------------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        if self.session.framework == "megatron":
            self._attach_megatron(engine)
            return
        from xirang_ds.plugins.grad_release.comm import DataParallelComm
        from xirang_ds.plugins.grad_release.ds_config import make_loss_scaler
        from xirang_ds.plugins.grad_release.pipeline import ReleasePipeline
        from xirang_ds.plugins.grad_release.policy import ReleasePolicy

        self.engine = engine
        self._check_engine(engine)
        self.comm = DataParallelComm(engine.seq_data_parallel_group)
        sharded = self.setup.zero_stage >= 1 and self.comm.world > 1
        self.buckets = self._build_buckets(engine, sharded)
        total = sum(b.layout.numels[i] for b in self.buckets for i in range(len(b.params)))
        self.policy = ReleasePolicy(self.comm, sharded, self.setup.gradient_clipping, self.config.clipping,
                                    self.config.exact_method, self.setup.skip_nonfinite,
                                    make_loss_scaler(self.setup), total)
        self.policy.hold_updates = self._retries_oom()
        tracker = self.session.tracker
        self.pipeline = ReleasePipeline(self.buckets, self.config.overlap_comm,
                                        stash_held=self.config.exact_method == "host",
                                        on_grad_seen=lambda g: tracker.mark(g, GRADIENTS) if tracker.active else None)
        for bucket in self.buckets:
            for param in bucket.params:
                self.keep(param.register_post_accumulate_grad_hook(self.pipeline.on_grad))
        self.keep(wrap_method(engine, "backward", self._backward))
        self.keep(wrap_method(engine, "step", self._step))
        self.keep(wrap_method(engine, "save_checkpoint", self._save_checkpoint))
        self.keep(wrap_method(engine, "load_checkpoint", self._load_checkpoint))
        previous = engine.enable_backward_allreduce
        engine.enable_backward_allreduce = False
        self.keep(CallbackHandle(lambda: setattr(engine, "enable_backward_allreduce", previous)))
        self.keep(self.session.add_memory_roles(self._memory_roles))

    def _attach_megatron(self, run: Any) -> None:
        """Take over Megatron DDP's gradient path and Megatron's optimizer step (`megatron.py`)."""
        from megatron.core import parallel_state

        from xirang_ds.compat.megatron import optimizer_configs, unwrap
        from xirang_ds.plugins.grad_release.comm import DataParallelComm
        from xirang_ds.plugins.grad_release.ds_config import BF16_MASTERS, TrainingSetup
        from xirang_ds.plugins.grad_release.megatron import DdpTakeover, norm_counted, problems
        from xirang_ds.plugins.grad_release.pipeline import ReleasePipeline
        from xirang_ds.plugins.grad_release.policy import ReleasePolicy

        self.engine = run
        clip_grads = [float(c.clip_grad) for c in optimizer_configs(run.optimizer)]
        issues = problems(self.config, run, clip_grads)
        if self.config.masters in BF16_MASTERS:
            issues.append(("xirang.grad_release.masters", f"{self.config.masters!r} is for bf16 parameters' masters, and under "
                           "Megatron grad_release takes over fp32 parameters only (its Float16 optimizer keeps the "
                           "masters); allowed: \"auto\" or \"fp32\". Fix: remove the key"))
        if issues:
            raise XirangConfigError(issues)
        self.setup = TrainingSetup(zero_stage=0, param_dtype=torch.float32,
                                   gradient_clipping=clip_grads[0] if clip_grads else 0.0,
                                   comm_dtype=torch.float32, fp16=None,
                                   skip_nonfinite=self.config.nonfinite == "skip_step")
        self.comm = DataParallelComm(parallel_state.get_data_parallel_group(), dist=torch.distributed)
        tp_comm = DataParallelComm(parallel_state.get_tensor_model_parallel_group(), dist=torch.distributed)
        model = unwrap(run.module)
        self.buckets = self._plan_buckets(model, list(run.basic_optimizers), sharded=False)
        tp_rank = tp_comm.rank
        for bucket in self.buckets:
            bucket.norm_counted = [norm_counted(p, tp_rank) for p in bucket.params]
        total = sum(p.numel() for b in self.buckets for p in b.params)
        self.policy = ReleasePolicy(self.comm, False, self.setup.gradient_clipping, self.config.clipping,
                                    self.config.exact_method, self.setup.skip_nonfinite, None, total,
                                    norm_comms=[tp_comm])
        tracker = self.session.tracker
        self.pipeline = ReleasePipeline(self.buckets, self.config.overlap_comm,
                                        stash_held=self.config.exact_method == "host",
                                        on_grad_seen=lambda g: tracker.mark(g, GRADIENTS) if tracker.active else None)
        for bucket in self.buckets:
            for param in bucket.params:
                self.keep(param.register_post_accumulate_grad_hook(self._on_megatron_grad))
        if hasattr(run.module, "param_to_bucket_group"):  # Megatron DDP
            self.freed_bytes = self.keep(DdpTakeover(run.module)).freed_bytes
        run.applied_update = self._megatron_update
        self.keep(CallbackHandle(lambda: setattr(run, "applied_update", None)))
        self.keep(wrap_method(run.optimizer, "state_dict", self._megatron_state_dict))
        self.keep(wrap_method(run.optimizer, "load_state_dict", self._megatron_load_state_dict))
        self.keep(wrap_method(run.optimizer, "sharded_state_dict", self._megatron_sharded_state_dict))
        self.keep(self.session.add_memory_roles(self._memory_roles))

    # Megatron: backward and step ----------------------------------------------------------------
    def _on_megatron_grad(self, param: torch.Tensor) -> None:
        if self.pipeline.kind is None:
            self._begin_megatron_backward()
        self.pipeline.on_grad(param)

    def _begin_megatron_backward(self) -> None:
        from xirang_ds.compat.torch import queue_end_of_backward
        from xirang_ds.plugins.grad_release.pipeline import Pass

        expected = int(self.engine.gradient_accumulation_steps())
        micro = self._micro + 1
        if micro > expected:
            raise RuntimeError(f"xirang.grad_release: backward number {micro} since the last optimizer.step(), but a "
                               f"step has {expected} micro-batch(es) (Megatron's num_microbatches) and the update was "
                               "applied in the last one. Call optimizer.step() after each forward_backward_func, or "
                               "pass attach(num_microbatches=...) the number the schedule runs")
        kind = self.policy.passes(micro == expected)[0]
        self.pipeline.begin(kind, self.policy.rule() if kind in (Pass.FUSED, Pass.UPDATE) else None)
        queue_end_of_backward(self._end_megatron_backward)

    def _end_megatron_backward(self) -> None:
        kind = self.pipeline.kind
        try:
            sumsq = self.pipeline.finish()
        except BaseException:
            self.pipeline.abort()
            raise
        self._micro += 1
        self._after_pass(kind, sumsq)

    def _megatron_update(self) -> tuple[bool, Optional[float], None]:
        """``optimizer.step()`` after the update was applied in backward: Megatron's return value."""
        expected = int(self.engine.gradient_accumulation_steps())
        micro, self._micro = self._micro, 0
        if micro != expected:
            self.pipeline.discard_all()
            raise RuntimeError(f"xirang.grad_release: optimizer.step() after {micro} backward pass(es), but a step "
                               f"has {expected} micro-batch(es) (Megatron's num_microbatches); the update is applied in "
                               f"backward number {expected}, so this step's gradients were dropped. Pass "
                               "attach(num_microbatches=...) the number the schedule runs")
        outcome, self.policy.outcome = self.policy.outcome, None
        if outcome is None:
            return True, None, None
        return not outcome.skipped, outcome.grad_norm, None

    # Megatron: checkpoints ------------------------------------------------------------------------
    def _megatron_state_dict(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """Megatron's optimizer state dict holding the buckets' states, as its own step would hold them."""
        from xirang_ds.plugins.grad_release.megatron import StateLoan

        loan = StateLoan(self.buckets)
        loan.lend()
        try:
            state = original(*args, **kwargs)
        finally:
            loan.clear()
        return state

    def _megatron_load_state_dict(self, original: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        """Megatron loads the states into its torch optimizers; they move into the buckets (a checkpoint of
        plain Megatron, or one saved with grad_release: the same layout)."""
        from xirang_ds.plugins.grad_release.megatron import StateLoan

        self.pipeline.discard_all()
        result = original(state_dict, *args, **kwargs)
        for bucket in self.buckets:
            bucket.build_masters()  # fresh optimizers; a parameter without a saved state starts fresh
        StateLoan(self.buckets).take_back()
        return result

    def _megatron_sharded_state_dict(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("xirang.grad_release: Megatron's distributed checkpoint (sharded_state_dict; Megatron-LM "
                           "--ckpt-format torch_dist) is not supported under grad_release. Fix: save with "
                           "--ckpt-format torch (optimizer.state_dict()), which carries grad_release's states")

    def _check_engine(self, engine: Any) -> None:
        from xirang_ds.compat.deepspeed import protocol_holds

        problems = [("", f"xirang.grad_release: {m}; this DeepSpeed version is not supported")
                    for m in protocol_holds()]
        if type(engine).__name__ == "PipelineEngine":
            problems.append(("", "xirang.grad_release cannot run under pipeline parallelism (a PipelineModule): the "
                                 "pipeline engine schedules its own backward and reduction. Fix: disable "
                                 "xirang.grad_release for pipeline-parallel runs"))
        if getattr(engine, "has_moe_layers", False):
            problems.append(("", "xirang.grad_release cannot run with MoE layers: expert parameters reduce over "
                                 "expert-parallel groups. Fix: disable xirang.grad_release for MoE models"))
        if engine.optimizer is not engine.basic_optimizer:
            problems.append(("", f"xirang.grad_release expected DeepSpeed to use the basic optimizer directly, but "
                                 f"it wrapped it in {type(engine.optimizer).__name__} (another plugin changed the "
                                 "precision or ZeRO settings after grad_release?). Fix: disable one of them"))
        if problems:
            raise XirangConfigError(problems)

    def _build_buckets(self, engine: Any, sharded: bool) -> list[Any]:
        return self._plan_buckets(engine.module, [engine.basic_optimizer], sharded)

    def _plan_buckets(self, module: torch.nn.Module, optimizers: list[Any], sharded: bool) -> list[Any]:
        """Buckets over ``module``'s trainable parameters in reverse registration order, each within one
        dtype and one of ``optimizers`` (cloned for the bucket; Megatron has one per param-group kind)."""
        from xirang_ds.plugins.grad_release.bucket import Bucket
        from xirang_ds.plugins.grad_release.layout import BucketLayout, auto_bucket_numel, plan_buckets
        from xirang_ds.plugins.grad_release.optimizers import optimizer_problems

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
        self.bucket_numel = (auto_bucket_numel(total) if self.config.bucket_size_numel == "auto"
                             else int(self.config.bucket_size_numel))
        world = self.comm.world if sharded else 1
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
                                          masters=self._masters))
                except TypeError as e:
                    raise XirangConfigError([("", f"xirang.grad_release: the optimizer {type(basic).__name__} cannot "
                                                  f"be rebuilt as type(opt)(param_groups, **opt.defaults) for each "
                                                  f"bucket ({e}). Fix: use a torch.optim optimizer, or disable "
                                                  "xirang.grad_release")]) from None
        return buckets

    def adjust_estimate(self, phases: dict, shape: Any, numels: list) -> Optional[dict]:
        """Model states as the buckets hold them and gradients a bucket at a time (the table under
        "One step of a bucket" in docs/grad_release.md): 16-bit parameters whole, fp32 masters and
        Adam states over this rank's shard (masters as remainders: 2 bytes and a tie bit per element,
        rebuilt for a bucket's update; ``none``: no master, the weights widened for the update and
        rounded back a chunk at a time), one bucket filling and one reducing, this rank's shard
        held until backward ends when exact clipping uses ``hold``, and the update's temporaries in
        backward, one bucket shard at a time. There is no separate optimizer-step phase."""
        from xirang_ds.memory.estimator import BACKWARD_START, STEP_PREPARE, _adam_temporaries
        from xirang_ds.plugins.grad_release.layout import auto_bucket_numel

        if not numels:
            return phases
        total = sum(numels)
        lp = shape.lp_bytes
        world = shape.world_size if shape.stage >= 1 and shape.world_size > 1 else 1
        part = sum(math.ceil(n / world) for n in numels)
        bucket = auto_bucket_numel(total) if self.config.bucket_size_numel == "auto" else int(self.config.bucket_size_numel)
        bucket = max(bucket, max(numels))  # a larger parameter gets a bucket of its own
        kind = self._masters if shape.dtype == torch.bfloat16 else "fp32"
        masters = {"fp32": 4 * part, "remainders": 2 * part + math.ceil(part / 8), "none": 0}[kind] if lp != 4 else 0
        states = 8 * part
        if self.session.plugin("optimizer_states") is not None:
            states = phases["forward"].get(OPTIMIZER_STATES, states)  # that plugin's own model (it runs first)
        clipping = self.setup.gradient_clipping if self.setup is not None else 0.0
        fp16 = self.setup is not None and self.setup.fp16 is not None
        holds = self.config.exact_method == "hold" and (clipping > 0 and self.config.clipping == "exact" or fp16
                                                        or self._retries_oom())
        accum = 4 * part if shape.grad_accum > 1 else 0
        in_flight = (2 if self.config.overlap_comm else 1) * lp * bucket
        shard = math.ceil(bucket / world)
        # the update (bucket.py ``apply``): the bucket shard's fp32 gradient, then with remainders its
        # master rebuilt from a 16-bit copy of its weights (freed once joined; ``none``: widened in
        # place), then the optimizer over the parameters' pieces, one at a time for torch's
        # single-tensor Adam; ``none`` then rounds the master into the 16-bit shard, the noise and
        # the finite mask a chunk at a time (5 bytes an element), the gradient freed by then
        from xirang_ds.plugins.grad_release.stochastic import CHUNK_NUMEL

        piece = min(shard, math.ceil(max(numels) / world))
        adam = _adam_temporaries(shape, [piece] if shape.adam_impl == "single_tensor" else [shard])
        update = {"fp32": 4 * shard + adam, "remainders": max(10 * shard, 8 * shard + adam),
                  "none": max(8 * shard + adam, 6 * shard + 5 * min(shard, CHUNK_NUMEL))}[kind]
        out = {}
        for name, cats in phases.items():
            cats = dict(cats)
            cats[PARAMETERS] = lp * total + masters
            cats[OPTIMIZER_STATES] = states
            cats[GRADIENTS] = accum
            cats["comm_buffers"] = 0
            if name == "backward":
                # early in backward, before the first bucket is full, the activations are all there
                # with the loss's gradient temporaries; at its end the activations are gone, buckets
                # are in flight and updating, and the held shard (if any) is whole
                late = {**cats, "activations": 0, "comm_buffers": in_flight,
                        "temporaries": update,
                        GRADIENTS: accum + (lp * part if holds else 0) + lp * max(numels)}
                if sum(late.values()) > sum(cats.values()):
                    cats = late
            elif name == BACKWARD_START:
                # the first gradient autograd makes (the output head's, where the model has one: the
                # largest parameter) exists whole before its hook copies it into a bucket
                cats[GRADIENTS] = accum + lp * max(numels)
            elif name in ("optimizer_step", STEP_PREPARE):
                cats["temporaries"] = 0
                cats["activations"] = 0
            out[name] = cats
        return out

    def describe(self) -> str:
        if self.session.framework == "megatron":
            clip = (f"clipping {self.setup.gradient_clipping} ({self.config.clipping}, norm over the tensor-parallel "
                    "group)" if self.setup.gradient_clipping > 0 else "no clipping")
            return (f"step in backward instead of Megatron DDP's gradient buffer ({self.freed_bytes:,} bytes freed) "
                    f"and optimizer step, over {self.comm.world} data-parallel rank(s): {len(self.buckets)} buckets of "
                    f"<= {self.bucket_numel:,} elements, optimizer states replicated, {clip}")
        stage = self.setup.zero_stage
        shards = f"sharded 1/{self.comm.world}" if self.policy.sharded else "replicated"
        masters = (" (as bf16 remainders, exact)" if any(b.remainders for b in self.buckets) else
                   " (none: bf16 weights rounded stochastically)" if any(b.masters == "none" for b in self.buckets)
                   else "")
        clip = (f"clipping {self.setup.gradient_clipping} ({self.config.clipping}"
                + (f", {self.config.exact_method}" if self.config.clipping != "per_layer" else "") + ")"
                if self.setup.gradient_clipping > 0 else "no clipping")
        return (f"step in backward, ZeRO-{stage} semantics over {self.comm.world} rank(s): {len(self.buckets)} buckets "
                f"of <= {self.bucket_numel:,} elements, masters{masters} and optimizer states {shards}, {clip}"
                + (f", updates held to the end of backward ({self.config.exact_method}) for on_oom"
                   if self.policy.hold_updates else "")
                + (", fp16 loss scaling" if self.setup.fp16 is not None else ""))

    # engine.backward / engine.step --------------------------------------------------------------
    def _backward(self, original: Any, loss: torch.Tensor, retain_graph: bool = False,
                  scale_wrt_gas: bool = True) -> Any:
        from xirang_ds.plugins.grad_release.pipeline import Pass

        engine = self.engine
        if engine.inside_no_sync_ctxt:
            raise RuntimeError("xirang.grad_release: engine.backward inside engine.no_sync() is not supported: "
                               "grad_release reduces every micro-step's gradients during backward")
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary and self._applied_at_micro_step == engine.micro_steps:
            raise RuntimeError("xirang.grad_release: this step's update was already applied in the previous "
                               "engine.backward (the last micro-step of the accumulation); call engine.step() "
                               "before the next backward")
        passes = self.policy.passes(boundary)
        scaling = None
        if self.policy.loss_scaler is not None and loss.requires_grad:
            scale = self.policy.loss_scale
            scaling = loss.register_hook(lambda grad: grad * scale)
        try:
            result = None
            for n, kind in enumerate(passes):
                rule = self.policy.rule() if kind in (Pass.FUSED, Pass.UPDATE) else None
                self.pipeline.begin(kind, rule)
                try:
                    result = original(loss, retain_graph=retain_graph if n == len(passes) - 1 else True,
                                      scale_wrt_gas=scale_wrt_gas)
                    sumsq = self.pipeline.finish()
                except BaseException:
                    self.pipeline.abort()
                    raise
                if not self._after_pass(kind, sumsq):
                    break
        finally:
            if scaling is not None:
                scaling.remove()
        if boundary:
            self._applied_at_micro_step = engine.micro_steps
        return result

    def _after_pass(self, kind: Any, sumsq: Optional[torch.Tensor]) -> bool:
        """Act on a finished pass; False stops the passes of this backward (step skipped)."""
        from xirang_ds.plugins.grad_release.pipeline import Pass

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

    def _retries_oom(self) -> bool:
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

    def _step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        from xirang_ds.compat.deepspeed import step_protocol

        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            return original(*args, **kwargs)
        outcome, self.policy.outcome = self.policy.outcome, None
        skipped = outcome.skipped if outcome is not None else False
        norm = outcome.grad_norm if outcome is not None else None
        with step_protocol(engine.optimizer, skipped, norm):
            return original(*args, **kwargs)

    # memory roles -------------------------------------------------------------------------------
    def _memory_roles(self) -> list[tuple[str, Any]]:
        from xirang_ds.plugins.grad_release.optimizers import state_tensors

        masters = [t for b in self.buckets for t in (b.master, b.remainder, b.ties) if t is not None]
        states = [t for b in self.buckets for t in state_tensors(b.optimizer)]
        return [(PARAMETERS, masters), (OPTIMIZER_STATES, states)]

    # checkpoints --------------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {"world": self.comm.world, "zero_stage": self.setup.zero_stage,
                "buckets": [b.fingerprint() for b in self.buckets]}

    def state_dict(self) -> dict:
        return {"world": self.comm.world, "zero_stage": self.setup.zero_stage, "buckets": len(self.buckets)}

    def _save_checkpoint(self, original: Any, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Each rank writes its file first; then DeepSpeed writes its files and the ``latest`` pointer."""
        from xirang_ds.plugins.grad_release.checkpoint import save_rank_state

        name = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"  # DeepSpeed's default
        if any(b.acc is not None for b in self.buckets) and self.engine.global_rank == 0:
            logger.warning("xirang grad_release: checkpoint saved in the middle of a gradient accumulation; the "
                           "accumulated gradients are not saved (DeepSpeed does not save them either)")
        save_rank_state(os.path.join(save_dir, name), self.comm.rank, self._layout(), self.policy, self.buckets)
        return original(save_dir, tag, *args, **kwargs)

    def _load_checkpoint(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed loads weights, hyperparameters and counters; then this rank's file, unless told not to."""
        from xirang_ds.checkpoints.tags import resolve_tag
        from xirang_ds.plugins.grad_release.checkpoint import load_rank_state, saved_basic_groups
        from xirang_ds.session import load_checkpoint_options

        options = load_checkpoint_options(self.engine, *args, **kwargs)
        self.pipeline.discard_all()
        handle = None
        if options["load_optimizer_states"] and not options["load_module_only"]:
            groups = saved_basic_groups(resolve_tag(options["load_dir"], options["tag"]))
            if groups is not None:  # the basic optimizer's own groups (at stage 0 the entry is plain DeepSpeed's)
                handle = wrap_method(self.engine.optimizer, "load_state_dict",
                                     lambda load, _entry: load({"state": {}, "param_groups": groups}))
        try:
            load_path, client_state = original(*args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        if load_path is None:
            return load_path, client_state
        if not options["load_optimizer_states"] or options["load_module_only"]:
            for bucket in self.buckets:
                bucket.build_masters()  # fresh optimizer states from the loaded weights
        else:
            load_rank_state(os.path.dirname(load_path), self.comm.rank, self._layout(), self.policy, self.buckets)
        return load_path, client_state

    def layout_differs(self, tag_dir: str) -> bool:
        """True if the tag holds grad_release shards of another layout (world size, stage, buckets)."""
        from xirang_ds.plugins.grad_release.checkpoint import load_shard, mismatch, shard_path

        path = shard_path(tag_dir, self.comm.rank)
        if not os.path.isfile(path):
            return True
        return bool(mismatch(load_shard(path, mmap=True), self._layout()))

    def take_over(self, states: "ParamStates") -> None:
        """Continue from another owner's optimizer state (plain DeepSpeed's ZeRO files, or this
        plugin's with another layout or optimizer): every bucket's masters and optimizer states are
        cut from the whole per-parameter states, and the fp16 loss scale is taken over."""
        from xirang_ds.checkpoints.param_states import Fragment, Slot, load_slots, set_hyperparameters

        # the buckets' optimizers copy these before every step; an LR scheduler drives them
        set_hyperparameters(self.engine.optimizer, {p: n for n, p in self.engine.module.named_parameters()}, states)
        for bucket in self.buckets:
            if bucket.optimizer is None:
                continue
            slots = [Slot(view, [Fragment(bucket.names[piece.index], piece.start, piece.numel, 0)])
                     for piece, view in zip(bucket.pieces, bucket.views)]
            with bucket.fp32_masters(write_params=True):
                load_slots(bucket.optimizer, slots, states)
            bucket.steps_applied = max((int(st["step"]) for st in bucket.optimizer.state.values() if "step" in st),
                                       default=0)
        if states.loss_scale and self.policy.loss_scaler is not None:
            self.policy.load_state_dict({"previous_norm": None, "loss_scaler": states.loss_scale})

    # removal ------------------------------------------------------------------------------------
    def remove(self) -> None:
        """Hand the optimizer state back to the engine's basic optimizer, then undo every hook."""
        if self.engine is not None and self.buckets:
            from xirang_ds.compat.deepspeed import restore_gradient_clipping
            from xirang_ds.plugins.grad_release.handback import hand_back

            self.pipeline.discard_all()
            for bucket in self.buckets:
                bucket.materialize()  # the optimizer's views hold the masters again
            hand_back(self.buckets)
            if self.session.framework == "megatron":
                self.buckets = []
                super().remove()  # DDP gets its gradient buffer back; Megatron's optimizer steps again
                return
            restore_gradient_clipping(self.engine, self.setup.gradient_clipping)
            if self.setup.param_dtype != torch.float32 and self.engine.global_rank == 0:
                logger.warning("xirang grad_release removed: the engine continues without fp32 master weights "
                               "(DeepSpeed built it at stage 0 without a precision wrapper); optimizer states were "
                               "cast to %s", str(self.setup.param_dtype).replace("torch.", ""))
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
