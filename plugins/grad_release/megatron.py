"""grad_release under Megatron-core: the update applied during backward instead of Megatron's DDP
gradient buffer and optimizer step.

Megatron's DDP allocates every ``param.main_grad`` once, as views of one persistent fp32 buffer per
dtype, and its optimizer steps after the whole backward. grad_release takes that path over at
``attach`` (`DdpTakeover`): DDP's gradient hooks are disarmed (its ``param_to_bucket_group`` is
emptied, which its hook checks first), the buffer's storage is freed (``resize_(0)``, as DDP's own
``offload_grad_buffers`` does: every view stays a tensor object, none is read while freed), and the
DDP methods that would touch it (``zero_grad_buffer``, ``start_grad_sync``, ``finish_grad_sync``,
``scale_gradients``) become no-ops. Gradients then go through grad_release's buckets, reduced over
Megatron's data-parallel group, and the run's ``step`` returns the outcome of the update already
applied (`MegatronRun.applied_update`) instead of calling Megatron's optimizer step.

What differs from the DeepSpeed path (`deepspeed.py`):

* **Backward is Megatron's.** The schedule calls ``torch.autograd.backward`` itself, so a backward's
  start is its first gradient (a post-accumulate-grad hook) and its end a callback queued on
  autograd's engine from there. Which micro-batch is the last comes from counting backwards against
  Megatron's number of micro-batches (its calculator, or ``attach(num_microbatches=...)``); a step
  with a different count is an error.
* **States replicated over data parallel**, as Megatron's non-distributed optimizer keeps them:
  Megatron-LM's ``--ckpt-format torch`` checkpoint is written by data-parallel rank 0 only, so each
  rank keeps every state (ZeRO stage 0 semantics: the gradient is reduced whole, each rank applies
  it). Gradients are never whole with one micro-batch per step; with several, the step's sum is
  kept in fp32 between micro-batches, as in Megatron's buffer.
* **Global norm over tensor parallel.** Each TP rank holds another shard of each split weight: its
  sum of squares counts its shards and, on TP rank 0 only, the parameters replicated on the TP group
  (``param_is_not_tensor_parallel_duplicate``), summed over the TP group, as Megatron's
  ``clip_grads.get_grad_norm_fp32`` does. The limit is ``OptimizerConfig.clip_grad``.
* **Checkpoints.** Megatron's ``optimizer.state_dict()`` holds the buckets' states in Megatron's own
  layout (the states are lent to its torch optimizer for the call), so the file loads with or
  without xirang; ``load_state_dict`` moves them back into the buckets.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from xirang_ds.compat.megatron import optimizer_configs, optimizer_members, unwrap
from xirang_ds.compat.torch import queue_end_of_backward
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import CallbackHandle, wrap_method
from xirang_ds.plugins.grad_release.comm import DataParallelComm
from xirang_ds.plugins.grad_release.ds_config import BF16_MASTERS, TrainingSetup
from xirang_ds.plugins.grad_release.pipeline import Pass
from xirang_ds.plugins.grad_release.policy import ReleasePolicy
from xirang_ds.registry import FrameworkPath

DISARMED_DDP_METHODS = ("zero_grad_buffer", "start_grad_sync", "finish_grad_sync", "scale_gradients")
"""Megatron DDP methods that read or write the gradient buffer (distributed_data_parallel.py)."""


def problems(config: Any, run: Any, clip_grads: list[float]) -> list[tuple[str, str]]:
    """What in this Megatron run grad_release cannot take over, each with its fix.

    Args:
        config: the grad_release section.
        run: the `MegatronRun`.
        clip_grads: each optimizer member's ``OptimizerConfig.clip_grad``.
    """
    from megatron.core import parallel_state

    out: list[tuple[str, str]] = []

    def refuse(setting: str, why: str, fix: str) -> None:
        out.append(("", f"xirang.grad_release cannot run with Megatron's {setting}: {why}. Fix: {fix}"))

    if len(run.model_chunks) > 1:
        refuse("virtual pipeline (several model chunks per rank)", "the chunks' backwards interleave with "
               "pipeline communication", "run grad_release with --pipeline-model-parallel-size 1")
    if parallel_state.model_parallel_is_initialized() and \
            parallel_state.get_pipeline_model_parallel_world_size() > 1:
        refuse("pipeline parallelism (--pipeline-model-parallel-size "
               f"{parallel_state.get_pipeline_model_parallel_world_size()})",
               "finalize_model_grads reduces the tied embedding gradients across stages after backward, so those "
               "parameters cannot be updated during it", "set xirang.grad_release.enabled false for pipeline runs")
    ddp_config = getattr(run.module, "ddp_config", None)
    if getattr(ddp_config, "use_distributed_optimizer", False):
        refuse("distributed optimizer (--use-distributed-optimizer)", "it steps 1-D ranges of DDP's buffer "
               "that grad_release frees", "drop --use-distributed-optimizer (or disable xirang.grad_release)")
    if getattr(ddp_config, "delay_wgrad_compute", False):
        refuse("delayed weight-gradient computation (--delay-wgrad-compute)", "its gradients arrive outside "
               "backward", "drop --delay-wgrad-compute")
    model_config = getattr(unwrap(run.module), "config", None)
    for field, flag, why, fix in (
            ("sequence_parallel", "--sequence-parallel", "the layernorm gradients are all-reduced over the "
             "tensor-parallel group after backward (finalize_model_grads)", "drop --sequence-parallel"),
            ("gradient_accumulation_fusion", "--gradient-accumulation-fusion, Megatron-LM's default", "backward "
             "writes weight gradients into param.main_grad, the buffer grad_release frees",
             "add --no-gradient-accumulation-fusion"),
            ("calculate_per_token_loss", "--calculate-per-token-loss", "gradients are divided by the token count "
             "after backward", "drop --calculate-per-token-loss")):
        if getattr(model_config, field, False):
            refuse(f"{field} ({flag})", why, f"{fix} (or disable xirang.grad_release)")
    for member in optimizer_members(run.optimizer):
        kind = type(member).__name__
        if kind != "FP32Optimizer":
            refuse(f"{kind}", "grad_release under Megatron steps fp32 parameters (Megatron's FP32Optimizer); "
                   "the --bf16/--fp16 optimizers keep fp32 masters of 16-bit weights, which is not built here",
                   "train in fp32 weights (bf16 compute: xirang.precision) or disable xirang.grad_release")
    if run.tp_world_size > 1 and getattr(model_config, "qk_layernorm", False):
        refuse("qk_layernorm (--qk-layernorm) at tensor-parallel size > 1", "each rank normalises its own heads, "
               "so finalize_model_grads sums the q/k layernorm gradients over the TP group after backward",
               "drop --qk-layernorm or disable xirang.grad_release")
    averaged = [n for n, p in unwrap(run.module).named_parameters()
                if getattr(p, "average_gradients_across_tp_domain", False)]
    if run.tp_world_size > 1 and averaged:
        refuse(f"parameters averaged over the tensor-parallel group ({averaged[0]} and {len(averaged) - 1} more)",
               "finalize_model_grads averages their gradients over the TP group after backward",
               "disable xirang.grad_release for this model")
    experts = [n for n, p in unwrap(run.module).named_parameters() if not getattr(p, "allreduce", True)]
    if experts:
        refuse(f"expert parallelism ({experts[0]} and {len(experts) - 1} more)", "expert gradients reduce over "
               "the expert-data-parallel group", "disable xirang.grad_release for MoE models")
    if len(set(clip_grads)) > 1:
        refuse(f"clip_grad {sorted(set(clip_grads))} (one per optimizer group)", "grad_release clips with one "
               "global norm", "use one --clip-grad")
    tp = run.tp_world_size
    if tp > 1 and config.clipping == "per_layer" and any(c > 0 for c in clip_grads):
        out.append(("clipping", f"xirang.grad_release.clipping = \"per_layer\" under tensor parallelism "
                                f"(size {tp}) would clip each rank's shard of a split weight by its own norm; "
                                "allowed here: \"exact\" or \"previous_step\". Fix: set clipping to \"exact\""))
    if run.gradient_accumulation_steps() is None:
        refuse("number of micro-batches (unknown)", "grad_release applies the update in the last micro-batch's "
               "backward", "pass num_microbatches= to xirang_ds.integration.megatron.attach (Megatron-LM: "
               "its calculator provides it)")
    return out


class DdpTakeover:
    """Megatron DDP with its gradient buffer freed and its gradient path disarmed; `remove` restores it.

    Args:
        ddp: a ``megatron.core.distributed.DistributedDataParallel`` chunk.

    Attributes:
        freed_bytes: bytes of gradient buffer storage freed.
    """

    def __init__(self, ddp: Any) -> None:
        self.ddp = ddp
        self._buckets = ddp.param_to_bucket_group
        ddp.param_to_bucket_group = {}  # DDP's backward hook does nothing for a parameter not in it
        self._storages: list[tuple[Any, int]] = []
        for buffer in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
            storage = buffer.grad_data.untyped_storage()
            if storage.nbytes():
                self._storages.append((storage, storage.nbytes()))
                storage.resize_(0)
        self.freed_bytes = sum(n for _, n in self._storages)
        self._handles = [wrap_method(ddp, name, _disarmed) for name in DISARMED_DDP_METHODS if hasattr(ddp, name)]

    def remove(self) -> None:
        """Give DDP its buffer back (zeroed), its hooks' buckets and its methods."""
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        for storage, nbytes in self._storages:
            storage.resize_(nbytes)
        self._storages = []
        for buffer in list(self.ddp.buffers) + list(getattr(self.ddp, "expert_parallel_buffers", [])):
            buffer.grad_data.zero_()
        self.ddp.param_to_bucket_group = self._buckets


def _disarmed(original: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """DDP's buffer is freed: grad_release reduced and applied every gradient during backward."""
    return None


def norm_counted(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether ``param``'s gradient enters this rank's sum of squares: a tensor-parallel shard always,
    a parameter replicated on the TP group on its first rank only (``param_is_not_tensor_parallel_duplicate``)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


class StateLoan:
    """Lend the buckets' optimizer states to Megatron's torch optimizers (keyed by the model parameters,
    as Megatron's own step would hold them) for a ``state_dict`` call, and take states loaded there back.

    Buckets under Megatron are not sharded (one rank holds each parameter whole), and their
    parameters are fp32, so each bucket view is the parameter's own storage and a state moves by
    reference.
    """

    def __init__(self, buckets: list[Any]) -> None:
        self.pairs: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (bucket, view, param)
        for bucket in buckets:
            for piece, view in zip(bucket.pieces, bucket.views):
                self.pairs.append((bucket, view, bucket.params[piece.index]))

    def lend(self) -> None:
        for bucket, view, param in self.pairs:
            state = bucket.optimizer.state.get(view) if bucket.optimizer is not None else None
            if state:
                bucket.basic.state[param] = state

    def take_back(self) -> int:
        """Move the torch optimizers' states of the buckets' parameters into the buckets; how many moved."""
        moved = 0
        for bucket, view, param in self.pairs:
            state = bucket.basic.state.pop(param, None)
            if state and bucket.optimizer is not None:
                bucket.optimizer.state[view] = state
                moved += 1
        return moved

    def clear(self) -> None:
        for bucket, _, param in self.pairs:
            bucket.basic.state.pop(param, None)


class MegatronRelease(FrameworkPath):
    """Megatron-core's DDP gradient path and optimizer step, taken over (the module docstring)."""

    parks_states = False
    """``states: auto`` keeps the optimizer states on the device: Megatron's checkpoints borrow them (`check`)."""

    @classmethod
    def check(cls, config: Any) -> list[tuple[str, str]]:
        issues = []
        if config.exact_method == "two_pass":
            issues.append(("exact_method", "xirang.grad_release.exact_method = \"two_pass\" runs backward twice, "
                                           "and under Megatron backward is Megatron's schedule's; allowed there: "
                                           "\"hold\". Fix: set exact_method to \"hold\""))
        if config.states == "host":
            issues.append(("states", "xirang.grad_release.states = \"host\" is not wired into Megatron's checkpoint "
                                     "path, which lends the buckets' states to Megatron's optimizer; allowed there: "
                                     "\"device\". Fix: remove the key"))
        return issues

    def attach(self, run: Any) -> None:
        """Take over Megatron DDP's gradient path and Megatron's optimizer step."""
        from megatron.core import parallel_state

        p = self.plugin
        p.engine = run
        clip_grads = [float(c.clip_grad) for c in optimizer_configs(run.optimizer)]
        issues = problems(p.config, run, clip_grads)
        if p.config.masters in BF16_MASTERS:
            issues.append(("xirang.grad_release.masters", f"{p.config.masters!r} is for bf16 parameters' masters, "
                           "and under Megatron grad_release takes over fp32 parameters only (its Float16 optimizer "
                           "keeps the masters); allowed: \"auto\" or \"fp32\". Fix: remove the key"))
        if issues:
            raise XirangConfigError(issues)
        p.setup = TrainingSetup(zero_stage=0, param_dtype=torch.float32,
                                gradient_clipping=clip_grads[0] if clip_grads else 0.0,
                                comm_dtype=torch.float32, fp16=None,
                                skip_nonfinite=p.config.nonfinite == "skip_step")
        p.comm = DataParallelComm(parallel_state.get_data_parallel_group(), dist=torch.distributed)
        tp_comm = DataParallelComm(parallel_state.get_tensor_model_parallel_group(), dist=torch.distributed)
        model = unwrap(run.module)
        p.buckets = p.plan_buckets(model, list(run.basic_optimizers), sharded=False)
        tp_rank = tp_comm.rank
        for bucket in p.buckets:
            bucket.norm_counted = [norm_counted(param, tp_rank) for param in bucket.params]
        total = sum(param.numel() for b in p.buckets for param in b.params)
        p.policy = ReleasePolicy(p.comm, False, p.setup.gradient_clipping, p.config.clipping,
                                 p.config.exact_method, p.setup.skip_nonfinite, None, total,
                                 norm_comms=[tp_comm])
        p.start_pipeline(self._on_grad)
        if hasattr(run.module, "param_to_bucket_group"):  # Megatron DDP
            p.freed_bytes = p.keep(DdpTakeover(run.module)).freed_bytes
        run.applied_update = self._update
        p.keep(CallbackHandle(lambda: setattr(run, "applied_update", None)))
        p.keep(wrap_method(run.optimizer, "state_dict", self._state_dict))
        p.keep(wrap_method(run.optimizer, "load_state_dict", self._load_state_dict))
        p.keep(wrap_method(run.optimizer, "sharded_state_dict", self._sharded_state_dict))

    # backward and step ------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        p = self.plugin
        if p.pipeline.kind is None:
            self._begin_backward()
        p.pipeline.on_grad(param)

    def _begin_backward(self) -> None:
        p = self.plugin
        expected = int(p.engine.gradient_accumulation_steps())
        micro = p._micro + 1
        if micro > expected:
            raise RuntimeError(f"xirang.grad_release: backward number {micro} since the last optimizer.step(), but a "
                               f"step has {expected} micro-batch(es) (Megatron's num_microbatches) and the update was "
                               "applied in the last one. Call optimizer.step() after each forward_backward_func, or "
                               "pass attach(num_microbatches=...) the number the schedule runs")
        kind = p.policy.passes(micro == expected)[0]
        p.pipeline.begin(kind, p.policy.rule() if kind in (Pass.FUSED, Pass.UPDATE) else None)
        queue_end_of_backward(self._end_backward)

    def _end_backward(self) -> None:
        p = self.plugin
        kind = p.pipeline.kind
        try:
            sumsq = p.pipeline.finish()
        except BaseException:
            p.pipeline.abort()
            raise
        p._micro += 1
        p.after_pass(kind, sumsq)

    def _update(self) -> tuple[bool, Optional[float], None]:
        """``optimizer.step()`` after the update was applied in backward: Megatron's return value."""
        p = self.plugin
        expected = int(p.engine.gradient_accumulation_steps())
        micro, p._micro = p._micro, 0
        if micro != expected:
            p.pipeline.discard_all()
            raise RuntimeError(f"xirang.grad_release: optimizer.step() after {micro} backward pass(es), but a step "
                               f"has {expected} micro-batch(es) (Megatron's num_microbatches); the update is applied "
                               f"in backward number {expected}, so this step's gradients were dropped. Pass "
                               "attach(num_microbatches=...) the number the schedule runs")
        outcome, p.policy.outcome = p.policy.outcome, None
        if outcome is None:
            return True, None, None
        return not outcome.skipped, outcome.grad_norm, None

    # checkpoints ------------------------------------------------------------------------------------
    def _state_dict(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """Megatron's optimizer state dict holding the buckets' states, as its own step would hold them."""
        loan = StateLoan(self.plugin.buckets)
        loan.lend()
        try:
            state = original(*args, **kwargs)
        finally:
            loan.clear()
        return state

    def _load_state_dict(self, original: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        """Megatron loads the states into its torch optimizers; they move into the buckets (a checkpoint of
        plain Megatron, or one saved with grad_release: the same layout)."""
        p = self.plugin
        p.pipeline.discard_all()
        result = original(state_dict, *args, **kwargs)
        for bucket in p.buckets:
            bucket.build_masters()  # fresh optimizers; a parameter without a saved state starts fresh
        StateLoan(p.buckets).take_back()
        return result

    def _sharded_state_dict(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("xirang.grad_release: Megatron's distributed checkpoint (sharded_state_dict; Megatron-LM "
                           "--ckpt-format torch_dist) is not supported under grad_release. Fix: save with "
                           "--ckpt-format torch (optimizer.state_dict()), which carries grad_release's states")

    def describe(self) -> str:
        p = self.plugin
        clip = (f"clipping {p.setup.gradient_clipping} ({p.config.clipping}, norm over the tensor-parallel "
                "group)" if p.setup.gradient_clipping > 0 else "no clipping")
        return (f"step in backward instead of Megatron DDP's gradient buffer ({p.freed_bytes:,} bytes freed) "
                f"and optimizer step, over {p.comm.world} data-parallel rank(s): {len(p.buckets)} buckets of "
                f"<= {p.bucket_numel:,} elements, optimizer states replicated, {clip}")


__all__ = ["DISARMED_DDP_METHODS", "DdpTakeover", "MegatronRelease", "StateLoan", "norm_counted", "problems"]
