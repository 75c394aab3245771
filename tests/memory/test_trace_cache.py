"""Estimates that trace the same model the same way share one fake trace (`xirang_ds.planning.trace_cache`):
an estimate on a reused trace equals a fresh one, byte for byte and in every plan, and anything the trace
reads that changes traces again."""
import copy

import pytest

from xirang_ds.planning.spec import estimate_spec
from xirang_ds.planning.trace_cache import reuse_traces

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"


def _config(block: dict, stage: int = 2, accum: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "xirang": block}


def _same(a, b) -> None:
    assert a.as_dict() == b.as_dict()


@pytest.mark.parametrize("block, stage, accum", [
    ({"preset": "balanced"}, 2, 1),
    ({"preset": "aggressive"}, 1, 2),
    ({"preset": "conservative", "precision": {"enabled": True}}, 2, 1),
    ({"preset": "balanced"}, 3, 1),
])
def test_an_estimate_on_a_reused_trace_equals_a_fresh_one(block, stage, accum):
    free = estimate_spec(MODEL, _config(block, stage, accum), world_size=2)
    need = free.predicted_peak_bytes
    budgets = [int(need * f) for f in (1.5, 0.9, 0.7)]  # fits, then tighter: the planner plans each differently
    fresh = [estimate_spec(MODEL, _config({**block, "memory_budget": b}, stage, accum), world_size=2) for b in budgets]
    with reuse_traces() as reuse:
        kept = [estimate_spec(MODEL, _config({**block, "memory_budget": b}, stage, accum), world_size=2)
                for b in budgets]
        again = estimate_spec(MODEL, _config({**block, "memory_budget": budgets[1]}, stage, accum), world_size=2)
    for a, b in zip(fresh, kept):
        _same(a, b)
    _same(fresh[1], again)
    assert reuse.traces + reuse.reused == 4 and reuse.reused >= 1
    assert len({e.predicted_peak_bytes for e in fresh}) > 1  # the budgets did change the estimate


def test_what_the_trace_reads_traces_again_and_the_rest_does_not():
    base = _config({"preset": "balanced"})
    with reuse_traces() as reuse:
        estimate_spec(MODEL, base, world_size=2)
        other = copy.deepcopy(base)
        other["train_micro_batch_size_per_gpu"] = 2  # the batch's shape: a new trace
        estimate_spec(MODEL, other, world_size=2)
        other = copy.deepcopy(base)
        other["zero_optimization"]["reduce_bucket_size"] = 1000  # a bucket the engine's emulation allocates
        estimate_spec(MODEL, other, world_size=2)
        other = copy.deepcopy(base)
        other["xirang"]["activations"] = {"options": ["keep", "recompute"]}  # what the planner profiles
        estimate_spec(MODEL, other, world_size=2)
        assert (reuse.traces, reuse.reused) == (4, 0)
        other = copy.deepcopy(base)
        other["optimizer"]["params"]["lr"] = 1e-4  # read by nothing the trace runs, but written: traced again
        estimate_spec(MODEL, other, world_size=2)
        estimate_spec(MODEL, base, world_size=2)
        assert (reuse.traces, reuse.reused) == (5, 1)
    with reuse_traces() as reuse:  # a new search keeps nothing of the last
        estimate_spec(MODEL, base, world_size=2)
        assert (reuse.traces, reuse.reused) == (1, 0)


def test_outside_a_search_nothing_is_kept():
    with reuse_traces() as reuse:
        pass
    estimate_spec(MODEL, _config({"preset": "balanced"}), world_size=2)
    assert (reuse.traces, reuse.reused) == (0, 0)
