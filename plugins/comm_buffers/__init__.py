"""Adaptive communication buffers: bucket sizes from the model, the links and the budget; one arena.

**The rule** (`auto_bucket_numel`). A ring reduce-scatter of ``n`` elements of ``b`` bytes over ``p``
ranks costs about ``(p-1)*alpha + (p-1)/p * n*b/beta`` (latency ``alpha``, bandwidth ``beta``). At
``n*b = 9*p*alpha*beta`` the fixed cost is 1/9 of the transfer (10% of the total), so the bucket
runs at >= 90% of link bandwidth (`xirang_ds.links`); larger buckets only add memory (``p`` is capped
at 8: larger groups use trees). The bucket is then held to at least the largest parameter (a gradient never
straddles reductions), at most ``max_fraction_of_budget`` of the memory budget over all its buffers (2 with
``overlap_comm``), and at most the model (beyond that there is nothing left to overlap with).
``alpha``/``beta`` default by backend: NCCL 30 us / 100 GB/s, gloo 50 us / 2 GB/s; override with
``collective_latency_us`` / ``collective_bandwidth_gbps``.

**Keys.** With the section enabled, ZeRO bucket keys the user left unset are set to the rule's value;
a value the user set is kept and the log says what auto would have picked.

**ZeRO-3's gathered weights** (`gathered_limits`). DeepSpeed keeps a module's gathered weights from
forward to backward when their next use comes within ``stage3_max_reuse_distance`` elements of
fetches (about twice the parameters after the module in forward), and its prefetcher, walking the
trace while fewer than ``stage3_max_live_parameters`` elements are gathered, keeps every gathered
weight it passes on the way. Their defaults, 1e9 each, keep every model under 5e8 parameters gathered
whole at the turn: a cache that saves one all-gather of the model per step, at 2 bytes per parameter
in bf16. Left unset, the weights kept are held to ``max_fraction_of_budget`` of the budget: the reuse
distance is twice that many elements and the live limit that many plus one prefetch bucket, never
above DeepSpeed's defaults; the other weights are gathered again in backward, as ZeRO-3 does on large
models. Gathering again gives the same values, so the arithmetic does not change.

**Adapting** (``adapt``). Every ``adapt_every_steps`` optimizer steps: if the step's peak is above
90% of the budget, the reduction bucket halves (not below the largest parameter); if the backward
needed more than 32 reductions and doubling stays within the cap and the headroom, it doubles. Each
change is logged with its reason and takes effect at the next backward.

**Megatron-core** (`prepare_ddp_config`). The same rule sizes ``DistributedDataParallelConfig.bucket_size``
(Megatron-LM ``--ddp-bucket-size``) when the user left it unset and ``overlap_grad_reduce`` is on; a size
the user set is kept, and a different explicit ``reduce_bucket_size`` in the block is an error naming
both. Megatron's DDP keeps all gradients in one persistent buffer whose buckets are views, so the size
sets how reductions overlap backward, not memory: the arena and adapting do not apply there.

**Arena** (``arena``, ZeRO 1/2). The reduction buckets come from one allocation made at ``attach``
and reused every backward (`xirang_ds.plugins.comm_buffers.arena`), instead of DeepSpeed's ``torch.empty`` per
backward; the arena is resized only when the bucket size adapts. ZeRO 3 already keeps its bucket
from init.

**Lending** (``lend_to_activations``, ZeRO 1/2). Between the end of one backward's reductions and the
first gradient hook of the next, the arena holds nothing: `xirang_ds.plugins.comm_buffers.arena.ArenaLender`
lends it to the activations plugin, whose packing options (compress / quantize / sparsify) store
their payloads there, and park tensors no encoding shrinks there as they are. The layout comes
from one observed pass: each request sits above the bytes gradients have reached when backward
consumes it; before each gradient copy into the bucket, any lease in the bytes it writes moves to
host memory (the safety net). The lent bytes are inside the arena's one allocation,
so the tracker counts them once (as comm_buffers); the plugin reports bytes lent and evicted per
step.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.links import RING_RANKS_MAX, backend_link, efficient_numel
from xirang_ds.memory.run_shape import DEFAULT_MAX_LIVE_PARAMETERS, DEFAULT_MAX_REUSE_DISTANCE
from xirang_ds.plugins.comm_buffers.arena import Arena
from xirang_ds.plugins.comm_buffers.config import CommBuffersConfig
from xirang_ds.registry import STORAGE_LENDER, Plugin, register_plugin

logger = logging.getLogger("xirang_ds")

DEEPSPEED_DEFAULT_BUCKET = 500_000_000
MAX_REDUCTIONS_PER_STEP = 32
PRESSURE = 0.9
DEEPSPEED_GATHERED_DEFAULTS = {"stage3_max_reuse_distance": DEFAULT_MAX_REUSE_DISTANCE,
                               "stage3_max_live_parameters": DEFAULT_MAX_LIVE_PARAMETERS}
"""DeepSpeed's ZeRO-3 keys that keep gathered weights (`gathered_limits`), at its defaults."""


def auto_bucket_numel(largest_param: int, total_params: int, elem_bytes: int, buffers: int, budget_bytes: int,
                      max_fraction: float, latency_s: float, bandwidth: float, ranks: int = 1) -> tuple[int, str]:
    """The bucket size rule of the module docstring; returns (elements, why).

    A ring reduce-scatter over ``p`` ranks pays ``p - 1`` latencies and moves ``(p - 1)/p`` of the
    bucket, so >= 90% link efficiency needs ``n*b >= 9*p*alpha*beta`` (``p`` capped at
    `RING_RANKS_MAX`, beyond which collectives are not flat rings).
    """
    p = max(1, min(int(ranks), RING_RANKS_MAX))
    efficient = efficient_numel(elem_bytes, ranks, latency_s, bandwidth)
    cap = int(max_fraction * budget_bytes / (elem_bytes * buffers))
    n = max(efficient, largest_param)
    why = (f"9*p*alpha*beta = {format_bytes(efficient * elem_bytes)} for >= 90% link efficiency on {p} rank(s)"
           if efficient >= largest_param else f"the largest parameter ({largest_param:,} elements)")
    if n > total_params:
        n, why = total_params, f"the whole model ({total_params:,} elements)"
    if n > cap:
        n, why = max(1, cap), f"the cap of {max_fraction:.0%} of the budget over {buffers} buffer(s)"
    return n, why


def gathered_limits(elem_bytes: int, budget_bytes: int, max_fraction: float,
                    prefetch: int) -> dict[str, tuple[int, str]]:
    """ZeRO-3's ``stage3_max_reuse_distance`` and ``stage3_max_live_parameters`` for the module
    docstring's rule: key → (elements, why)."""
    kept = int(max_fraction * budget_bytes / elem_bytes)
    if 2 * kept >= DEFAULT_MAX_REUSE_DISTANCE:
        why = f"DeepSpeed's default: {max_fraction:.0%} of the budget would keep more gathered weights than it does"
        return {key: (value, why) for key, value in DEEPSPEED_GATHERED_DEFAULTS.items()}
    why = (f"weights kept gathered from forward to backward at most {max_fraction:.0%} of the budget "
           f"({format_bytes(kept * elem_bytes)}, {kept:,} elements); the rest gathered again in backward")
    return {"stage3_max_reuse_distance": (2 * kept, why),
            "stage3_max_live_parameters": (kept + prefetch, f"those kept and one prefetch bucket ({prefetch:,})")}


def _data_parallel_size() -> int:
    """Megatron's data-parallel size when its groups exist, else the world size."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return int(parallel_state.get_data_parallel_world_size())
    except ImportError:
        pass
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


@register_plugin(CommBuffersConfig, section="comm_buffers", order=10,
                 summary="Adaptive communication buffers.")
class CommBuffersPlugin(Plugin):
    """Sizes ZeRO buckets, serves ZeRO-1/2 buckets from one arena, and adapts the size between steps;
    under Megatron-core, sizes the DDP buckets."""

    frameworks = ("deepspeed", "megatron")
    paths = {"deepspeed": "xirang_ds.plugins.comm_buffers.deepspeed:DeepSpeedBuffers",
             "megatron": "xirang_ds.plugins.comm_buffers.megatron:MegatronBuffers"}
    inert_keys = {"megatron": {
        "arena": (False, "Megatron's DDP allocates its grad buffer once and its buckets are views of it, so there "
                         "is no bucket allocation to serve from an arena"),
        "adapt": (False, "Megatron's DDP buckets are views of its grad buffer, sized once when the model is "
                         "wrapped; they cannot be resized between steps"),
        "adapt_every_steps": (None, "it paces adapt, which cannot run under Megatron"),
        "lend_to_activations": (False, "it lends the arena, which Megatron's DDP does not use"),
    }}
    """Under Megatron only the bucket sizes apply (docs/megatron.md)."""

    provides = frozenset({STORAGE_LENDER})
    time_neutral = True  # where the bytes live, not what runs (the predicted step counts bytes, not buckets)

    def __init__(self, config: CommBuffersConfig, session):
        super().__init__(config, session)
        self.decisions: dict[str, dict] = {}
        self.changes: list[dict] = []
        self.arena = None
        self.server = None
        self.reductions = 0
        self.lender = None
        """Memory lent to the activations plugin (`ArenaLender`), found by it at its attach (`lent_storage`)."""

    # ds_config --------------------------------------------------------------------------------
    def prepare_ds_config(self, ds_config: dict) -> None:
        model = self.session.model
        params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        if not params:
            return
        zero = ds_config.setdefault("zero_optimization", {})
        stage = int(zero.get("stage", 0))
        self.stage = stage
        elem = 2 if any(ds_config.get(k, {}).get("enabled") in (True, "true") for k in ("bf16", "fp16")) else 4
        overlap = bool(zero.get("overlap_comm", stage == 3))
        buffers = 2 if overlap else 1
        budget = self.budget_bytes()
        latency, bandwidth = self._link()
        largest = max(p.numel() for p in params)
        total = sum(p.numel() for p in params)
        n, why = auto_bucket_numel(largest, total, elem, buffers, budget, self.config.max_fraction_of_budget,
                                   latency, bandwidth, self.session.world_size)
        self.floor = min(largest, n)
        self.cap = max(n, int(self.config.max_fraction_of_budget * budget / (elem * buffers)))
        self.elem_bytes, self.buffers, self.total = elem, buffers, total
        if self.config.lend_to_activations:
            self._check_lending(stage, zero)
        if self.config.reduce_bucket_size != "auto" and int(self.config.reduce_bucket_size) < largest:
            raise XirangConfigError([("xirang.comm_buffers.reduce_bucket_size",
                                      f"{int(self.config.reduce_bucket_size):,} elements is smaller than the largest "
                                      f"parameter ({largest:,} elements), whose gradient would then bypass the arena "
                                      f"and be allocated every step; use at least {largest:,} or \"auto\"")])
        keys = ["reduce_bucket_size", "allgather_bucket_size"]
        if stage == 3:
            keys.append("stage3_prefetch_bucket_size")
        for key in keys:
            requested = getattr(self.config, key, "auto") if key != "stage3_prefetch_bucket_size" else "auto"
            if self._kept(zero, key, n, why):
                continue
            value = n if requested == "auto" else int(requested)
            zero[key] = value
            self.decisions[key] = {"value": value, "auto": n, "why": why, "kept": False}
            self.log(f"{key}: {value:,} elements = {format_bytes(value * elem)} per buffer "
                      f"({'auto: ' + why if requested == 'auto' else 'from xirang.comm_buffers'}; "
                      f"DeepSpeed's default is {DEEPSPEED_DEFAULT_BUCKET:,})")
        if stage == 3 and self.session.world_size > 1:
            self._size_gathered(zero, elem, budget)

    def _size_gathered(self, zero: dict, elem: int, budget: int) -> None:
        prefetch = int(float(zero["stage3_prefetch_bucket_size"]))
        for key, (value, why) in gathered_limits(elem, budget, self.config.max_fraction_of_budget, prefetch).items():
            if self._kept(zero, key, value, why):
                continue
            zero[key] = value
            self.decisions[key] = {"value": value, "auto": value, "why": why, "kept": False}
            self.log(f"{key}: {value:,} elements ({why}; DeepSpeed's default is {DEEPSPEED_GATHERED_DEFAULTS[key]:,})")

    def _kept(self, zero: dict, key: str, auto: int, why: str) -> bool:
        """Whether the user set ``key`` in ``zero_optimization``; if so it is kept, and the decision and
        the log say what auto would pick."""
        if key not in zero or zero[key] == "auto":
            return False
        self.decisions[key] = {"value": int(float(zero[key])), "auto": auto, "why": why, "kept": True}
        self.log(f"{key}: keeping the value you set ({int(float(zero[key])):,} elements); auto would pick "
                 f"{auto:,} ({why})")
        return True

    @staticmethod
    def _check_lending(stage: int, zero: dict) -> None:
        problems = []
        if stage not in (1, 2):
            problems.append(("xirang.comm_buffers.lend_to_activations",
                             f"needs the reduction arena of ZeRO stage 1 or 2, but zero_optimization.stage is "
                             f"{stage} ({'no reduction buckets' if stage == 0 else 'ZeRO 3 keeps its own buckets'}); "
                             "set lend_to_activations to false or use stage 1 or 2"))
        if zero.get("contiguous_gradients") in (False, "false"):
            problems.append(("xirang.comm_buffers.lend_to_activations",
                             "needs zero_optimization.contiguous_gradients (the arena is the contiguous "
                             "bucket), which is false; remove that key or set lend_to_activations to false"))
        if problems:
            raise XirangConfigError(problems)

    def prepare_ddp_config(self, ddp_config: Any) -> None:
        """Size Megatron DDP's ``bucket_size`` with the rule of the module docstring.

        Raises:
            XirangConfigError: an explicit ``reduce_bucket_size`` disagrees with the DDP config's, has
                no effect (no ``overlap_grad_reduce``), or ``allgather_bucket_size`` is set (Megatron
                gathers parameters in the gradient buckets).
        """
        model = self.session.model
        params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        if not params:
            return
        knob = "DistributedDataParallelConfig.bucket_size (Megatron-LM --ddp-bucket-size)"
        requested = self.config.reduce_bucket_size
        if self.config.allgather_bucket_size != "auto":
            raise XirangConfigError([("xirang.comm_buffers.allgather_bucket_size",
                                      f"is {int(self.config.allgather_bucket_size):,} but Megatron's DDP gathers "
                                      f"parameters in its gradient buckets, sized by {knob}; remove the key or "
                                      "set it to \"auto\" for Megatron runs")])
        if not ddp_config.overlap_grad_reduce:
            if requested != "auto":
                raise XirangConfigError([("xirang.comm_buffers.reduce_bucket_size",
                                          f"is {int(requested):,} but Megatron's DDP reduces all gradients in one "
                                          "bucket after backward unless overlap_grad_reduce is on (Megatron-LM "
                                          "--overlap-grad-reduce); turn that on, or set reduce_bucket_size to "
                                          "\"auto\"")])
            self.decisions["bucket_size"] = {"value": None, "auto": None, "kept": True,
                                             "why": "overlap_grad_reduce is off: one bucket after backward"}
            self.log("Megatron DDP: overlap_grad_reduce is off, so all gradients reduce in one bucket after "
                      "backward; nothing to size")
            return
        dtype = getattr(getattr(model, "config", None), "params_dtype", None) or params[0].dtype
        elem = 4 if ddp_config.grad_reduce_in_fp32 else dtype.itemsize
        latency, bandwidth = self._link()
        largest = max(p.numel() for p in params)
        total = sum(p.numel() for p in params)
        n, why = auto_bucket_numel(largest, total, elem, 1, self.budget_bytes(),
                                   self.config.max_fraction_of_budget, latency, bandwidth, _data_parallel_size())
        if ddp_config.bucket_size is not None:
            kept = int(ddp_config.bucket_size)
            if requested != "auto" and int(requested) != kept:
                raise XirangConfigError([("xirang.comm_buffers.reduce_bucket_size",
                                          f"is {int(requested):,} but {knob} is set to {kept:,}; set one of them "
                                          "(or both to the same value)")])
            self.decisions["bucket_size"] = {"value": kept, "auto": n, "why": why, "kept": True}
            self.log(f"Megatron DDP bucket_size: keeping the value you set ({kept:,} elements); auto would pick "
                      f"{n:,} ({why})")
            return
        value = n if requested == "auto" else int(requested)
        ddp_config.bucket_size = value
        self.decisions["bucket_size"] = {"value": value, "auto": n, "why": why, "kept": False}
        self.log(f"Megatron DDP bucket_size: {value:,} elements = {format_bytes(value * elem)} per bucket "
                  f"({'auto: ' + why if requested == 'auto' else 'from xirang.comm_buffers'}; Megatron's default "
                  f"is max(40,000,000, 1,000,000 x data-parallel size))")

    def budget_bytes(self) -> int:
        budget = self.session.config.memory_budget
        if budget != "auto":
            return int(budget)
        from deepspeed.accelerator import get_accelerator

        return int(get_accelerator().total_memory())

    def _link(self) -> tuple[float, float]:
        _, latency, bandwidth = backend_link()
        if self.config.collective_latency_us != "auto":
            latency = float(self.config.collective_latency_us) * 1e-6
        if self.config.collective_bandwidth_gbps != "auto":
            bandwidth = float(self.config.collective_bandwidth_gbps) * 1e9
        return latency, bandwidth

    def attach(self, engine: Any) -> None:
        self.engine = engine
        self.path.attach(engine)

    def adapt(self) -> Optional[dict]:
        """One adaptation decision now (every ``adapt_every_steps`` steps it runs by itself): the change made,
        or ``None``."""
        return self.path.adapt()

    def lent_storage(self) -> Any:
        return self.lender

    def describe(self) -> str:
        parts = [f"{k}={v['value']:,}" if v["value"] is not None else f"{k}: {v['why']}"
                 for k, v in self.decisions.items()]
        if self.path.describe():
            parts.append(self.path.describe())
        if self.arena is not None:
            parts.append(f"arena {format_bytes(self.arena.nbytes)} ({self.arena.slots} slot(s), allocated once)")
        if self.lender is not None:
            st = self.lender.stats
            parts.append(f"lent to activations: {format_bytes(st.lent_bytes)} in {st.leases} lease(s), "
                         f"high-water {format_bytes(st.high_water)}, {format_bytes(st.evicted_bytes)} moved to host")
        return ", ".join(parts) or "no trainable parameters"

    def log(self, message: str) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            logger.info("comm_buffers: %s", message)

    def figures(self) -> dict:
        """With lending: bytes of saved activations lent and evicted, per optimizer step."""
        if self.lender is None:
            return {}
        steps = self.lender.stats.steps
        return {"lent_bytes_per_step": [s["lent_bytes"] for s in steps],
                "evicted_bytes_per_step": [s["evicted_bytes"] for s in steps]}

    def state_dict(self) -> dict:
        opt = getattr(getattr(self, "engine", None), "optimizer", None)
        return {"reduce_bucket_size": int(opt.reduce_bucket_size) if hasattr(opt, "reduce_bucket_size") else None,
                "changes": list(self.changes)}

    def load_state_dict(self, state: dict) -> None:
        size = state.get("reduce_bucket_size")
        opt = self.engine.optimizer
        if size and hasattr(opt, "reduce_bucket_size") and int(size) != int(opt.reduce_bucket_size):
            opt.reduce_bucket_size = int(size)
            if self.arena is not None:
                self.path.replace_arena(Arena(int(size), self.arena.slots, self.arena.dtype, self.arena.device))
        self.changes = list(state.get("changes", []))

    def adjust_estimate(self, phases: dict, shape: Any, numels: list) -> Optional[dict]:
        """The bucket sizes are already in the ds_config the estimate reads; the arena keeps the
        bucket bytes resident in every phase instead of allocating them in each backward."""
        if not (self.config.arena and shape.stage in (1, 2) and shape.contiguous_gradients):
            return phases
        arena = shape.reduce_bucket * shape.lp_bytes * (2 if shape.overlap_comm else 1)
        out = {}
        for name, cats in phases.items():
            cats = dict(cats)
            cats["comm_buffers"] = max(cats.get("comm_buffers", 0), arena)
            out[name] = cats
        return out
