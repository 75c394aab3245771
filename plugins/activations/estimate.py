"""What the estimator (`xirang_ds.planning.estimator`) knows of the activations plugin before anything runs.

* Heads fixed to ``chunk`` (the block's ``chunk`` list) run chunked in the estimator's fake trace
  (`trace_context`), so the trace measures what the chunked head and loss keep for backward (the
  head's input and the targets) and hold while a slice's backward runs, instead of the whole logits
  and the loss's log-probabilities.
* The planner plans on the fake trace (`trace_plan`): a forward of its own before the first measured one
  is a profiling pass of the candidates, and `adjust_estimate` plans under the budget with what the rank needs besides saved
  activations taken from the phases, then puts the plan's saved activations into them. The plan is
  ``plugin.estimate_plan``; at ``initialize`` the run takes the plan the estimator made for it.
* Other fixed options (recompute, compress, offload ... written by hand, or DeepSpeed's
  ``activation_checkpointing``) are not modelled.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Optional

import torch

from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import ACTIVATIONS
from xirang_ds.plugins.activations.head_loss import CHUNK
from xirang_ds.plugins.activations.head_rows import round_bytes
from xirang_ds.memory.device_profile import PROFILES, DeviceProfile
from xirang_ds.plugins.activations.selection import fixed_plan
from xirang_ds.plugins.activations.trace_plan import describe, least_saved, plan_phases, profile_trace

NOT_MODELLED = ("recompute", "selective_recompute", "recompute_offload", "compress", "quantize", "sparsify", "offload",
                "recompute_tiled", "recompute_tiled_offload")
"""Fixed options whose effect the estimate does not model."""


def trace_context(plugin: Any, model: torch.nn.Module, tracker: Any) -> Optional[ContextManager]:
    """The block's ``chunk`` heads chunked on the fake ``model`` while it is traced (slices of
    ``chunk_tokens`` rows, or the auto slice), their backward's slices counted as activations, and the
    planner's free candidates profiled on its first forward (`trace_plan.profile_trace`); ``None`` when
    neither applies. Sets ``plugin.traced_heads`` and ``plugin.trace_free``."""
    path, config = plugin.path, plugin.config
    fixed, _ = fixed_plan(model, config, path.ds_config(), [])
    heads = [n for n, o in fixed.items() if o == CHUNK and path.head_problem(model, n) is None]
    plugin.traced_heads = tuple(heads)
    plugin.trace_free = []
    plugin.trace_profiles = {}
    undo = contextlib.ExitStack()
    if config.planner and not plugin.session.ds_config.get("activation_checkpointing"):
        plugin.prepare_model(model)  # candidates, heads, tolerant modules: as initialize finds them
        plugin.trace_free = plugin.free_candidates()
        if plugin.trace_free:  # the plugin's own wrappers, the fixed heads' included
            undo.enter_context(profile_trace(plugin, model, tracker, plugin.trace_free, heads, trace_profile(plugin)))
            return undo
    if not heads:
        return None
    rows = None if config.chunk_tokens == "auto" else int(config.chunk_tokens)
    scope = lambda: tracker.scope(ACTIVATIONS)  # noqa: E731
    for name in heads:
        head = model.get_submodule(name)
        undo.callback(wrap_method(head, "forward", _Chunked(head, path.defer, rows, scope)).remove)
    for handle in path.head_hooks(model, frozenset(heads)):
        undo.callback(handle.remove)
    return undo


class _Chunked:
    """A head's forward under ``chunk`` without the plugin's runtime (the fake trace's)."""

    def __init__(self, module: torch.nn.Module, defer: Any, rows: Optional[int], scope: Any):
        self.module, self.defer, self.rows, self.scope = module, defer, rows, scope

    def __call__(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        def consume(logits: Any, target: Any, whole: Any, chunked: Any) -> torch.Tensor:
            call = logits.call
            return chunked(logits.tokens, call.weight, call.bias, logits.casts, self.rows, self.scope, None)

        def materialize(call: Any) -> torch.Tensor:
            out = original(call.hidden, *call.rest[0], **call.rest[1])
            return out[0] if isinstance(out, tuple) else out

        deferred = self.defer(self.module, args, kwargs, consume, materialize) if torch.is_grad_enabled() else None
        return original(*args, **kwargs) if deferred is None else deferred


def trace_profile(plugin: Any) -> DeviceProfile:
    """The device profile the trace's plan is priced by: the session's (``--gpu``, or the run's device at
    ``initialize``), else the CPU's."""
    return getattr(plugin.session, "device_profile", None) or PROFILES["cpu"]


def adjust_estimate(plugin: Any, phases: dict, shape: Any) -> Optional[dict]:
    """The phases with the planner's plan made on the trace (`trace_plan.plan_phases`; ``plugin.estimate_plan``
    holds it), or unchanged when only ``keep`` and ``chunk`` are fixed; ``None`` (not modelled) when a
    module is fixed to an option the trace does not apply, or the budget is a fraction of a measurement."""
    c = plugin.config
    plugin.estimate_plan = None
    fixed = any(getattr(c, k) for k in NOT_MODELLED) or (c.chunk and not plugin.traced_heads)
    if fixed or c.budget_fraction is not None or plugin.session.ds_config.get("activation_checkpointing"):
        return None
    if not c.planner or not plugin.trace_free:
        return phases  # only keep and chunk are fixed, and the trace ran both
    chunked = {name: CHUNK for name in plugin.traced_heads}
    plugin.estimate_head_rounds = head_rounds(plugin, shape)  # set for each estimate, not by the trace
    replay = getattr(plugin.session, "estimate_replay", None)  # the plan made at the sizes' bounds, priced again
    adjusted, result = plan_phases(plugin, phases, plugin.trace_free, chunked, shape.device != "cpu",
                                   device_total(plugin, shape), trace_profile(plugin),
                                   (replay or {}).get(plugin.section))
    plugin.estimate_plan = result
    plugin.estimate_note = describe(result)
    return adjusted


def head_rounds(plugin: Any, shape: Any) -> dict[str, Callable[[int], int]]:
    """For each output head whose weight gives its gradient by rows where it is chunked (the stepper's
    ``rows_round``: grad_release at ZeRO 1/2 over several ranks), what its backward holds at once for slices of
    a number of rows (`head_rows.round_bytes`), in place of a token slice's (`ModuleProfile.chunk_row_bytes`)."""
    rounds = getattr(plugin.session.stepper, "rows_round", None)
    model = plugin.session.model
    out = {}
    for name in plugin.head_names if rounds is not None and model is not None else ():
        p = plugin.trace_profiles.get(name)
        weight = getattr(model.get_submodule(name), "weight", None)
        taken = rounds(weight, shape) if p is not None and p.chunk_vocab and weight is not None else None
        if taken is not None:
            out[name] = functools.partial(round_bytes, p.chunk_tokens, vocab=p.chunk_vocab, hidden=p.chunk_hidden,
                                          world=taken[0], head_bytes=p.chunk_head_bytes,
                                          loss_bytes=p.chunk_loss_bytes, comm_bytes=taken[1])
    return out


def reducible_bytes(plugin: Any) -> int:
    """Keep-all saved bytes less the least any plan needs, on the trace's profiles (0 without them)."""
    if not plugin.trace_free or not plugin.trace_profiles:
        return 0
    keep, least = least_saved(plugin, plugin.trace_free, {name: CHUNK for name in plugin.traced_heads},
                              trace_profile(plugin))
    return max(0, keep - least)


def device_total(plugin: Any, shape: Any) -> Optional[int]:
    """What ``memory_budget: auto`` stands for: this machine's accelerator when the estimate is for its
    device, the session's ``device_total_bytes`` when given; ``None`` when neither is known."""
    from deepspeed.accelerator import get_accelerator

    known = getattr(plugin.session, "device_total_bytes", None)
    if known is not None:
        return int(known)
    acc = get_accelerator()
    return int(acc.total_memory()) if acc.device_name() == shape.device else None


__all__ = ["NOT_MODELLED", "adjust_estimate", "device_total", "reducible_bytes", "trace_context", "trace_profile"]
