"""grad_release under DeepSpeed: ``engine.backward`` runs the update, ``engine.step`` reports it.

``engine.backward(loss)`` keeps its meaning: it runs backward; in the last micro-step of an
accumulation it also applies the optimizer update, bucket by bucket. ``engine.step()`` keeps its
meaning for everything around the update: it advances ``global_steps``, ``global_samples`` and
``micro_steps``, steps the LR scheduler unless the step was skipped, and counts ``skipped_steps``
(`xirang_ds.compat.deepspeed.step_protocol`). Checkpoints: each rank writes its shard of masters and
optimizer states beside DeepSpeed's files (`checkpoint.py`); another owner's state is taken over.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from xirang_ds.checkpoints.engine_files import load_checkpoint_options
from xirang_ds.checkpoints.param_states import Fragment, Slot, load_slots, set_hyperparameters
from xirang_ds.checkpoints.tags import resolve_tag
from xirang_ds.compat.deepspeed import protocol_holds, restore_gradient_clipping, step_protocol
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import CallbackHandle, wrap_method
from xirang_ds.plugins.grad_release.checkpoint import (
    load_rank_state,
    load_shard,
    mismatch,
    save_rank_state,
    saved_basic_groups,
    shard_path,
)
from xirang_ds.plugins.grad_release.comm import DataParallelComm
from xirang_ds.plugins.grad_release.ds_config import make_loss_scaler
from xirang_ds.plugins.grad_release.pipeline import Pass
from xirang_ds.plugins.grad_release.policy import ReleasePolicy
from xirang_ds.registry import FrameworkPath

if TYPE_CHECKING:  # pragma: no cover
    from xirang_ds.checkpoints.param_states import ParamStates

logger = logging.getLogger("xirang_ds")


class DeepSpeedRelease(FrameworkPath):
    """The DeepSpeed engine's backward, step and checkpoints, with the update applied in backward."""

    parks_states = True
    """``states: auto`` may move the buckets' optimizer states to host memory (checkpoints read them there)."""

    def attach(self, engine: Any) -> None:
        p = self.plugin
        p.engine = engine
        self._check_engine(engine)
        p.comm = DataParallelComm(engine.seq_data_parallel_group)
        sharded = p.setup.zero_stage >= 1 and p.comm.world > 1
        p.buckets = p.plan_buckets(engine.module, [engine.basic_optimizer], sharded)
        total = sum(b.layout.numels[i] for b in p.buckets for i in range(len(b.params)))
        p.policy = ReleasePolicy(p.comm, sharded, p.setup.gradient_clipping, p.config.clipping,
                                 p.config.exact_method, p.setup.skip_nonfinite, make_loss_scaler(p.setup), total)
        p.policy.hold_updates = p.retries_oom()
        p.start_pipeline()
        p.keep(wrap_method(engine, "backward", self._backward))
        p.keep(wrap_method(engine, "step", self._step))
        p.keep(wrap_method(engine, "save_checkpoint", self._save_checkpoint))
        p.keep(wrap_method(engine, "load_checkpoint", self._load_checkpoint))
        previous = engine.enable_backward_allreduce
        engine.enable_backward_allreduce = False
        p.keep(CallbackHandle(lambda: setattr(engine, "enable_backward_allreduce", previous)))

    @staticmethod
    def _check_engine(engine: Any) -> None:
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

    def describe(self) -> str:
        p = self.plugin
        stage = p.setup.zero_stage
        shards = f"sharded 1/{p.comm.world}" if p.policy.sharded else "replicated"
        masters = (" (as 8-bit remainders: 16 significant bits, rounded stochastically)"
                   if any(b.masters == "remainders_8bit" for b in p.buckets) else
                   " (as bf16 remainders, exact)" if any(b.remainders for b in p.buckets) else
                   " (none: bf16 weights rounded stochastically)" if any(b.masters == "none" for b in p.buckets)
                   else "")
        clip = (f"clipping {p.setup.gradient_clipping} ({p.config.clipping}"
                + (f", {p.exact_method_now()}" if p.config.clipping != "per_layer" else "") + ")"
                if p.setup.gradient_clipping > 0 else "no clipping")
        host = (" in host memory until the activation planner settles them (states auto)" if p.tier_pending else
                " in host memory between updates" + (f" (states auto: {p.parked_why})" if p.parked_why else "")
                if any(b.states_on == "host" for b in p.buckets) else "")
        return (f"step in backward, ZeRO-{stage} semantics over {p.comm.world} rank(s): {len(p.buckets)} buckets "
                f"of <= {p.bucket_numel:,} elements, masters{masters} and optimizer states {shards}{host}, {clip}"
                + (f", updates held to the end of backward ({p.exact_method_now()}) for on_oom"
                   if p.policy.hold_updates else "")
                + (", fp16 loss scaling" if p.setup.fp16 is not None else ""))

    # engine.backward / engine.step --------------------------------------------------------------
    def _backward(self, original: Any, loss: torch.Tensor, retain_graph: bool = False,
                  scale_wrt_gas: bool = True) -> Any:
        p = self.plugin
        engine = p.engine
        if engine.inside_no_sync_ctxt:
            raise RuntimeError("xirang.grad_release: engine.backward inside engine.no_sync() is not supported: "
                               "grad_release reduces every micro-step's gradients during backward")
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary and p._applied_at_micro_step == engine.micro_steps:
            raise RuntimeError("xirang.grad_release: this step's update was already applied in the previous "
                               "engine.backward (the last micro-step of the accumulation); call engine.step() "
                               "before the next backward")
        passes = p.policy.passes(boundary)
        scaling = None
        if p.policy.loss_scaler is not None and loss.requires_grad:
            scale = p.policy.loss_scale
            scaling = loss.register_hook(lambda grad: grad * scale)
        try:
            result = None
            for n, kind in enumerate(passes):
                rule = p.policy.rule() if kind in (Pass.FUSED, Pass.UPDATE) else None
                p.pipeline.begin(kind, rule)
                try:
                    result = original(loss, retain_graph=retain_graph if n == len(passes) - 1 else True,
                                      scale_wrt_gas=scale_wrt_gas)
                    sumsq = p.pipeline.finish()
                except BaseException:
                    p.pipeline.abort()
                    raise
                if not p.after_pass(kind, sumsq):
                    break
        finally:
            p.pipeline.forget_uses()
            if scaling is not None:
                scaling.remove()
        if boundary:
            p._applied_at_micro_step = engine.micro_steps
        return result

    def _step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        p = self.plugin
        engine = p.engine
        if not engine.is_gradient_accumulation_boundary():
            return original(*args, **kwargs)
        p.settle_pending()
        outcome, p.policy.outcome = p.policy.outcome, None
        skipped = outcome.skipped if outcome is not None else False
        norm = outcome.grad_norm if outcome is not None else None
        with step_protocol(engine.optimizer, skipped, norm):
            return original(*args, **kwargs)

    # checkpoints --------------------------------------------------------------------------------
    def _layout(self) -> dict:
        p = self.plugin
        return {"world": p.comm.world, "zero_stage": p.setup.zero_stage,
                "buckets": [b.fingerprint() for b in p.buckets]}

    def _save_checkpoint(self, original: Any, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Each rank writes its file first; then DeepSpeed writes its files and the ``latest`` pointer."""
        p = self.plugin
        name = str(tag) if tag is not None else f"global_step{p.engine.global_steps}"  # DeepSpeed's default
        if any(b.acc is not None for b in p.buckets) and p.engine.global_rank == 0:
            logger.warning("xirang grad_release: checkpoint saved in the middle of a gradient accumulation; the "
                           "accumulated gradients are not saved (DeepSpeed does not save them either)")
        save_rank_state(os.path.join(save_dir, name), p.comm.rank, self._layout(), p.policy, p.buckets)
        return original(save_dir, tag, *args, **kwargs)

    def _load_checkpoint(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed loads weights, hyperparameters and counters; then this rank's file, unless told not to."""
        p = self.plugin
        options = load_checkpoint_options(p.engine, *args, **kwargs)
        p.pipeline.discard_all()
        handle = None
        if options["load_optimizer_states"] and not options["load_module_only"]:
            groups = saved_basic_groups(resolve_tag(options["load_dir"], options["tag"]))
            if groups is not None:  # the basic optimizer's own groups (at stage 0 the entry is plain DeepSpeed's)
                handle = wrap_method(p.engine.optimizer, "load_state_dict",
                                     lambda load, _entry: load({"state": {}, "param_groups": groups}))
        try:
            load_path, client_state = original(*args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        if load_path is None:
            return load_path, client_state
        if not options["load_optimizer_states"] or options["load_module_only"]:
            for bucket in p.buckets:
                bucket.build_masters()  # fresh optimizer states from the loaded weights
        else:
            load_rank_state(os.path.dirname(load_path), p.comm.rank, self._layout(), p.policy, p.buckets)
        return load_path, client_state

    def layout_differs(self, tag_dir: str) -> bool:
        """True if the tag holds grad_release shards of another layout (world size, stage, buckets)."""
        p = self.plugin
        path = shard_path(tag_dir, p.comm.rank)
        if not os.path.isfile(path):
            return True
        return bool(mismatch(load_shard(path, mmap=True), self._layout()))

    def take_over(self, states: "ParamStates") -> None:
        """Continue from another owner's optimizer state (plain DeepSpeed's ZeRO files, or this
        plugin's with another layout or optimizer): every bucket's masters and optimizer states are
        cut from the whole per-parameter states, and the fp16 loss scale is taken over."""
        p = self.plugin
        # the buckets' optimizers copy these before every step; an LR scheduler drives them
        set_hyperparameters(p.engine.optimizer, {param: n for n, param in p.engine.module.named_parameters()}, states)
        for bucket in p.buckets:
            if bucket.optimizer is None:
                continue
            slots = [Slot(view, [Fragment(bucket.names[piece.index], piece.start, piece.numel, 0)])
                     for piece, view in zip(bucket.pieces, bucket.views)]
            with bucket.fp32_masters(write_params=True):
                load_slots(bucket.optimizer, slots, states)
            bucket.steps_applied = max((int(st["step"]) for st in bucket.optimizer.state.values() if "step" in st),
                                       default=0)
        if states.loss_scale and p.policy.loss_scaler is not None:
            p.policy.load_state_dict({"previous_norm": None, "loss_scaler": states.loss_scale})

    def remove(self) -> None:
        """The engine clips at the user's value again; without fp32 masters it says so."""
        p = self.plugin
        restore_gradient_clipping(p.engine, p.setup.gradient_clipping)
        if p.setup.param_dtype != torch.float32 and p.engine.global_rank == 0:
            logger.warning("xirang grad_release removed: the engine continues without fp32 master weights "
                           "(DeepSpeed built it at stage 0 without a precision wrapper); optimizer states were "
                           "cast to %s", str(p.setup.param_dtype).replace("torch.", ""))


__all__ = ["DeepSpeedRelease"]
