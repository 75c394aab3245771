"""The ``optimizer_states`` plugin: `DynamicAdamW` as the basic optimizer DeepSpeed wraps.

Seams: ``prepare_ds_config`` refuses what cannot work (optimizer offload) and allows the
optimizer under ZeRO (``zero_allow_untested_optimizer`` in the private ds_config copy);
``prepare_model`` finds the parameters that keep fp32 states; ``prepare_optimizer`` replaces the
ds_config block's optimizer or the client's Adam/AdamW; ``attach`` keeps DeepSpeed's state views
in step with format changes; ``remove`` hands the engine a ``torch.optim`` Adam/AdamW (the
client's own object when there was one) holding the states decoded to fp32.

The states themselves travel in DeepSpeed's checkpoints through the optimizer's ``state_dict``
(per rank under ZeRO); the plugin's own ``state_dict`` records the settings they were made with.

Under Megatron-core ``prepare_optimizer`` receives Megatron's optimizer and replaces the
``torch.optim`` object inside each member, over the same param groups (`megatron.py`); Megatron's
own ``state_dict``/``load_state_dict`` then carry the states, and ``remove`` hands each member a
``torch.optim`` object again.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from xirang_ds.config.types import format_bytes
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.memory.model_states import adam_temporaries
from xirang_ds.memory.pool import align_up
from xirang_ds.memory.run_shape import sub_group_size
from xirang_ds.plugins.optimizer_states import first_step, masters, step_time
from xirang_ds.plugins.optimizer_states.build import MEASURED, keep_reasons, settings_from_client
from xirang_ds.plugins.optimizer_states.config import STATE_DTYPE_ORDER, OptimizerStatesConfig
from xirang_ds.plugins.optimizer_states.deepspeed import check_ds_config, ds_config_problems
from xirang_ds.plugins.optimizer_states.formats import MOMENTS, make_format
from xirang_ds.plugins.optimizer_states.masters import parks
from xirang_ds.plugins.optimizer_states.optimizer import config_to_dict
from xirang_ds.plugins.optimizer_states.schedule import make_policy
from xirang_ds.plugins.optimizer_states.update import param_numel
from xirang_ds.registry import LOW_BIT_STATES, Plugin, register_plugin

logger = logging.getLogger("xirang_ds")

SECTION = "xirang.optimizer_states"
NO_OPTIMIZER = ("there is no optimizer to replace (the engine only runs forward and backward). Fix: add an "
                "\"optimizer\" block of type AdamW or Adam to ds_config, or pass a torch.optim.AdamW to initialize")


@register_plugin(OptimizerStatesConfig, section="optimizer_states", order=40,
                 summary="Dynamic-precision optimizer states.")
class OptimizerStatesPlugin(Plugin):
    """Replaces the basic Adam/AdamW by `DynamicAdamW`.

    Attributes:
        optimizer: the `DynamicAdamW` once built.
        original: the client's optimizer object, when one was passed to ``initialize``.
        keep_reasons: why each kept parameter (by name) keeps fp32 states.
    """

    provides = frozenset({LOW_BIT_STATES})

    frameworks = ("deepspeed", "megatron")
    paths = {"deepspeed": "xirang_ds.plugins.optimizer_states.deepspeed:DeepSpeedStates",
             "megatron": "xirang_ds.plugins.optimizer_states.megatron:MegatronStates"}

    def __init__(self, config: OptimizerStatesConfig, session):
        super().__init__(config, session)
        self.optimizer = None
        self.optimizers: list[Any] = []
        """Every `DynamicAdamW` built (one per member of Megatron's optimizer; else the one)."""
        self.kept_ids: dict[int, str] = {}
        """Why a parameter keeps fp32 states, by ``id`` (every model chunk's)."""
        self.replaced: list = []
        """Megatron: each member's original optimizer and its replacement (`megatron.Replaced`)."""
        self.original: Optional[torch.optim.Optimizer] = None
        self.source = ""
        self.model: Optional[torch.nn.Module] = None
        self.keep_reasons: dict[str, str] = {}
        self.engine = None
        self.loaded_config: Optional[dict] = None
        self.parked: list = []
        """The masters kept as remainders (`masters.Parking`: DeepSpeed ZeRO-3's, or each Megatron member's)."""
        self.masters_line = "fp32"
        self.estimate_at_bound = True
        """Whether the estimate prices a measured embedding's states at their bound, fp32 (`PricesAtBound`)."""

    @classmethod
    def check_ds_config(cls, config: OptimizerStatesConfig, ds_config: dict) -> list[tuple[str, str]]:
        return ds_config_problems(config, ds_config)

    @classmethod
    def check_optimizer(cls, config: OptimizerStatesConfig, optimizer: Any) -> list[tuple[str, str]]:
        """No optimizer to replace, or a client optimizer `build.settings_from_client` refuses (not Adam
        or AdamW, amsgrad); a ds_config block's is `check_ds_config`'s."""
        if optimizer is None:
            return [(f"{SECTION}.enabled", NO_OPTIMIZER)]
        try:
            if isinstance(optimizer, torch.optim.Optimizer):
                settings_from_client(optimizer)
        except XirangConfigError as e:
            return list(e.problems)
        return []

    @classmethod
    def preset_leave_out(cls, config: OptimizerStatesConfig, ds_config: dict) -> Optional[str]:
        """fp32 states and DeepSpeed's masters kept fp32: `DynamicAdamW` would hold what AdamW holds."""
        exact = config.policy == "steps" and all(e.dtype == "fp32" for e in config.schedule)
        if exact and not parks(config, ds_config):
            return ("fp32 states, and DeepSpeed's masters stay fp32 here (they are kept as remainders only at "
                    "zero_optimization.stage 3 in bf16 without offload_optimizer): it would lower nothing")
        return None

    @classmethod
    def preset_fallbacks(cls, config: OptimizerStatesConfig, ds_config: dict) -> list[tuple[str, Any, str]]:
        """None: every key a preset sets runs with any ds_config the plugin can run with."""
        return []

    # seams ------------------------------------------------------------------------------------
    def prepare_ds_config(self, ds_config: dict) -> None:
        check_ds_config(self.config, ds_config)
        zero = ds_config.get("zero_optimization") or {}
        if int(zero.get("stage", 0) or 0) > 0:
            # ZeRO lists the optimizer classes it was tested with (runtime/zero/utils.py); this one
            # follows torch.optim's contract on one flat partition per group, as theirs do.
            ds_config["zero_allow_untested_optimizer"] = True
        if masters.parks(self.config, ds_config) and "sub_group_size" not in zero and self.session.model is not None:
            trainable = sum(p.numel() for p in self.session.model.parameters() if p.requires_grad)
            zero["sub_group_size"] = sub_group_size(trainable, self.session.world_size)

    def prepare_model(self, model: Any) -> None:
        self.model = model
        by_id = keep_reasons(model, self.config)  # a keep_fp32 glob matching nothing fails here
        by_id = {**self.path.keep_reasons(model), **by_id}
        self.kept_ids.update(by_id)  # every chunk's (Megatron calls this once per chunk)
        self.keep_reasons.update({name: by_id[id(p)] for name, p in model.named_parameters() if id(p) in by_id})

    def prepare_optimizer(self, optimizer: Any) -> Any:
        if optimizer is None:
            raise XirangConfigError([(f"{SECTION}.enabled", NO_OPTIMIZER)])
        return self.path.prepare_optimizer(optimizer)

    def attach(self, engine: Any) -> None:
        self.engine = engine
        self.path.attach(engine)
        for opt in self.optimizers:  # `fused: true` where compile is unavailable fails here, not mid-step
            opt.fused.enabled(torch.device(engine.device).type)

    def keep_parked(self, parked: list, line: str) -> None:
        """Hold the framework path's `masters.Parking` s: removed with the plugin, counted by the tracker
        as parameters; ``line`` says how the masters are kept (the log and `describe`)."""
        for one in parked:
            self.keep(one)
            self.keep(self.session.add_memory_roles(one.memory_roles))
        self.parked = parked
        self.masters_line = line

    def use_pool(self) -> None:
        """int8/int4 codes and scales come from the memory pool when the section is on (persistent
        blocks); the pool is told the most bytes they hold at once and the largest buffer."""
        pool = self.session.pool()
        if pool is None:
            return
        if self.session.stepper is not None:
            # grad_release steps its own copy of this optimizer over its shards (clone_optimizer), so
            # these states are never made here: reserving for them would only hold idle bytes
            logger.info("xirang optimizer_states: grad_release holds the optimizer states; they are not pooled")
            return
        demands = [quantized_demand(opt) for opt in self.optimizers]  # Megatron: one per member
        for opt in self.optimizers:
            opt.state_pool = pool
        self.session.pool_owner.add_client("optimizer_states", persistent_bytes=sum(total for total, _ in demands),
                                           largest_bytes=max((big for _, big in demands), default=0))
        if pool.warmup:
            pool.on_reserved.append(lambda _: self._rehome())
        else:  # DeepSpeed's wrappers may have made the states at initialize, before the pool existed
            self._rehome()

    def _rehome(self) -> None:
        """Move plain quantized buffers into the pool; the framework's path then rebuilds its views of the
        states (DeepSpeed's would otherwise keep the plain buffers alive; Megatron's optimizers hold none)."""
        moved = [opt.rehome_states() for opt in self.optimizers]
        if any(moved) and self.engine is not None:
            self.path.states_moved()

    def remove(self) -> None:
        """Hand the framework a ``torch.optim`` Adam/AdamW with the states decoded to fp32."""
        super().remove()  # parked masters whole again first
        self.parked = []
        for opt in self.optimizers:
            opt.state_pool = None
        self.path.remove()
        self.engine = None

    # estimate -----------------------------------------------------------------------------------
    def estimate_shape(self, shape: Any) -> Any:
        """DeepSpeed's groups as this plugin splits them (`split_groups`: policy-driven, kept fp32,
        measured): ZeRO 1/2 partitions each on its own, so each has its own rank boundary."""
        model = self.session.model
        if model is None or self.session.stepper is not None:
            return shape  # grad_release hands DeepSpeed stage 0 and models its own layout
        reasons = keep_reasons(model, self.config)
        params = [p for p in model.parameters() if p.requires_grad]
        kind = [("measured" if reasons[id(p)].startswith(MEASURED) else True) if id(p) in reasons else False
                for p in params]
        groups = tuple(g for g in (tuple(i for i, k in enumerate(kind) if k == want) for want in (False, True, "measured"))
                       if g)
        return dataclasses.replace(shape, groups=groups) if len(groups) > 1 else shape

    def estimate_layout(self) -> Optional[tuple[list, dict, Any]]:
        """What the estimate assumes of the session's model: its trainable parameters, the kept ones (fp32
        states, by id, with their reason) and the format the policy starts the others in; ``None`` without a model.
        A measured embedding is kept at its bound; priced at what the data give (`price_at_bound`), it takes the
        widest format its first update's check can move it to (`passing_format`)."""
        layout = self._layout()
        if layout is None:
            return None
        params, reasons, fmt, leaving = layout
        if not self.estimate_at_bound:
            reasons = {i: r for i, r in reasons.items() if i not in leaving}
        return params, reasons, fmt

    def _layout(self) -> Optional[tuple[list, dict, Any, set]]:
        """The trainable parameters, every kept one's reason (by id), the policy's first format and the ids of the
        measured tensors that may leave fp32 for it at their first update (`first_step`: the policy's format an
        integer one, the tensor not below ``min_numel``)."""
        model = self.session.model
        if model is None:
            return None
        fmt = make_format(make_policy(self.config).initial(), self.config.int8_block_size, self.config.int4_block_size)
        params = [p for p in model.parameters() if p.requires_grad]
        reasons = keep_reasons(model, self.config)
        leaving = {id(p) for p in params if reasons.get(id(p), "").startswith(MEASURED)
                   and p.numel() >= self.config.min_numel} if first_step.widening(fmt.name) else set()
        return params, reasons, fmt, leaving

    def passing_format(self, fmt: Any) -> Any:
        """The widest format a measured tensor leaves fp32 for where its first update's check passes, the policy's
        first format ``fmt`` an integer one (`first_step.widening`: int8 after int4): what it holds is at most that."""
        return make_format(first_step.widening(fmt.name)[-1], self.config.int8_block_size, self.config.int4_block_size)

    def price_at_bound(self, bound: bool) -> None:
        """`xirang_ds.roles.PricesAtBound`: a measured embedding's states at fp32 (``True``) or in the widest format
        its check can give them (`passing_format`)."""
        self.estimate_at_bound = bound

    def bound_headroom(self, shape: Any) -> Optional[str]:
        """`xirang_ds.roles.PricesAtBound`: what fp32 states of the measured embeddings hold over those in the
        format their check passes at (`passing_format`), over this rank's part; ``None`` without such a tensor."""
        layout = self._layout()
        if layout is None or not layout[3]:
            return None
        params, _, fmt, leaving = layout
        n = shape.world_size if shape.stage >= 1 else 1
        numel = -(-sum(p.numel() for p in params if id(p) in leaving) // n)  # their group's part, as ZeRO splits it
        passing = self.passing_format(fmt)
        more = make_format("fp32").state_bytes(numel) - passing.state_bytes(numel)
        return (f"{len(leaving)} measured embedding(s) priced with {passing.name} states, the widest their first "
                f"update's check moves them to; kept fp32 (the check fails) they hold {format_bytes(more)} "
                f"({more:,} bytes) more")

    def first_update(self, world: int) -> tuple[int, int, int]:
        """``(held, bound, index)`` of the largest measured tensor's first update (`first_step`) over a
        ``world``-way shard: what it holds at its most besides the parameter and its gradient (a chunk at
        `first_step.CHUNK_BYTES` an element, and the candidate formats' buffers over the shard), the states the
        estimate counts for that shard (fp32 at their bound, else the policy's format: the first update holds the
        candidates' in their place), and the tensor's place among the trainable parameters; ``(0, 0, -1)`` without
        measured tensors."""
        layout = self._layout()
        if layout is None:
            return 0, 0, -1
        params, reasons, fmt, leaving = layout
        measured = [i for i, p in enumerate(params) if reasons.get(id(p), "").startswith(MEASURED)]
        names = first_step.widening(fmt.name)  # the candidates, as `first_step.candidates` takes them at step 1
        if not measured or not names:
            return 0, 0, -1
        index = max(measured, key=lambda i: params[i].numel())
        shard = -(-params[index].numel() // max(world, 1))
        candidates = sum(make_format(name, self.config.int8_block_size, self.config.int4_block_size).state_bytes(shard)
                         for name in names)
        at_bound = id(params[index]) not in leaving or self.estimate_at_bound
        counted = make_format("fp32") if at_bound else self.passing_format(fmt)
        held = first_step.CHUNK_BYTES * min(shard, self.config.chunk_numel) + candidates
        return held, counted.state_bytes(shard), index

    def update_ops(self, shape: Any, numels: list, profile: Any) -> Optional[Any]:
        """`xirang_ds.roles.TimesUpdate`: the low-bit update's ops (`step_time.update_ops`)."""
        return step_time.update_ops(self, shape, numels, profile)

    def group_update_ops(self, shape: Any, pieces: list, profile: Any) -> Optional[Any]:
        """`xirang_ds.roles.TimesUpdate`: one optimizer step's ops over some pieces (`step_time.group_update_ops`)."""
        return step_time.group_update_ops(self, shape, pieces, profile)

    def adjust_estimate(self, phases: dict, shape: Any, numels: list) -> Optional[dict]:
        """States at the most precise format the policy starts from (the run's peak is there: a
        schedule only lowers precision, stability never rises above its start), fp32 for the kept
        parameters, over ZeRO's partition; step temporaries of one chunk instead of whole tensors."""
        import math

        layout = self._layout()
        if layout is None:
            return None
        params, reasons, fmt, leaving = layout  # the measured embeddings: a group of their own (`split_groups`)
        fmt_name = fmt.name
        measured = sum(p.numel() for p in params if id(p) in leaving)
        kept = sum(p.numel() for p in params if id(p) in reasons and id(p) not in leaving)
        quant = sum(p.numel() for p in params) - kept - measured
        n = shape.world_size if shape.stage >= 1 else 1
        fp32 = make_format("fp32")
        part = (lambda x: math.ceil(x / n))
        groups = sum(1 for numel in (kept, measured, quant) if numel)
        tensors = groups if shape.stage >= 1 else len(params)
        passing = fp32 if self.estimate_at_bound or not measured else self.passing_format(fmt)
        states = fp32.state_bytes(part(kept)) + passing.state_bytes(part(measured)) + fmt.state_bytes(part(quant)) \
            + 4 * tensors
        largest = part(quant) if shape.stage >= 1 else max(
            (p.numel() for p in params if id(p) not in reasons or id(p) in leaving and not self.estimate_at_bound),
            default=0)
        chunk = min(self.config.chunk_numel, max(largest, 1))
        temps = (8 if fmt_name == "fp32" else 16) * chunk
        first, bound, _ = self.first_update(n)  # step 1: a measured tensor's candidates in place of its states
        plain_temps = adam_temporaries(shape, [part(sum(numels))] if shape.stage >= 1 else list(numels))
        out = {}
        for name, cats in phases.items():
            cats = dict(cats)
            cats["optimizer_states"] = states
            if name == "optimizer_step":
                cats["temporaries"] = max(0, cats.get("temporaries", 0) - plain_temps) + max(temps, first - bound)
            out[name] = cats
        if masters.parks(self.config, self.session.ds_config) and self.session.stepper is None:
            zero = self.session.ds_config.get("zero_optimization") or {}
            out = masters.adjust_phases(out, shape, [p.numel() for p in params],
                                        int(float(zero.get("sub_group_size", 1e9))), self.config.masters == "none",
                                        self.config.masters == "remainders_8bit")
        return out

    # reporting and checkpoints ----------------------------------------------------------------
    def describe(self) -> str:
        if not self.optimizers:
            return "not built"
        numel: dict[str, int] = {}
        for opt in self.optimizers:
            for k, v in opt.format_numel().items():
                numel[k] = numel.get(k, 0) + v
        formats = (", ".join(f"{k} {v:,} elements" for k, v in numel.items()) if numel else
                   f"created at the first step, starting in {self.optimizers[0].policy.initial()}")
        held = sum(opt.state_nbytes() for opt in self.optimizers)
        measured = sum(r.startswith(MEASURED) for r in self.keep_reasons.values())
        checks = [m for opt in self.optimizers for m in opt.measurements]
        moved = sum(m[4] for m in checks)
        return (f"DynamicAdamW ({self.config.policy} policy) from {self.source}; states: {formats}; "
                f"{format_bytes(held)} on this rank; {len(self.keep_reasons) - measured} parameter(s) kept fp32"
                + (f", {measured} embedding(s) measured ({len(checks)} check(s), {moved} moved)" if measured else "")
                + f"; {self.optimizers[0].fused.describe()}"
                + (f"; masters as {'8-bit ' if self.parked[0].eight else ''}remainders: "
                   f"{format_bytes(sum(m.held_bytes() for m in self.parked))}"
                   if self.parked and not self.parked[0].stochastic else "")
                + ("; no masters (stochastic rounding into the bf16 weights)"
                   if self.parked and self.parked[0].stochastic else ""))

    def state_dict(self) -> dict:
        return {"config": config_to_dict(self.config)}

    def load_state_dict(self, state: dict) -> None:
        self._rehome()  # the loaded states are plain copies
        self.loaded_config = state.get("config")
        apart = ("fused", "masters")  # neither changes what a checkpoint holds
        layout = {k: v for k, v in config_to_dict(self.config).items() if k not in apart}  # how states are kept
        if self.loaded_config is not None and {k: v for k, v in self.loaded_config.items() if k not in apart} != layout:
            if self.engine is not None and self.engine.global_rank == 0:
                logger.info("xirang optimizer_states: the checkpoint's states were made with other settings; "
                            "each tensor is converted to the format the current settings pick at its next step")


def quantized_formats(config: OptimizerStatesConfig) -> list[str]:
    """The int8/int4 formats the policy can put a tensor in."""
    if config.policy == "steps":
        names = [e.dtype for e in config.schedule]
    else:
        order = STATE_DTYPE_ORDER
        names = list(order[order.index(config.stability.start):order.index(config.stability.lowest) + 1])
    return [n for n in dict.fromkeys(names) if n.startswith("int")]


def quantized_demand(optimizer: Any) -> tuple[int, int]:
    """``(bytes, largest)``: the most pool bytes the optimizer's int8/int4 buffers hold at once (the
    largest format's total, plus one tensor of another format while it converts) and its largest
    single buffer, each rounded up to the pool's alignment."""
    totals, per_tensor, largest = [], [], 0
    for name in quantized_formats(optimizer.config):
        fmt = optimizer._format(name)
        total = biggest = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if optimizer._pinned(p, group):
                    continue
                sizes = [align_up(t.numel() * t.element_size()) for m in MOMENTS
                         for t in fmt.zeros(m, param_numel(p), torch.device("meta")).values()]
                total += sum(sizes)
                biggest = max(biggest, sum(sizes))
                largest = max([largest] + sizes)
        totals.append(total)
        per_tensor.append(biggest)
    if not totals:
        return 0, 0
    return max(totals) + (max(per_tensor) if len(totals) > 1 else 0), largest
