"""optimizer_states' ``masters``: fp32 masters kept as bf16 remainders (`Parking`) between updates, for
DeepSpeed ZeRO-3's master partitions (`ParkedMasters`, below) and Megatron's Float16 and distributed
optimizers (`MegatronMasters`, at the end).

At ZeRO-3 in bf16 each rank holds, per sub-group (``zero_optimization.sub_group_size``), its
partition of the bf16 weights (``fp16_partitioned_groups_flat``) and an fp32 copy of it, the master
(``fp32_partitioned_groups_flat``) that the basic optimizer steps: 4 bytes per element of the
partition. Between updates each master is *parked*: its low 16 bits and one tie bit per element
(grad_release's `remainders`, exact) stay beside the bf16 partition and its storage is freed, 2.125
bytes instead of 4. Right before a sub-group gets its gradient (``_prepare_sub_group``) the master
is rebuilt bit for bit; after DeepSpeed has rounded it into the bf16 partition (``copy_``: round to
nearest even, what the remainders assume) and dropped the gradient (``_release_sub_group``) it is
parked again. So at most one sub-group's master is whole at a time, and training is the one with
fp32 masters, bit for bit, whatever the basic optimizer. With ``masters: none`` (lossy) nothing is
kept: parking rounds the master stochastically into the bf16 partition (grad_release's
``stochastic.round_``, counter-based noise; a pass after DeepSpeed's update, one compiled call per
sub-group where DynamicAdamW's ``fused`` is on, `fused.FusedStep.round_`) in place of DeepSpeed's round-to-nearest, and the next update starts from the
partition widened to fp32. With ``masters: remainders_8bit`` (not exact) parking rounds the master
stochastically to 16 significant bits and the bf16 partition to its nearest, ties away from zero
(grad_release's `remainders.round8_`), and keeps one byte per element (`split8`); a load's master
already on that grid rounds to itself.

What else reads or writes the masters sees them whole:

* ``state_dict`` saves rebuilt copies (DeepSpeed's checkpoint keeps its fp32 partitions; plain
  DeepSpeed and ``zero_to_fp32`` read it as their own);
* ``load_state_dict``, the universal-checkpoint loaders and ``_restore_from_bit16_weights`` (behind
  ``refresh_fp32_params``) run with every master whole and park after each one whose bf16 partition
  is its rounding (another stays whole until its next update rounds the partition from it;
  ``engine.offload_states`` is DeepSpeed's FusedAdam's only, so it never meets parked masters);
* ``get_full_hp_param``/``get_local_fp32_param`` (``safe_get_full_fp32_param``) rebuild the
  parameter's sub-group for the call; ``set_full_hp_param``/``set_local_hp_param`` leave it whole
  until its next update parks it (the master then differs from the bf16 weight, as in DeepSpeed).

The parked master is an empty tensor (same object: the optimizer's states and DeepSpeed's lists
keep it), so a reader not listed here fails on its size rather than reading stale numbers.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Optional

import torch

from xirang_ds.compat.deepspeed import ZERO3_WHOLE_MASTERS, around_zero3_update
from xirang_ds.compat.megatron import DUMMY_STATE_INIT, wrap_range_state_seams
from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import PARAMETERS
from xirang_ds.memory.run_shape import partition_numel, sub_group_numels
from xirang_ds.plugins.grad_release.remainders import join, join8, round_into, split, split8, tie_bytes
from xirang_ds.plugins.grad_release.stochastic import noise_seed
from xirang_ds.plugins.optimizer_states.fused import FusedStep

SECTION = "xirang.optimizer_states"

_READS = ("get_full_hp_param", "get_local_fp32_param")
_WRITES = ("set_full_hp_param", "set_local_hp_param")


def zero3_problem(optimizer: Any) -> Optional[str]:
    """Why ``optimizer`` (``engine.optimizer``) has no device fp32 masters of bf16 weights to park,
    or ``None``."""
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    weights = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    if masters is None or weights is None:
        return f"the optimizer is {type(optimizer).__name__}, not DeepSpeed's ZeRO-3 optimizer"
    if getattr(optimizer, "offload_optimizer", False):
        return "the fp32 masters are offloaded to the host (zero_optimization.offload_optimizer)"
    for i, (master, weight) in enumerate(zip(masters, weights)):
        if weight is None:
            return f"sub-group {i}'s weights are swapped to NVMe"
        if weight.dtype != torch.bfloat16:
            return f"the parameters are {str(weight.dtype).replace('torch.', '')}, not bf16"
        if master.dtype != torch.float32 or master.numel() != weight.numel():
            return f"sub-group {i}'s master is {master.dtype}{tuple(master.shape)}, not fp32 of the weights' size"
    return None


class Parking:
    """fp32 masters parked as remainders: ``masters[i]`` is the fp32 master of the bf16 ``weights[i]``
    (the same number of elements, the weight its round-to-nearest-even whenever it is parked).

    With ``stochastic`` (``masters: none``) nothing is kept: parking rounds the master stochastically
    into its weight (`_round_into_weight`) and frees it, and the next update starts from the weight
    widened to fp32, so the weight is the master.

    Args:
        weights, masters: the framework's own lists (read at each use: a framework may put another
            tensor in its list).
        scope: ``scope(category)``, the tracker's context naming what is allocated inside it.
        stochastic: keep no master (lossy): each park rounds the master into the weight stochastically.
        eight: keep an 8-bit remainder (``remainders_8bit``, not exact): each park rounds the master
            to 16 significant bits and the weight to its nearest (`remainders.round8_`).
    """

    def __init__(self, weights: list[torch.Tensor], masters: list[torch.Tensor], scope: Callable[[str], Any],
                 stochastic: bool = False, eight: bool = False):
        self.weights, self.masters, self.scope, self.stochastic = weights, masters, scope, stochastic
        self.eight = eight and not stochastic
        self.parked: dict[int, tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Size]] = {}
        """Entry → (remainder, tie bits, the master's shape) while its master is parked (``None`` twice
        with ``stochastic``, no tie bits with ``eight``)."""
        self._depth = 0  # `whole` blocks entered (a framework's loaders call one another)
        self._handles: list[Any] = []
        self.fused: Any = None
        """The basic optimizer's `fused.FusedStep` (DynamicAdamW's): ``stochastic`` rounds an entry in one
        compiled call where it is enabled (`FusedStep.round_`), else eagerly, the same bits either way."""

    def park(self, i: int) -> None:
        """Keep entry ``i``'s master as its remainder and tie bits (or, ``stochastic``, as its weight
        alone); free its fp32 storage."""
        master = self.masters[i]
        if i in self.parked or master.numel() == 0:
            return
        if self.stochastic:
            self._round_into_weight(i, master.detach().view(-1))
            self.parked[i] = (None, None, master.shape)
        elif self.eight:
            flat = master.detach().view(-1)
            self._round_into_weight(i, flat, 8)
            with torch.no_grad(), self.scope(PARAMETERS):
                remainder = torch.empty(master.numel(), dtype=torch.int8, device=master.device)
                split8(flat, remainder)
            self.parked[i] = (remainder, None, master.shape)
        else:
            weight = self._weight(i, master.device)
            with torch.no_grad(), self.scope(PARAMETERS):
                remainder = torch.empty(master.numel(), dtype=torch.int16, device=master.device)
                ties = torch.empty(tie_bytes(master.numel()), dtype=torch.uint8, device=master.device)
                split(master.detach().view(-1), weight, remainder, ties)
            self.parked[i] = (remainder, ties, master.shape)
        master.xirang_parked_numel = master.numel()  # what DynamicAdamW counts it as meanwhile (`param_numel`)
        master.data = torch.empty(0, dtype=master.dtype, device=master.device)

    def unpark(self, i: int) -> None:
        """Rebuild entry ``i``'s master bit for bit (nothing when it is whole)."""
        if i not in self.parked:
            return
        master = self.masters[i]
        master.data = self.rebuilt(i)
        del self.parked[i]

    def rebuilt(self, i: int) -> torch.Tensor:
        """A new fp32 tensor holding parked entry ``i``'s master, in its shape."""
        remainder, ties, shape = self.parked[i]
        with torch.no_grad(), self.scope(PARAMETERS):
            if remainder is None:  # stochastic: the weight is the master
                return self._weight(i, self.masters[i].device).to(torch.float32).view(shape)
            master = torch.empty(remainder.numel(), dtype=torch.float32, device=remainder.device)
            if ties is None:
                join8(self._weight(i, remainder.device), remainder, master)
            else:
                join(self._weight(i, remainder.device), remainder, ties, master)
        return master.view(shape)

    def _round_into_weight(self, i: int, master: torch.Tensor, low_bits: int = 16) -> None:
        """``masters: none``: the fp32 ``master`` (flat, consumed) rounded stochastically into weight ``i``
        (``low_bits`` 8: `remainders.round8_` for ``remainders_8bit``, the master kept to 16 bits).
        The noise is a function of the entry, its update count and the rank (`stochastic.noise_seed`),
        so a resumed run draws what the uninterrupted one would have; a master its weight already
        holds exactly (before the first update, after a load) rounds to that weight."""
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        weight = self.weights[i].detach().view(-1)
        seed = noise_seed(i, self.updates(i), rank)
        with torch.no_grad(), self.scope(PARAMETERS):
            if weight.device == master.device:
                round_into(master, weight, seed, low_bits=low_bits,
                           compiled=self.fused.round_ if self.fused is not None else None)
            else:  # parameters offloaded: rounded on the master's device, then copied
                rounded = torch.empty(master.numel(), dtype=torch.bfloat16, device=master.device)
                round_into(master, rounded, seed, low_bits=low_bits)
                weight.copy_(rounded)

    def updates(self, i: int) -> int:
        """How many updates entry ``i``'s master has had (its seed for `_round_into_weight`); the base
        class does not know, subclasses read their optimizer's count."""
        return 0

    def saved(self, i: int) -> torch.Tensor:
        """Entry ``i``'s master for a checkpoint: rebuilt when parked, else an alias of its storage (which
        outlives a later park: the master tensor then points elsewhere, the alias keeps the numbers)."""
        return self.rebuilt(i) if i in self.parked else self.masters[i].detach()

    def park_all(self, check: bool = False) -> None:
        """Park every whole master; with ``check`` (after anything that may have written a weight or a
        master apart: a load, a zero-gradient update), only those whose bf16 weight is their rounding;
        the others stay whole until their next update, which rounds the weight from the master
        (``eight`` parks them all: its park rounds the weight from the master)."""
        for i, master in enumerate(self.masters):
            if check and not self.eight and i not in self.parked and master.numel():
                if not torch.equal(master.detach().view(-1).to(torch.bfloat16), self._weight(i, master.device)):
                    continue
            self.park(i)

    def unpark_all(self) -> None:
        for i in list(self.parked):
            self.unpark(i)

    @contextlib.contextmanager
    def whole(self, check: bool = True) -> Iterator[None]:
        """Every master whole inside, parked again when the outermost such block ends (``check``: first
        that each weight is its master's rounding, after anything that may have written either)."""
        self.unpark_all()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.park_all(check=check)

    def held_bytes(self) -> int:
        """Bytes the parked masters hold (remainders and tie bits; none with ``stochastic``)."""
        return sum(r.numel() * r.element_size() + (t.numel() if t is not None else 0)
                   for r, t, _ in self.parked.values() if r is not None)

    def memory_roles(self) -> list[tuple[str, list[torch.Tensor]]]:
        return [(PARAMETERS, [t for r, ties, _ in self.parked.values() for t in (r, ties) if t is not None])]

    def remove(self) -> None:
        """Every master whole again, the framework's methods its own."""
        self.unpark_all()
        while self._handles:
            self._handles.pop().remove()
        for master in self.masters:
            vars(master).pop("xirang_parked_numel", None)

    def _weight(self, i: int, device: torch.device) -> torch.Tensor:
        """Entry ``i``'s bf16 weight, flat, on ``device`` (a copy where parameters are offloaded)."""
        weight = self.weights[i].detach().reshape(-1)
        return weight if weight.device == device else weight.to(device)

    def _whole_during(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.whole():
            return original(*args, **kwargs)


class ParkedMasters(Parking):
    """DeepSpeed's ZeRO-3 optimizer's masters parked between updates, a sub-group at a time (module docstring).

    Args:
        optimizer: DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3`` (`zero3_problem` is None for it).
        scope: ``scope(category)``, the tracker's context naming what is allocated inside it.
    """

    def __init__(self, optimizer: Any, scope: Callable[[str], Any], stochastic: bool = False, eight: bool = False):
        super().__init__(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat, scope,
                         stochastic, eight)
        self.optimizer = optimizer
        fused = getattr(optimizer.optimizer, "fused", None)
        self.fused = fused if isinstance(fused, FusedStep) else None  # DynamicAdamW's, not another optimizer's
        self._handles += around_zero3_update(optimizer, self.unpark, self.park)
        self._handles.append(wrap_method(optimizer, "state_dict", self._state_dict))
        for name in ZERO3_WHOLE_MASTERS:  # every master whole during the call, parked after where it can be
            if hasattr(optimizer, name):
                self._handles.append(wrap_method(optimizer, name, self._whole_during))
        for name in _READS + _WRITES:
            if hasattr(optimizer, name):
                self._handles.append(wrap_method(optimizer, name, self._param_call(write=name in _WRITES)))
        optimizer._xirang_whole_masters = self.whole  # xirang's checkpoint take-over writes masters inside it
        self.park_all()

    def remove(self) -> None:
        super().remove()
        vars(self.optimizer).pop("_xirang_whole_masters", None)

    def updates(self, i: int) -> int:
        """The basic optimizer's step count of sub-group ``i``'s master (0 before its first update, or
        for an optimizer that keeps none)."""
        step = self.optimizer.optimizer.state.get(self.masters[i], {}).get("step", 0)
        return int(step.item() if torch.is_tensor(step) else step)

    # DeepSpeed's methods ------------------------------------------------------------------------
    def _state_dict(self, original: Callable[[], dict]) -> dict:
        from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS

        out = original()
        groups = out.get(FP32_FLAT_GROUPS)
        if groups is self.masters:  # DeepSpeed's own list: the checkpoint gets a new one (`saved`)
            out[FP32_FLAT_GROUPS] = [self.saved(i) for i in range(len(groups))]
        return out

    def _param_call(self, write: bool) -> Callable[..., Any]:
        """A wrapper of ``get_full_hp_param``-like methods (``param``, ``optim_state_key`` arguments):
        the parameter's sub-group whole for a call on the master (no ``optim_state_key``)."""
        def call(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(original).bind(*args, **kwargs).arguments
            param = bound.get("param")
            group = None
            if bound.get("optim_state_key") is None and getattr(param, "requires_grad", False):
                group = self.optimizer.grad_position[self.optimizer.get_param_id(param)][0]
            was_parked = group in self.parked
            if was_parked:
                self.unpark(group)
            out = original(*args, **kwargs)
            if was_parked and not write:  # read only: weight and master as they were, so the split is exact
                self.park(group)
            return out  # a write leaves the master whole until its next update parks it

        return call


def megatron_problem(member: Any) -> Optional[str]:
    """Why a member of Megatron's optimizer has no fp32 masters of bf16 parameters to park, or ``None``."""
    distributed = hasattr(member, "shard_fp32_from_float16_groups")
    groups = getattr(member, "shard_float16_groups" if distributed else "float16_groups", None)
    if groups is None or not hasattr(member, "fp32_from_float16_groups") and not distributed:
        return f"Megatron's {type(member).__name__} keeps no fp32 masters (fp32 parameters)"
    if getattr(member.config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return "the distributed optimizer copies its masters into MXFP8 parameters (--fp8-param-gather)"
    if not any(p.dtype == torch.bfloat16 for g in groups for p in g):
        return "the 16-bit parameters are fp16, not bf16"
    return None


class MegatronMasters(Parking):
    """The fp32 masters of a Megatron optimizer member's bf16 parameters parked between steps:
    ``Float16OptimizerWithFloat16Params``' one per parameter (``fp32_from_float16_groups``), or the
    distributed optimizer's one per range of this data-parallel rank (``shard_fp32_from_float16_groups``,
    beside the bf16 ranges ``shard_float16_groups`` of the parameter buffer).

    Megatron steps every master at once: ``prepare_grads`` gives each its gradient, ``step_with_ready_grads``
    updates them and copies them into the parameters (``copy_``: round to nearest even). They are whole from
    the start of the first to the end of the second (the step holds what it held before) and parked between
    steps, where Megatron's forward and backward run. ``state_dict`` saves rebuilt copies;
    ``sharded_state_dict`` (which reads each master's shape), the loaders and ``reload_model_params`` run
    with them whole and park after each one whose weight is its rounding; what a checkpoint keeps of a
    master is an alias that outlives the park. The distributed optimizer reads and writes a range's master through its
    per-parameter seams (`xirang_ds.compat.megatron.wrap_range_state_seams`), which rebuild a parked one.

    Args:
        member: the member of Megatron's (chained) optimizer (`megatron_problem` is None for it).
        scope: ``scope(category)``, the tracker's context naming what is allocated inside it.
    """

    WHOLE_DURING = ("load_state_dict", "reload_model_params", "sharded_state_dict", "load_parameter_state",
                    "load_parameter_state_from_dp_zero", "get_parameter_state_dp_zero")
    """The members' methods that read or write every master outside a step (their public entry points)."""

    def __init__(self, member: Any, scope: Callable[[str], Any]):
        distributed = hasattr(member, "shard_fp32_from_float16_groups")
        models, mains = ((member.shard_float16_groups, member.shard_fp32_from_float16_groups) if distributed else
                         (member.float16_groups, member.fp32_from_float16_groups))
        pairs = [(model, main) for group_models, group_mains in zip(models, mains)
                 for model, main in zip(group_models, group_mains) if model.dtype == torch.bfloat16]
        super().__init__([w for w, _ in pairs], [m for _, m in pairs], scope)
        self.member = member
        self._index = {id(m): i for i, m in enumerate(self.masters)}

        self._handles += [wrap_method(member, "prepare_grads", self._whole_for_step),
                          wrap_method(member, "step_with_ready_grads", self._parked_after_step),
                          wrap_method(member, "state_dict", self._state_dict)]
        for name in self.WHOLE_DURING:
            if hasattr(member, name):
                self._handles.append(wrap_method(member, name, self._whole_during))
        if hasattr(member, DUMMY_STATE_INIT):  # its zero-gradient update moves masters (weight decay), not weights:
            # they stay whole for the load that overwrites them, and the next update parks them
            self._handles.append(wrap_method(member, DUMMY_STATE_INIT, self._whole_for_step))
        if distributed:
            self._handles += wrap_range_state_seams(member, self._read_range, self._write_range)
        self.park_all(check=True)

    def _whole_for_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.unpark_all()  # a skipped step (fp16's inf) leaves them whole until the next update parks them
        return original(*args, **kwargs)

    def _parked_after_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        self.park_all()  # each parameter was just rounded from its master
        return out

    def _state_dict(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> dict:
        out = original(*args, **kwargs)
        key = "fp32_from_fp16_params"  # the distributed optimizer's state_dict holds no master
        if key in out:  # Megatron's own lists: the checkpoint gets new ones (`saved`)
            out[key] = [[self.saved(self._index[id(m)]) if id(m) in self._index else m for m in group]
                        for group in out[key]]
        return out

    def _range(self, model_param: torch.Tensor) -> Optional[int]:
        group, order = self.member.model_param_group_index_map[model_param]
        return self._index.get(id(self.member.optimizer.param_groups[group]["params"][order]))

    def _read_range(self, original: Callable[..., Any], model_param: torch.Tensor) -> dict:
        i = self._range(model_param)
        if i in self.parked:  # a path not wrapped whole: rebuilt, and whole until the next update parks it
            self.unpark(i)
        tensors = original(model_param)
        return tensors if i is None else {**tensors, "param": tensors["param"].detach()}

    def _write_range(self, original: Callable[..., Any], model_param: torch.Tensor, tensors: dict) -> Any:
        i = self._range(model_param)
        if i in self.parked:
            self.unpark(i)
        return original(model_param, tensors)

__all__ = ["MegatronMasters", "ParkedMasters", "Parking", "megatron_problem", "zero3_problem"]


# estimate ---------------------------------------------------------------------------------------
def adjust_phases(phases: dict, shape: Any, numels: list[int], sub_group_size: int, stochastic: bool = False,
                  eight: bool = False) -> dict:
    """The estimate's phases with ZeRO-3's masters parked: the model's ``4 * partition`` fp32 bytes
    become the remainders and tie bits of every sub-group (nothing with ``stochastic``, one byte an
    element with ``eight``), and the step
    holds one sub-group's master whole besides them (its own remainders freed while it updates, held
    while it is rebuilt or split: the larger of that and the update's temporaries)."""
    subs = sub_group_numels(numels, shape.groups, shape.world_size, sub_group_size)
    held = [0 if stochastic else s if eight else 2 * s + tie_bytes(s) for s in subs]
    largest = max(range(len(subs)), key=subs.__getitem__)
    saved = 4 * partition_numel(sum(numels), shape.world_size) - sum(held)
    out = {}
    for name, cats in phases.items():
        cats = dict(cats)
        cats[PARAMETERS] -= saved
        if name == "optimizer_step":
            cats[PARAMETERS] += 4 * subs[largest] - held[largest]
            cats["temporaries"] = max(cats.get("temporaries", 0), held[largest])
        out[name] = cats
    return out


def parks(config: Any, ds_config: dict) -> bool:
    """Whether DeepSpeed's own step of a run of ``ds_config`` (the plugins' copy: grad_release hands it
    stage 0) parks its masters: ``masters`` not fp32, ZeRO-3 in bf16, masters on the device."""
    zero = ds_config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    return (config.masters != "fp32" and int(zero.get("stage", 0) or 0) == 3 and offload in (None, "none")
            and (ds_config.get("bf16") or {}).get("enabled") in (True, "true"))
