"""grad_release's own ops in one optimizer step, for the predicted step (`xirang_ds.roles.TimesGradients`,
`xirang_ds.planning.step_time`): counted by running its own buckets, pipeline and policy on fake tensors.

grad_release reduces and steps the gradients in place of DeepSpeed's path, so the estimate counts its code, not
DeepSpeed's: the run's buckets (`layout.plan_buckets` over the trainable parameters in reverse order, the run's
masters), its `pipeline.ReleasePipeline` fed every micro-step's gradients in that order, the passes its
`policy.ReleasePolicy` asks for (``hold`` then the updates after backward, or the updates in backward, or two
passes), on fake tensors (no memory, any size) and a stand-in for the collectives that counts one launch for each.
One step is run first so that the optimizer's states exist; the next is counted.

The update is counted as it runs, one optimizer step per bucket: torch's AdamW over the bucket's views, or, where
a plugin prices the update (`xirang_ds.roles.TimesUpdate`: optimizer_states' DynamicAdamW), a stand-in whose
step counts that plugin's count of a step over the bucket's pieces (`TimesUpdate.group_update_ops`) and whose
rounding is the real one's one compiled call where the run compiles it (off the CPU). What it does not run: the
host tiers' copies (the states' and a stashed shard's: `states_tier.StatesTier` prices their bytes over the host
link), so the buckets run with their states on the device; the rows' hand-over of an embedding or head gradient
(`rows.py`). The model's second backward under ``exact_method: two_pass`` is the trace's backward once more
(`extra_backwards`, which `xirang_ds.planning.step_time` prices).
The host read of the step's norm (``float``, which fake tensors cannot do) is counted as one.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch

from xirang_ds.compat.torch import fake_tensor_mode, pop_mode_temporarily
from xirang_ds.memory.device_profile import OpTally, Tallying
from xirang_ds.plugins.grad_release.bucket import Bucket
from xirang_ds.plugins.grad_release.comm import DataParallelComm
from xirang_ds.plugins.grad_release.layout import BucketLayout, plan_buckets
from xirang_ds.plugins.grad_release.optimizers import leaves_foreach_in_config
from xirang_ds.plugins.grad_release.pipeline import Pass, ReleasePipeline
from xirang_ds.plugins.grad_release.policy import ReleasePolicy
from xirang_ds.roles import TimesUpdate


class _Counting:
    """Where the stand-ins count: the tally of the stretch being counted (None: the first step, not counted)."""

    tally: Optional[OpTally] = None
    unpriced = False
    """An update the pricing plugin could not count (`TimesUpdate.group_update_ops` gave ``None``)."""


class _Dist:
    """The collectives module `comm.DataParallelComm` calls, counting a launch for each (their bytes are the step's
    communication) and returning no work to wait for."""

    class ReduceOp:
        SUM = "sum"

    def __init__(self, world: int, counting: _Counting) -> None:
        self.world, self.counting = world, counting

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group: Any = None) -> int:
        return self.world

    def get_rank(self, group: Any = None) -> int:
        return 0

    def _launch(self, *args: Any, **kwargs: Any) -> None:
        if self.counting.tally is not None:
            self.counting.tally.collective()

    reduce_scatter_tensor = all_reduce = all_gather_into_tensor = _launch


class _Rounding:
    """optimizer_states' compiled rounding (`FusedStep.round_`) where the run compiles it: one call reading the fp32
    master and writing the 16-bit weights; elsewhere the eager rounding runs (False)."""

    def __init__(self, compiled: bool, counting: _Counting) -> None:
        self.compiled, self.counting = compiled, counting

    def round_(self, master: torch.Tensor, out: torch.Tensor, seed: int, offset: int = 0, low_bits: int = 16) -> bool:
        if self.compiled and self.counting.tally is not None:
            self.counting.tally.add_counts(0, master.numel() * 4 + out.numel() * out.element_size(), False)
        return self.compiled


def _update_priced_elsewhere(rounding: _Rounding, price: Any, chunk: int) -> type:
    """A stand-in for an optimizer whose update another plugin prices (`xirang_ds.roles.TimesUpdate`): each step
    counts that plugin's count of a step over its tensors (`TimesUpdate.group_update_ops`); it stores its updates
    through ``xirang_write_back`` as the real one does (optimizer_states' DynamicAdamW; under grad_release's
    in-place ``masters: none``, compiled, the update's one kernel rounds into the weight; eager, each ``chunk`` of
    an update is handed to the view's write-back, which rounds it) and rounds with the real one's compiled
    rounding."""

    class UpdatePricedElsewhere(torch.optim.Optimizer):
        xirang_write_back = True
        fused = rounding

        def __init__(self, params: Any, lr: float = 1e-3) -> None:
            super().__init__(params, {"lr": lr})

        def step(self, closure: Any = None) -> None:
            views = [v for g in self.param_groups for v in g["params"]]
            price([(int(v.xirang_slice_of.name), v.numel()) for v in views])
            if not rounding.compiled:  # the eager update hands each updated chunk to the view's write-back
                for view in (v for v in views if hasattr(v, "xirang_write_back")):
                    for start in range(0, view.numel(), chunk):
                        view.xirang_write_back(torch.empty(min(chunk, view.numel() - start)), start)

    return UpdatePricedElsewhere


def _basic_optimizer(plugin: Any, shape: Any, params: list, profile: Any, counting: _Counting) -> Any:
    """The optimizer the buckets clone: a stand-in counting the update's pricing plugin per step, or torch's AdamW
    (counted as it runs)."""
    pricer = next((p for p in plugin.session.plugins if isinstance(p, TimesUpdate)), None)
    if pricer is None:
        impl = shape.adam_impl  # torch's Adam left to choose takes the multi-tensor path in each bucket's clone
        if impl == "single_tensor" and leaves_foreach_in_config(plugin.session.ds_config):
            impl = "foreach"
        return torch.optim.AdamW(params, lr=1e-3, foreach=impl != "single_tensor")
    fused = getattr(pricer.config, "fused", False)
    compiled = fused is True or (fused == "auto" and profile.accelerator)

    def price(pieces: list) -> None:
        if counting.tally is not None and pieces:
            with pop_mode_temporarily():  # the pricing's own fake tensors are not the step's ops
                ops = pricer.group_update_ops(shape, pieces, profile)
            if ops is None:
                counting.unpriced = True
            else:
                counting.tally.ops_from(ops)

    cls = _update_priced_elsewhere(_Rounding(compiled, counting), price, int(pricer.config.chunk_numel))
    return cls(params)


def _one_step(plugin: Any, shape: Any, params: list, pipeline: ReleasePipeline, policy: ReleasePolicy,
              counting: _Counting, backward: Optional[OpTally], boundary: Optional[OpTally]) -> None:
    """One optimizer step's backwards through the pipeline, as the engine's wrapped ``backward`` drives them."""
    clip = plugin.setup.gradient_clipping
    for micro in range(shape.grad_accum):
        last = micro == shape.grad_accum - 1
        for kind in policy.passes(last):
            counting.tally = backward
            with Tallying(backward) if backward is not None else contextlib.nullcontext():
                torch.empty(()) / shape.grad_accum  # engine.backward's division of the loss
                rule = policy.rule() if kind in (Pass.FUSED, Pass.UPDATE) else None
                pipeline.begin(kind, rule)
                for param in reversed(params):  # the order autograd finishes them in
                    param.grad = torch.empty_like(param)
                    pipeline.on_grad(param)
                sumsq = pipeline.finish()
                if kind is not Pass.ACCUMULATE and sumsq is not None:  # policy.global_norm up to its host read
                    total = sumsq.detach().clone()
                    if policy.sharded:
                        policy.comm.all_reduce(total, async_op=False)
                    if backward is not None:
                        backward.host_read()
            if kind in (Pass.NORM, Pass.HOLD):
                policy.known_norm = 2.0 * clip if clip > 0 else 1.0  # a norm that clips, as the run's may
            if kind is Pass.HOLD:
                counting.tally = boundary
                with Tallying(boundary) if boundary is not None else contextlib.nullcontext():
                    pipeline.apply_all(policy.rule())
            if kind is not Pass.ACCUMULATE:
                policy.previous_norm = 2.0 * clip if clip > 0 else 1.0
    counting.tally = None


def step_ops(plugin: Any, shape: Any, numels: list[int], profile: Any) -> Optional[tuple[OpTally, OpTally]]:
    """``(backward, boundary)``: grad_release's ops in every micro-step's backward together (updates in backward
    included), and after the last one (a held pass's updates), on rank 0 (module docstring); ``None`` before its
    ds_config is read, or where the update's pricing plugin cannot count."""
    setup = plugin.setup
    if setup is None or not numels:
        return None
    bucket_numel = plugin._bucket_numel(sum(numels), setup.comm_dtype.itemsize, max(shape.world_size, 1))
    pricer = next((p for p in plugin.session.plugins if isinstance(p, TimesUpdate)), None)
    # what the ops depend on; the micro-batch changes none of them (the tuner asks for many)
    key = (dataclasses.replace(shape, micro_batch=0), tuple(numels), repr(profile), repr(setup), repr(plugin.config),
           plugin._masters, plugin.retries_oom(), bucket_numel, repr(getattr(pricer, "config", None)),
           leaves_foreach_in_config(plugin.session.ds_config))
    if key not in _COUNTED:
        _COUNTED[key] = _count(plugin, shape, numels, profile, bucket_numel)
        while len(_COUNTED) > 32:
            _COUNTED.pop(next(iter(_COUNTED)))
    return _COUNTED[key]


_COUNTED: dict = {}
"""`step_ops` by what they depend on, the oldest dropped first (read-only tallies)."""


def _count(plugin: Any, shape: Any, numels: list[int], profile: Any, bucket_numel: int
           ) -> Optional[tuple[OpTally, OpTally]]:
    setup = plugin.setup
    counting = _Counting()
    comm = DataParallelComm(None, dist=_Dist(max(shape.world_size, 1), counting))
    sharded = setup.zero_stage >= 1 and comm.world > 1
    world = comm.world if sharded else 1
    with fake_tensor_mode():
        params = [torch.nn.Parameter(torch.empty(n, dtype=setup.param_dtype)) for n in numels]
        basic = _basic_optimizer(plugin, shape, params, profile, counting)
        order = list(reversed(range(len(params))))
        buckets = []
        for indices in plan_buckets([numels[i] for i in order], bucket_numel):
            chosen = [order[k] for k in indices]
            bucket = Bucket(len(buckets), [params[i] for i in chosen], [str(i) for i in chosen],
                            [0] * len(chosen), BucketLayout.build([numels[i] for i in chosen], world), comm, basic,
                            setup.comm_dtype, masters=plugin._masters, states="device")
            bucket.copies = None
            buckets.append(bucket)
        policy = _policy(plugin, comm, sharded, sum(numels))
        pipeline = ReleasePipeline(buckets, plugin.config.overlap_comm)
        _one_step(plugin, shape, params, pipeline, policy, counting, None, None)  # the optimizer's states made
        backward, boundary = OpTally(), OpTally()
        _one_step(plugin, shape, params, pipeline, policy, counting, backward, boundary)
    return None if counting.unpriced else (backward, boundary)


def _policy(plugin: Any, comm: DataParallelComm, sharded: bool, total: int) -> ReleasePolicy:
    """The run's `policy.ReleasePolicy`: its clipping, exact method, non-finite handling and held updates."""
    setup = plugin.setup
    policy = ReleasePolicy(comm, sharded, setup.gradient_clipping, plugin.config.clipping,
                           "two_pass" if plugin.config.exact_method == "two_pass" else "hold",
                           setup.skip_nonfinite, None, total)
    policy.hold_updates = plugin.retries_oom()
    return policy


def extra_backwards(plugin: Any) -> int:
    """The model's backwards in a steady optimizer step beyond one a micro-step: one more at the boundary where
    ``exact_method: two_pass`` runs a norm-only backward first (the step's norm or finiteness is needed before
    any update), else none; 0 before the ds_config is read."""
    if plugin.setup is None:
        return 0
    policy = _policy(plugin, DataParallelComm(None, dist=_Dist(1, _Counting())), False, 0)
    policy.previous_norm = 1.0  # a steady step: the previous one's norm is known
    return len(policy.passes(True)) - 1


__all__ = ["extra_backwards", "step_ops"]
