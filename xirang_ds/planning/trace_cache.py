"""One fake trace for every estimate that would trace the same thing (``xirang-ds estimate``'s search).

``xirang-ds estimate`` confirms a least budget and searches for a change that fits by estimating the model
again (`xirang_ds.planning.suggest`): four to nine more estimates, each one a fake forward and backward of
the whole model (about 10 s each for a 70B Llama on this 2-core machine). Most of them change only
``memory_budget``, which the planner, the tiers and the buckets read after the trace, not the trace
itself. Inside `reuse_traces`, `traced` keeps each trace under what it depends on and hands it back to a
later estimate with the same:

* the model (its spec: a built-in name, a factory and its shapes, an HF config's path) and the batch
  (``seq``, ``vocab``; a run's own batch, ``inputs``, is never reused);
* what the trace read of the run's shape (`RunShape`: the dtype, the micro-batch, accumulation, and for the
  engine's emulation the ZeRO stage and the reduction bucket as the plugins sized it for this budget),
  recorded while it ran, so a budget that moves a bucket the trace allocates traces again, and one that
  moves only ZeRO-3's gather buckets (which the estimate prices after the trace) does not;
* the ds_config as written, less the block, and the world size;
* each plugin that changes the trace (`xirang_ds.roles.ChangesTrace`), by its ``trace_key``: what of its
  settings its ``trace_context`` reads.

A plugin's ``trace_context`` records what the trace found on the plugin itself (the activation
planner's candidates and their profiles): a reused trace gives the new session's plugin those attributes
back, everything the plugin set from ``trace_context`` to the end of the trace. The test
(`tests/memory/test_trace_cache.py`) checks that an estimate on a reused trace equals a fresh one.
Outside `reuse_traces` nothing is kept: a model file or factory that changes between two estimates of one
process is traced again.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Optional

from xirang_ds.config.loader import BLOCK_KEY
from xirang_ds.roles import ChangesTrace


@dataclass
class Reuse:
    """The traces kept while `reuse_traces` is open.

    Attributes:
        kept: the traces made (below).
        traces: fake traces run.
        reused: estimates that took a kept one instead.
    """

    kept: dict = field(default_factory=dict)
    """``{key: [(shape attributes read, trace, plugin attributes), ...]}``."""
    traces: int = 0
    reused: int = 0


_OPEN: Optional[Reuse] = None


@contextlib.contextmanager
def reuse_traces() -> Iterator[Reuse]:
    """Within it, estimates of the same trace share one (module docstring); nested, the outer one keeps."""
    global _OPEN
    if _OPEN is not None:
        yield _OPEN
        return
    _OPEN = Reuse()
    try:
        yield _OPEN
    finally:
        _OPEN = None


class _Reads:
    """A run shape that records which of its attributes are read (the trace's dependence on it)."""

    def __init__(self, shape: Any):
        self.__dict__.update(whole=shape, read={})

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.whole, name)
        self.read[name] = value
        return value


def _changing(session: Any) -> list:
    return session.plugins_with(ChangesTrace) if session is not None else []


def traced(trace: Callable[[Any], Any], model_key: Optional[Hashable], shape: Any, seq: Optional[int],
           vocab: Optional[int], ds_config: dict, session: Any) -> Any:
    """``trace(shape)``, or the trace an earlier estimate made of the same (module docstring), with what it set on
    the plugins that change it; ``model_key`` ``None`` (a run's batch, an unnamed model) always traces."""
    reuse = _OPEN
    if reuse is None or model_key is None:
        return trace(shape)
    changing = _changing(session)
    written = json.dumps({k: v for k, v in ds_config.items() if k != BLOCK_KEY}, sort_keys=True, default=repr)
    key = (model_key, seq, vocab, written, getattr(shape, "world_size", None),
           tuple((type(p).__name__, p.trace_key()) for p in changing))
    try:
        hash(key)
    except TypeError:  # a model key that is no value (a spec object of the caller's own)
        return trace(shape)
    for read, made, states in reuse.kept.get(key, ()):
        if all(getattr(shape, name) == value for name, value in read.items()):
            for plugin, state in zip(changing, states):
                vars(plugin).update(state)
            reuse.reused += 1
            return made
    before = [dict(vars(p)) for p in changing]
    recording = _Reads(shape)
    made = trace(recording)
    states = [{k: v for k, v in vars(p).items() if k not in was or was[k] is not v} for p, was in zip(changing, before)]
    reuse.kept.setdefault(key, []).append((dict(recording.read), made, states))
    reuse.traces += 1
    return made


__all__ = ["Reuse", "reuse_traces", "traced"]
