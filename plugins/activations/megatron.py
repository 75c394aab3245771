"""activations under Megatron-core: its TransformerLayers are the candidates, saved inputs may be split
over the tensor-parallel group, recomputation restores Megatron's RNG tracker, and the plan is agreed over
the groups whose ranks must decide alike (`xirang_ds.compat.megatron`)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from xirang_ds.compat import megatron as mc
from xirang_ds.compat.megatron import REPLICATED_INPUT_CHILDREN, transformer_layers
from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import ACTIVATIONS
from xirang_ds.plugins.activations import head_megatron
from xirang_ds.plugins.activations.deepspeed import RunParts
from xirang_ds.plugins.activations.handlers import ShardHandler
from xirang_ds.plugins.activations.selection import NO_MATCH, PATH, glob_keys
from xirang_ds.registry import FrameworkPath


class MegatronActivations(FrameworkPath):
    """The model chunk inside Megatron's DDP / Float16Module."""

    def blocks(self, model: torch.nn.Module, problems: list) -> Optional[list[str]]:
        """Every ``TransformerLayer``; the modules whose inputs are identical on every tensor-parallel rank
        are remembered for ``distribute_saved_inputs``, which sequence parallelism rules out."""
        p = self.plugin
        blocks = [name for name, _ in transformer_layers(model)]
        children = [f"{b}.{child}" for b in blocks for child in REPLICATED_INPUT_CHILDREN]
        p.replicated_inputs = frozenset(blocks + children)
        if p.config.distribute_saved_inputs and getattr(getattr(model, "config", None), "sequence_parallel", False):
            problems.append((f"{PATH}.distribute_saved_inputs",
                             "true with Megatron's sequence parallelism (--sequence-parallel): the layers' inputs "
                             "are already split over the tensor-parallel group, not identical on its ranks. Fix: "
                             "set distribute_saved_inputs to false"))
        return blocks

    plans_before_run = False
    """The estimator models DeepSpeed's engine, not Megatron's: the run plans on profiled passes (`run_plan`)."""

    # output heads: a LanguageModule's output_layer and its own loss (`head_megatron`)
    defer = staticmethod(head_megatron.defer)

    def heads(self, model: torch.nn.Module, blocks: list[str]) -> list[str]:
        return [name for name, layer in head_megatron.output_layers(model).items()
                if head_megatron.why_not(layer) is None]

    def head_problem(self, model: torch.nn.Module, name: str) -> Optional[str]:
        module = model.get_submodule(name)
        if name not in head_megatron.output_layers(model):
            return (f"is a {type(module).__name__}; under Megatron-core chunk applies to a language model's "
                    "output_layer (whose logits reach its compute_language_model_loss)")
        why = head_megatron.why_not(module)
        return None if why is None else f"cannot be chunked {why}"

    def head_hooks(self, model: torch.nn.Module, heads: frozenset) -> list:
        """The owners' ``compute_language_model_loss``, wrapped to run the chunked loss on deferred logits."""
        layers = head_megatron.output_layers(model)
        owners = dict(model.named_modules())
        return [wrap_method(owners[name.rpartition(".")[0]], head_megatron.LOSS,
                            head_megatron.LanguageModelLoss(layers[name])) for name in sorted(heads) if name in layers]

    def stage_problems(self, problems: list) -> list:
        """Under pipeline parallelism each stage holds some of the modules (the output layer on the last,
        the embedding on the first): a glob of the section that matches no module of this stage is a
        problem only when it matches on no stage of the pipeline (agreed over the pipeline group)."""
        from megatron.core import parallel_state

        keys = glob_keys(self.plugin.config)
        if parallel_state.get_pipeline_model_parallel_world_size() <= 1 or not keys:
            return problems
        unmatched = {key for key, message in problems if NO_MATCH in message}
        matched = torch.tensor([int(key not in unmatched) for key in keys])
        torch.distributed.all_reduce(matched, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_pipeline_model_parallel_group())
        elsewhere = {key for key, hit in zip(keys, matched.tolist()) if hit}
        return [(key, message) for key, message in problems if not (NO_MATCH in message and key in elsewhere)]

    def token_wise(self, model: torch.nn.Module) -> frozenset:
        """None: ``recompute_tiled`` is not offered under Megatron-core (its RNG tracker and sequence
        parallelism are not sliced; a fixed one recomputes whole)."""
        return frozenset()

    def without_selective(self) -> Optional[str]:
        # local attention masks the baddbmm output in place (transformer/utils.py attention_mask_func:
        # masked_fill_), and torch refuses a mutated selective-checkpoint cache
        return ("under Megatron-core (local attention masks the cached attention scores in place, which "
                "selective checkpointing refuses)")

    def compiled(self, run: Any) -> Optional[str]:
        """None: the run's model chunks are planned module by module (Megatron compiles no model whole)."""
        return None

    def ds_config(self) -> dict:
        """None: the file's DeepSpeed keys (``activation_checkpointing``) do not apply under Megatron."""
        return {}

    def run_parts(self, run: Any) -> RunParts:
        p = self.plugin
        distribute = None
        if p.config.distribute_saved_inputs and run.tp_world_size > 1:
            from megatron.core import parallel_state

            tracker = self.session.tracker
            distribute = ShardHandler(parallel_state.get_tensor_model_parallel_group(),
                                      lambda: tracker.scope(ACTIVATIONS))
        return RunParts(model=mc.unwrap(run.module), groups=tuple(mc.agreement_groups()),
                        rng=(mc.rng_tracker_states, mc.set_rng_tracker_states),
                        arenas=mc.global_memory_buffer_tensors, distribute=distribute)


__all__ = ["MegatronActivations"]
