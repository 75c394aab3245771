"""activations under DeepSpeed: the engine's module (inside ``torch.compile``'s wrapper), its ds_config's
``activation_checkpointing`` keys, and what ZeRO-3 rules out."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from xirang_ds.compat.torch import uncompiled
from xirang_ds.plugins.activations import head_loss
from xirang_ds.plugins.activations.compiled import compiled_region
from xirang_ds.plugins.activations.config import ActivationsConfig
from xirang_ds.plugins.activations.gathered import GatheredRefs
from xirang_ds.plugins.activations.selection import token_wise_names
from xirang_ds.registry import FrameworkPath


class RunParts(NamedTuple):
    """What the activations runtime needs of the framework's run."""

    model: torch.nn.Module
    """The model whose module names the plan uses."""
    groups: tuple
    """Process groups the profiles and the plan are agreed over (``(None,)``: the world)."""
    rng: Any = None
    """``(get, set)`` of extra generator states a recomputation restores (Megatron's RNG tracker)."""
    arenas: Any = None
    """Returns tensors of persistent arenas the profile does not count as activations."""
    distribute: Any = None
    """A handler that splits saved inputs over the tensor-parallel group, or ``None``."""
    forward_scope: Any = None
    """A context entered around each forward with grad, with ``remove()`` (ZeRO-3's gathered
    weights saved by reference, `gathered.GatheredRefs`), or ``None``."""


class DeepSpeedActivations(FrameworkPath):
    """The DeepSpeed engine's module."""

    @classmethod
    def check(cls, config: ActivationsConfig) -> list[tuple[str, str]]:
        if config.distribute_saved_inputs:
            return [("distribute_saved_inputs", "true under DeepSpeed, which has no tensor-parallel group to "
                                                "distribute over (it is Megatron-core's "
                                                "distribute_saved_activations). Fix: set it to false")]
        return []

    def blocks(self, model: torch.nn.Module, problems: list) -> Optional[list[str]]:
        """The model's repeated blocks, when the framework names them (``None``: found structurally)."""
        return None

    def _zero3(self) -> bool:
        zero = self.session.ds_config.get("zero_optimization") or {}
        return isinstance(zero, dict) and zero.get("stage") == 3

    plans_before_run = True
    """The estimator models this engine, so the run takes the plan it makes (`run_plan`)."""

    # output heads (the chunk option; at ZeRO-3 the chunked loss gathers the head's weight itself,
    # `head_zero3.gathered`)
    defer = staticmethod(head_loss.defer)
    """How a head's calls are deferred (`wrapper.ModuleWrapper.head`)."""

    def heads(self, model: torch.nn.Module, blocks: list[str]) -> list[str]:
        """The output heads ``auto`` candidates add: wide ``nn.Linear`` layers outside ``blocks``."""
        return head_loss.head_modules(model, blocks)

    def head_problem(self, model: torch.nn.Module, name: str) -> Optional[str]:
        """Why the module ``name``, fixed to ``chunk``, cannot be chunked (``None``: it can)."""
        module = model.get_submodule(name)
        if isinstance(module, torch.nn.Linear):
            return None
        return (f"is a {type(module).__name__}; chunk applies to an output head, an nn.Linear whose output feeds "
                "cross_entropy (such as lm_head)")

    def head_hooks(self, model: torch.nn.Module, heads: frozenset) -> list:
        """Handles of what the heads' losses need besides the heads' wrappers (none under DeepSpeed:
        ``F.cross_entropy`` on deferred logits finds them)."""
        return []

    def stage_problems(self, problems: list) -> list:
        """The section's problems on this rank's model (every rank holds the whole model)."""
        return problems

    def token_wise(self, model: torch.nn.Module) -> frozenset:
        """Modules the planner may slice under ``recompute_tiled`` (none at ZeRO-3, whose module hooks
        gather the weights a slice's recomputation would use: untested there)."""
        return frozenset() if self._zero3() else token_wise_names(model, self.plugin.config)

    def without_selective(self) -> Optional[str]:
        """Why selective recompute cannot run here (``None``: it can)."""
        if self._zero3():
            # ZeRO-3's own linear function and selective checkpointing's op cache do not give
            # bit-identical gradients (measured); full recompute, compress and offload do.
            return "with ZeRO stage 3 (its gradients are not bit-identical there)"
        release = self.session.config.grad_release
        if release.enabled and release.exact_method == "two_pass":
            # the norm pass retains the graph and the update pass backs through it again; torch's
            # selective checkpointing marks its cached outputs consumed at the first backward
            # (torch/utils/checkpoint.py _CachedTorchDispatchMode, "Trying to backward an extra time")
            return "beside xirang.grad_release.exact_method \"two_pass\" (it backs through each graph twice)"
        return None

    compiled = staticmethod(compiled_region)
    """How the engine's model runs compiled (then planned as one unit, `compiled.py`), or ``None``."""

    def ds_config(self) -> dict:
        """The ds_config whose ``activation_checkpointing`` keys the fixed plan reads."""
        return self.session.ds_config

    def run_parts(self, engine: Any) -> RunParts:
        model = uncompiled(engine.module)
        return RunParts(model=model, groups=(None,), forward_scope=GatheredRefs(model) if self._zero3() else None)


__all__ = ["DeepSpeedActivations", "RunParts"]
