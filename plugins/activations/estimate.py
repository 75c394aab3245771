"""What the estimator (`xirang_ds.planning.estimator`) knows of the activations plugin before anything runs.

* Heads fixed to ``chunk`` (the block's ``chunk`` list) run chunked in the estimator's fake trace
  (`trace_context`), so the trace measures what the chunked head and loss keep for backward (the
  head's input and the targets) and hold while a slice's backward runs, instead of the whole logits
  and the loss's log-probabilities.
* The planner is modelled where it keeps every saved tensor (`adjust_estimate`): it takes that plan
  whenever the run fits, since keeping adds no step time. Below that its choices come from profiled
  passes and are not modelled; nor are the other fixed options.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch

from xirang_ds.hooks import wrap_method
from xirang_ds.memory.categories import ACTIVATIONS
from xirang_ds.plugins.activations.head_loss import CHUNK
from xirang_ds.plugins.activations.selection import fixed_plan

NOT_MODELLED = ("recompute", "selective_recompute", "recompute_offload", "compress", "quantize", "sparsify", "offload",
                "recompute_tiled", "recompute_tiled_offload")
"""Fixed options whose effect the estimate does not model."""


def trace_context(plugin: Any, model: torch.nn.Module, tracker: Any) -> Optional[ContextManager]:
    """The block's ``chunk`` heads chunked on the fake ``model`` while it is traced (slices of
    ``chunk_tokens`` rows, or the auto slice), their backward's slices counted as activations;
    ``None`` when the block fixes no head that can be chunked. Sets ``plugin.traced_heads``."""
    path, config = plugin.path, plugin.config
    fixed, _ = fixed_plan(model, config, path.ds_config(), [])
    heads = [n for n, o in fixed.items() if o == CHUNK and path.head_problem(model, n) is None]
    plugin.traced_heads = tuple(heads)
    if not heads:
        return None
    rows = None if config.chunk_tokens == "auto" else int(config.chunk_tokens)
    scope = lambda: tracker.scope(ACTIVATIONS)  # noqa: E731
    undo = contextlib.ExitStack()
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


def adjust_estimate(plugin: Any, phases: dict, shape: Any) -> Optional[dict]:
    """The phases unchanged when no module is fixed to an option the trace does not apply (``chunk``
    heads it does, `trace_context`) and, with the planner on, the budget covers the traced activations
    (``auto``: the whole estimated peak fits ``memory_budget``, or the device when the estimate is for
    this machine's accelerator); ``None`` (not modelled) otherwise."""
    from deepspeed.accelerator import get_accelerator

    c = plugin.config
    fixed = any(getattr(c, k) for k in NOT_MODELLED) or (c.chunk and not plugin.traced_heads)
    if fixed or c.budget_fraction is not None or plugin.session.ds_config.get("activation_checkpointing"):
        return None
    if not c.planner:
        return phases  # only keep and chunk are fixed, and the trace ran both
    totals = [sum(v for k, v in cats.items() if k != "host") for cats in phases.values()]
    saved = max(cats.get("activations", 0) for cats in phases.values())
    if c.budget != "auto":
        return phases if saved <= int(c.budget) else None
    budget = plugin.session.config.memory_budget
    if budget == "auto":
        acc = get_accelerator()
        if acc.device_name() != shape.device:
            return None  # the device the estimate is for is not this machine's
        budget = int(acc.total_memory())
    return phases if max(totals) <= int(budget) else None


__all__ = ["NOT_MODELLED", "adjust_estimate", "trace_context"]
