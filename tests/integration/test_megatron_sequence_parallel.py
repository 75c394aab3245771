"""Sequence parallelism under Megatron-core: ``examples/megatron_gpt.py --sequence-parallel`` at TP=2 on 2 ranks
over gloo, dropout on, 2 micro-batches per step. On CPU the norms are the test shim's `SequenceParallelNorm`
(torch's LayerNorm standing in for Apex's, its parameters marked ``sequence_parallel``).

* plain Megatron with sequence parallelism trains like without it (dropout masks differ) and holds fewer
  activation bytes;
* activations: lossless plans (keep, recompute, compress, offload, recompute with inputs on the host, the
  planner) give losses bit-identical to plain Megatron with sequence parallelism, and lower the activation
  bytes; the output layer is not chunked (its input is split over the sequence) and says so;
  ``distribute_saved_inputs`` is refused;
* optimizer_states: fp32 states bit-identical; int8 within 2%; the norms (replicated on the TP group, their
  gradients all-reduced over it) keep fp32 states and stay equal on both ranks;
* precision: bf16 per op from fp32 weights trains like fp32 (the TP=2 bound);
* grad_release: refused, naming sequence parallelism and the fix.
"""
from __future__ import annotations

import os
import zlib

import pytest

from tests.harness.megatron_runs import config_error, example, write_block
from xirang_ds.launch import run_ranks

pytest.importorskip("megatron.core")

STEPS = 3
ARGV = ["--tp", "2", "--sequence-parallel", "--steps", str(STEPS), "--overlap-grad-reduce", "--dropout", "0.1"]
LOSSLESS = {
    "keep": {"planner": False, "keep": ["decoder.layers.*"]},
    "recompute": {"planner": False, "recompute": ["decoder.layers.*"]},
    "compress": {"planner": False, "compress": ["decoder.layers.*"]},
    "offload": {"planner": False, "offload": ["decoder.layers.*"]},
    "recompute_offload": {"planner": False, "recompute_offload": ["decoder.layers.*"]},
    "planner": {"budget_fraction": 0.5, "options": ["keep", "recompute", "compress", "offload", "chunk"]},
}
"""The lossless activation plans run (the ``"activations"`` section of each)."""
BLOCKS = {
    **{name: {"activations": {"enabled": True, **section}} for name, section in LOSSLESS.items()},
    "fp32_states": {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "fp32"}]}},
    "int8_states": {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]}},
    "precision": {"precision": {"enabled": True}},
}
REFUSED = {
    "grad_release": {"grad_release": {"enabled": True}},
    "distribute": {"activations": {"enabled": True, "planner": False, "recompute": ["decoder.layers.*"],
                                   "distribute_saved_inputs": True}},
    "chunk": {"activations": {"enabled": True, "planner": False, "chunk": ["output_layer"]}},
}
"""Blocks that sequence parallelism rules out: each must stop with the reason."""


def _inspect(model, optimizer, session) -> dict:
    from xirang_ds.compat.megatron import unwrap

    out = {"norms": {n: zlib.crc32(p.detach().numpy().tobytes()) for n, p in unwrap(model).named_parameters()
                     if getattr(p, "sequence_parallel", False)}}
    states = session.plugin("optimizer_states") if session else None
    if states is not None:
        out["kept"] = dict(states.keep_reasons)
        out["formats"] = states.optimizer.format_numel()
    plan = session.plugin("activations") if session else None
    if plan is not None:
        out["plan"] = dict(plan.plan)
    return out


def sp(rank: int, world: int, tmp: str) -> dict:
    ex = example()
    created = ex.setup(rank, world, 2)
    try:
        out = {"plain": ex.train(ex.parse_args(ARGV), _inspect),
               "without_sp": ex.train(ex.parse_args([a for a in ARGV if a != "--sequence-parallel"]))}
        for name, block in BLOCKS.items():
            config = write_block(os.path.join(tmp, f"{name}{rank}.json"), block)
            out[name] = ex.train(ex.parse_args(ARGV + ["--xirang-config", config]), _inspect)
        for name, block in REFUSED.items():
            out[f"refused_{name}"] = config_error(ex, block, tmp, ARGV)
        return out
    finally:
        ex.teardown(created)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(sp, 2, str(tmp_path_factory.mktemp("sp")), threads=1)


def _activations(run: dict) -> int:
    return run["memory"]["category_peaks"]["activations"]


@pytest.mark.distributed
def test_plain_sequence_parallel_trains_like_without_it_with_fewer_activation_bytes(runs):
    for r in runs:
        plain, without = r["plain"]["losses"], r["without_sp"]["losses"]
        # dropout outside the TP regions draws its mask per sequence shard, so the runs are close, not equal
        assert plain != without and max(abs(a - b) / b for a, b in zip(plain, without)) < 1e-2
        assert _activations(r["plain"]) < 0.9 * _activations(r["without_sp"])
    assert runs[0]["plain"]["norms"] and runs[0]["plain"]["norms"] == runs[1]["plain"]["norms"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LOSSLESS))
def test_lossless_activation_plans_are_bit_identical_with_sequence_parallelism(runs, name):
    for r in runs:
        assert r[name]["losses"] == r["plain"]["losses"], (name, r["plain"]["tp_rank"])
        assert r[name]["plugins"] == ["activations"]
        assert "output_layer" not in r[name]["plan"] or r[name]["plan"]["output_layer"] != "chunk"
    if name not in ("keep", "planner"):
        for r in runs:
            assert _activations(r[name]) < _activations(r["plain"]), name


@pytest.mark.distributed
def test_optimizer_states_with_sequence_parallelism(runs):
    for r in runs:
        assert r["fp32_states"]["losses"] == r["plain"]["losses"]
        int8, plain = r["int8_states"]["losses"], r["plain"]["losses"]
        assert abs(int8[-1] / plain[-1] - 1) < 0.02
        assert set(r["int8_states"]["formats"]) == {"fp32", "int8"}
        assert set(r["plain"]["norms"]) <= set(r["int8_states"]["kept"])  # fp32 states, whatever the first reason
    assert runs[0]["int8_states"]["norms"] == runs[1]["int8_states"]["norms"]


@pytest.mark.distributed
def test_precision_bf16_trains_like_fp32_with_sequence_parallelism(runs):
    for r in runs:
        ours, plain = r["precision"]["losses"], r["plain"]["losses"]
        assert ours != plain and max(abs(a - b) / b for a, b in zip(ours, plain)) < 1e-4  # the TP=2 bound
        assert _activations(r["precision"]) < _activations(r["plain"])


@pytest.mark.distributed
def test_what_sequence_parallelism_rules_out_is_refused_with_the_reason(runs):
    for r in runs:
        assert "--sequence-parallel" in r["refused_grad_release"]
        assert "distribute_saved_inputs" in r["refused_distribute"] and "sequence" in r["refused_distribute"]
        assert "sequence parallelism" in r["refused_chunk"]
