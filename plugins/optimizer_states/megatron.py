"""`DynamicAdamW` inside Megatron-core's optimizer: the seams of docs/megatron.md, in one place.

Read in megatron-core 0.16.1 (``megatron/core/optimizer/``):

* ``get_megatron_optimizer`` returns a ``ChainedOptimizer`` whose members (``FP32Optimizer``,
  ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``) each hold the ``torch.optim`` Adam or
  AdamW as ``.optimizer`` (``xirang_ds.compat.megatron.inner_optimizers``). That object is
  replaced by a `DynamicAdamW` over the very same param-group dicts: Megatron's LR scheduler writes
  ``lr``/``weight_decay`` into them, and ``load_state_dict`` matches saved groups to them by
  ``wd_mult``/``lr_mult``/``is_expert_parallel``/``is_decoupled_lr`` (optimizer.py L383
  ``_filter_and_reorder_param_groups``), so the groups are neither split nor copied: fp32-kept
  parameters are named one by one (``keep_fp32_params``).
* Each member's ``state_dict``/``load_state_dict`` are the inner optimizer's (``FP32Optimizer``
  L998-L1011): codes, scales and formats travel in Megatron's checkpoint as
  `DynamicAdamW.state_dict` writes them.
* Megatron's distributed checkpoints (``sharded_state_dict``, Megatron-LM ``--ckpt-format torch_dist``)
  map every state tensor onto the parameter's shape (``optim_state_to_sharding_state``). While a member
  builds that dict, `sharded_in_torch_layout` has its `DynamicAdamW` answer ``state_dict()`` in
  ``torch.optim.AdamW`` layout: each state decoded to fp32 and shaped like its parameter. The checkpoint
  is then plain Megatron's, loadable without the block, and a plain checkpoint loads with it. Loaded
  states are fp32; each tensor's next update encodes them in the format the policy picks, from the same
  values its codes decoded to, so the run resumes bit for bit (the stability policy's window restarts,
  and an embedding moved out of fp32 by measurement returns there until its next measurement). Saving
  and loading hold every state in fp32 at once (8 bytes per parameter), as plain Megatron's do.
* Megatron's distributed optimizer (``--use-distributed-optimizer``) steps this data-parallel rank's range
  of each parameter as a 1-D fp32 tensor (a view of an fp32 parameter, or the fp32 master of a 16-bit
  one's range: ``shard_fp32_groups`` / ``shard_fp32_from_float16_groups``, paired with the model
  parameters as ``model_fp32_groups`` / ``model_float16_groups``); `DynamicAdamW` steps those ranges
  like any tensor, and a range takes the keep-fp32 reason of its parameter. Its checkpoints (the
  ``torch`` format's ``save_parameter_state`` / ``load_parameter_state``, every ``sharded_state_dict``
  sharding type of ``torch_dist``) read each range's states through
  ``_get_main_param_and_optimizer_states`` and write them through ``_set_main_param_and_optimizer_states``
  (distrib_optimizer.py L883-L940) or, in the legacy ``dp_zero`` loader, into ``optimizer.state``
  directly. `distributed_seams` answers the reader with the states decoded to fp32 (the run keeps its
  codes) and, before any load, puts the states in ``torch.optim`` layout for Megatron to overwrite;
  the next update encodes them again, as above. Nothing else needs to travel: stochastic rounding's
  draws depend on the seed and the step only (`DynamicAdamW._rounding`), so every data-parallel rank
  resumes exactly although Megatron keeps one copy of the common part (``state_dict()``, DP rank 0's).
* Tensor parallelism: every rank steps its own shard. A parameter replicated on the tensor-parallel
  group (norms, row-parallel biases, position embeddings: ``tensor_model_parallel`` unset) must stay
  bit-identical on every rank of the group, so its states stay fp32, and so does the vocab-parallel
  embedding's shard (found by module type) under ``keep_fp32_embeddings_and_norms``.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from xirang_ds.compat.megatron import optimizer_members, parallel_layers, wrap_range_state_seams
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import wrap_method
from xirang_ds.plugins.optimizer_states.build import MEASURED, client_kind, group_decoupled, settings_from_client
from xirang_ds.plugins.optimizer_states.config import OptimizerStatesConfig
from xirang_ds.plugins.optimizer_states.export import decode_state, to_torch_optimizer
from xirang_ds.plugins.optimizer_states.masters import MegatronMasters, megatron_problem
from xirang_ds.plugins.optimizer_states.optimizer import DynamicAdamW, config_to_dict
from xirang_ds.registry import FrameworkPath

SECTION = "xirang.optimizer_states"
logger = logging.getLogger("xirang_ds")


def megatron_keep_reasons(model: torch.nn.Module, config: OptimizerStatesConfig) -> dict[int, str]:
    """Reasons to keep fp32 states that only Megatron's layers give (by parameter ``id``): replicated
    on the tensor-parallel group, or the vocab-parallel embedding's shard."""
    reasons: dict[int, str] = {}
    if config.keep_fp32_embeddings_and_norms:
        prefix = MEASURED if config.keep_fp32_embeddings_and_norms == "measured" else ""
        for name, module, kind in parallel_layers(model):
            if kind == "vocab":
                for p in module.parameters(recurse=False):
                    reasons[id(p)] = f"{prefix}embedding (VocabParallelEmbedding {name})"
    for name, p in model.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):
            reasons.setdefault(id(p), "replicated on the tensor-parallel group (kept bit-identical across its ranks)")
    return reasons


Replaced = tuple[Any, torch.optim.Optimizer, DynamicAdamW, list]
"""``(member, original torch optimizer, replacement, handles of the member's wrapped methods)``."""

DISTRIBUTED_LOADERS = ("load_state_dict", "load_parameter_state", "load_parameter_state_from_dp_zero")
"""The distributed optimizer's load entry points (``ChainedOptimizer.load_parameter_state`` calls each
member's ``load_parameter_state_from_dp_zero``)."""


def replace_inner(optimizer: Any, config: OptimizerStatesConfig, kept: dict[int, str]) -> list[Replaced]:
    """Put a `DynamicAdamW` in place of each member's ``torch.optim`` Adam/AdamW.

    Returns:
        One `Replaced` per member, for `restore_inner`.

    Raises:
        XirangConfigError: a member's optimizer is not Adam/AdamW (Megatron's ``--optimizer sgd``),
            or uses amsgrad; nothing is replaced then.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    members = optimizer_members(optimizer)
    problems = []
    for i, member in enumerate(members):
        inner = getattr(member, "optimizer", None)
        if client_kind(inner) is None:
            problems.append((f"{SECTION}.enabled",
                             f"member {i} of Megatron's optimizer ({type(member).__name__}) steps "
                             f"{type(inner).__module__}.{type(inner).__name__}; optimizer_states replaces Adam and "
                             "AdamW only (Megatron-LM --optimizer adam); use it, or set "
                             f"{SECTION}.enabled to false"))
    if config.masters in ("none", "remainders_8bit"):
        problems.append((f"{SECTION}.masters", f"is {config.masters!r} but this is a Megatron-core run: Megatron's "
                                               "optimizers copy their masters into the parameters (and the distributed "
                                               "optimizer gathers them) inside their step, so no master can be "
                                               "rounded stochastically in their place. Fix: set masters \"auto\", "
                                               "\"remainders\" or \"fp32\""))
    if config.masters == "remainders":
        for i, member in enumerate(members):
            problem = megatron_problem(member)
            if problem is not None:
                problems.append((f"{SECTION}.masters", f"is 'remainders' but in member {i} of Megatron's optimizer "
                                                       f"{problem}. Fix: set masters \"auto\" or \"fp32\""))
    if problems:
        raise XirangConfigError(problems)
    out = []
    for member in members:
        inner = member.optimizer
        settings = settings_from_client(inner)
        kind = client_kind(inner)
        for group in inner.param_groups:
            group["adam_w_mode"] = group_decoupled(kind, group, settings.adam_w_mode)
        pinned = {i: r for i, r in kept.items() if not r.startswith(MEASURED)}
        new = over_groups(inner.param_groups, **settings.as_kwargs(), states=config_to_dict(config),
                          keep_fp32_params=kept_steps(member, pinned),
                          measured_params=kept_steps(member, {i: r for i, r in kept.items() if i not in pinned}))
        for p, state in inner.state.items():
            if state:
                new.state[p] = dict(state)  # torch.optim.Adam(W) states are this optimizer's fp32 format
        member.optimizer = new
        if isinstance(member, DistributedOptimizer):
            handles = distributed_seams(member, new)
        else:
            handles = [wrap_method(member, "sharded_state_dict", functools.partial(sharded_in_torch_layout, new))]
        out.append((member, inner, new, handles))
    return out


def over_groups(groups: list[dict], **kwargs: Any) -> DynamicAdamW:
    """A `DynamicAdamW` stepping Megatron's own group dicts. The distributed optimizer's ranges are views of
    the parameters (not leaves), which ``torch.optim.Optimizer.add_param_group`` refuses; Megatron assigns
    them to its torch optimizer's ``param_groups`` directly (distrib_optimizer.py L605), and so does this."""
    new = DynamicAdamW([torch.empty(0)], **kwargs)
    for group in groups:
        for key, value in new.defaults.items():
            group.setdefault(key, value)
    new.param_groups = groups
    return new


def distributed_seams(member: Any, optimizer: DynamicAdamW) -> list:
    """The distributed optimizer's state reader, writer and load entry points wrapped (module docstring)."""
    def read(original: Any, model_param: torch.Tensor) -> dict:
        tensors = original(model_param)
        state = optimizer.state.get(tensors["param"])
        return {"param": tensors["param"], **decode_state(state, tensors["param"])} if state and "format" in state \
            else tensors

    def write(original: Any, model_param: torch.Tensor, tensors: dict) -> Any:
        group, order = member.model_param_group_index_map[model_param]
        main = optimizer.param_groups[group]["params"][order]
        in_torch_layout(optimizer, [main])
        state = optimizer.state.get(main) or {}
        if "step" in state:  # the step comes from load_state_dict (the saved param groups'); Megatron copies every
            # key of the state from ``tensors``, which hold no step (dp_zero) or, under dp_reshardable, the step
            # this optimizer had before loading (read when the sharded dict was built; with torch's Adam that
            # resets it, distrib_optimizer.py L1805)
            tensors = {**tensors, "step": state["step"].clone()}
        return original(model_param, tensors)

    def load(original: Any, *args: Any, **kwargs: Any) -> Any:
        in_torch_layout(optimizer, [p for g in optimizer.param_groups for p in g["params"]])
        out = original(*args, **kwargs)
        for state in optimizer.state.values():  # Megatron gives every state one step tensor (distrib_optimizer.py
            if "step" in state:  # L845), which torch keeps shared; each update adds 1 to its own
                state["step"] = state["step"].clone()
        return out

    loaders = [wrap_method(member, name, load) for name in DISTRIBUTED_LOADERS]
    return [*wrap_range_state_seams(member, read, write), *loaders]


def in_torch_layout(optimizer: DynamicAdamW, params: list[torch.Tensor]) -> None:
    """Each of ``params``' states in ``torch.optim.AdamW`` layout (fp32, shaped like the tensor): what a
    load then overwrites. The next update encodes them in the format the policy picks."""
    for p in params:
        state = optimizer.state.get(p)
        if state and "format" in state:
            optimizer.state[p] = decode_state(state, p)


def sharded_in_torch_layout(optimizer: DynamicAdamW, original: Any, *args: Any, **kwargs: Any) -> Any:
    """A member's ``sharded_state_dict`` built while ``optimizer.state_dict()`` answers in
    ``torch.optim.AdamW`` layout (states Megatron's ``init_state_fn`` made for loading are that already)."""
    def torch_layout_state_dict(state_dict: Any) -> dict:
        out = state_dict()
        by_index = dict(zip((i for g in out["param_groups"] for i in g["params"]),
                            (p for g in optimizer.param_groups for p in g["params"])))
        out["state"] = {i: decode_state(st, by_index[i]) if "format" in st else st for i, st in out["state"].items()}
        return out

    handle = wrap_method(optimizer, "state_dict", torch_layout_state_dict)
    try:
        return original(*args, **kwargs)
    finally:
        handle.remove()


def kept_steps(member: Any, kept: dict[int, str]) -> list[torch.Tensor]:
    """The tensors ``member`` steps for the model parameters in ``kept``: the parameters themselves
    (``FP32Optimizer``), or with ``--bf16``/``--fp16`` their fp32 masters (``Float16OptimizerWithFloat16Params``
    pairs ``float16_groups`` with ``fp32_from_float16_groups``, optimizer.py L657-L705; the distributed
    optimizer pairs the model parameters with the ranges it steps, distrib_optimizer.py L307-L457)."""
    steps = [p for g in member.optimizer.param_groups for p in g["params"]]
    out = [p for p in steps if id(p) in kept]
    pairs = (("float16_groups", "fp32_from_float16_groups"), ("model_fp32_groups", "shard_fp32_groups"),
             ("model_float16_groups", "shard_fp32_from_float16_groups"))  # the last two: the distributed optimizer's
    for models_name, steps_name in pairs:
        for models, masters in zip(getattr(member, models_name, None) or [], getattr(member, steps_name, None) or []):
            out.extend(master for model, master in zip(models, masters) if id(model) in kept)
    return out


def restore_inner(replaced: list[Replaced]) -> None:
    """Give each member its ``torch.optim`` object back, holding the states decoded to fp32."""
    for member, original, new, handles in replaced:
        for handle in handles:
            handle.remove()
        if member.optimizer is new:
            member.optimizer = to_torch_optimizer(new, into=original)


class MegatronStates(FrameworkPath):
    """`DynamicAdamW` in place of the ``torch.optim`` object inside each member of Megatron's optimizer."""

    def keep_reasons(self, model: torch.nn.Module) -> dict[int, str]:
        return megatron_keep_reasons(model, self.plugin.config)

    def prepare_optimizer(self, optimizer: Any) -> Any:
        p = self.plugin
        p.replaced = replace_inner(optimizer, p.config, p.kept_ids)
        p.optimizers = [new for _, _, new, _ in p.replaced]
        p.optimizer = p.optimizers[0] if p.optimizers else None
        p.source = f"Megatron's {', '.join(sorted({type(old).__name__ for _, old, _, _ in p.replaced}))}"
        return optimizer

    def attach(self, run: Any) -> None:
        p = self.plugin
        p.use_pool()
        self._park_masters()
        if run.global_rank == 0:
            logger.info("xirang optimizer_states: %s replaced by DynamicAdamW in %d member(s) of Megatron's "
                        "optimizer; %d parameter(s) keep fp32 states; masters: %s", p.source, len(p.replaced),
                        len(p.keep_reasons), p.masters_line)

    def _park_masters(self) -> None:
        """``masters``: the fp32 masters of each member's bf16 parameters parked between steps
        (`masters.MegatronMasters`); `replace_inner` refused an explicit ``remainders`` where it cannot."""
        p = self.plugin
        if p.config.masters == "fp32":
            p.masters_line = "fp32 (masters: fp32)"
            return
        members = [member for member, _, _, _ in p.replaced]
        problems = {megatron_problem(m) for m in members} - {None}
        parked = [MegatronMasters(m, p.session.tracker.scope) for m in members if megatron_problem(m) is None]
        p.keep_parked(parked, f"remainders between steps in {len(parked)} member(s)" if parked else
                      f"as the run keeps them ({'; '.join(sorted(problems))})")

    def states_moved(self) -> None:
        """Megatron's optimizers hold no views of the states: nothing to rebuild."""

    def remove(self) -> None:
        """Each member gets its ``torch.optim`` object back, holding the states decoded to fp32."""
        p = self.plugin
        if p.replaced:
            restore_inner(p.replaced)
            p.replaced = []
