"""Pipeline parallelism under Megatron-core: ``examples/megatron_gpt.py`` at PP=2 (TP=1) on 2 ranks over gloo,
Megatron's 1F1B schedule (``get_forward_backward_func``) with 4 micro-batches per step, 4 layers (2 per stage).

* activations: lossless plans (keep, recompute, offload, the planner) give losses bit-identical to plain
  Megatron at PP=2 on both stages, and lower the stage's activation bytes;
* optimizer_states: fp32 states bit-identical to Megatron's Adam; int8 states within the TP=2 bound;
* precision: bf16 per op from fp32 weights trains like fp32 (the TP=2 bound), each stage's output sent in
  Megatron's ``pipeline_dtype``;
* grad_release: refused, naming pipeline parallelism and the fix.
"""
from __future__ import annotations

import os

import pytest

from tests.harness.megatron_runs import config_error, example, write_block
from xirang_ds.launch import run_ranks

pytest.importorskip("megatron.core")

STEPS = 3
ARGV = ["--tp", "1", "--pp", "2", "--num-layers", "4", "--num-microbatches", "4", "--steps", str(STEPS)]
BLOCKS = {
    "keep": {"activations": {"enabled": True, "planner": False, "keep": ["decoder.layers.*"]}},
    "recompute": {"activations": {"enabled": True, "planner": False, "recompute": ["decoder.layers.*"]}},
    "offload": {"activations": {"enabled": True, "planner": False, "offload": ["decoder.layers.*"]}},
    "planner": {"activations": {"enabled": True, "budget_fraction": 0.5,
                                "options": ["keep", "recompute", "compress", "offload"]}},
    # the output layer exists on the last stage only; one slice per micro-batch (4 x 64 tokens)
    "chunk": {"activations": {"enabled": True, "planner": False, "chunk": ["output_layer"], "chunk_tokens": 256}},
    "fp32_states": {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "fp32"}]}},
    "int8_states": {"optimizer_states": {"enabled": True, "min_numel": 0,
                                         "schedule": [{"dtype": "fp32", "until_step": 1}, {"dtype": "int8"}]}},
    "precision": {"precision": {"enabled": True}},
}


def pp2(rank: int, world: int, tmp: str) -> dict:
    ex = example()
    created = ex.setup(rank, world, 1, 2)
    try:
        out = {"plain": ex.train(ex.parse_args(ARGV))}
        for name, block in BLOCKS.items():
            config = write_block(os.path.join(tmp, f"{name}{rank}.json"), block)
            out[name] = ex.train(ex.parse_args(ARGV + ["--xirang-config", config]))
        out["typo"] = config_error(ex, {"activations": {"enabled": True, "planner": False, "chunk": ["output_layr"],
                                                        "recompute": ["decoder.layers.*"]}}, tmp, ARGV, tp=1)
        out["grad_release"] = config_error(ex, {"grad_release": {"enabled": True}}, tmp, ARGV, tp=1)
        return out
    finally:
        ex.teardown(created)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(pp2, 2, str(tmp_path_factory.mktemp("pp2")), threads=1)


@pytest.mark.distributed
def test_both_stages_report_the_last_stages_loss(runs):
    assert [r["plain"]["pp_rank"] for r in runs] == [0, 1]
    assert runs[0]["plain"]["losses"] == runs[1]["plain"]["losses"]


@pytest.mark.distributed
def test_a_glob_may_match_on_one_stage_only(runs):
    """``chunk: ["output_layer"]`` holds on the last stage and is nothing to do on the first; a glob that
    matches on no stage is refused on every stage."""
    assert [r["chunk"]["summary"].splitlines()[-1].strip() for r in runs] == ["activations: nothing to do",
                                                                              "activations: 1 chunk"]
    for r in runs:
        assert "xirang.activations.chunk[0]: 'output_layr' matches no module of the model" in r["typo"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["keep", "recompute", "offload", "planner", "chunk"])
def test_lossless_activation_plans_are_bit_identical_at_pp2(runs, name):
    for r in runs:
        assert r[name]["losses"] == r["plain"]["losses"], (name, r["plain"]["pp_rank"])
        assert r[name]["plugins"] == ["activations"]
    if name in ("recompute", "offload"):
        for r in runs:
            assert (r[name]["memory"]["category_peaks"]["activations"]
                    < r["plain"]["memory"]["category_peaks"]["activations"]), (name, r["plain"]["pp_rank"])


@pytest.mark.distributed
def test_optimizer_states_at_pp2(runs):
    for r in runs:
        assert r["fp32_states"]["losses"] == r["plain"]["losses"]
        plain, int8 = r["plain"]["losses"], r["int8_states"]["losses"]
        assert int8[:2] == plain[:2] and int8 != plain  # the first update in fp32, the second in int8
        assert max(abs(a - b) for a, b in zip(int8, plain)) < 1e-3


@pytest.mark.distributed
def test_precision_bf16_trains_like_fp32_at_pp2(runs):
    """The first stage ends in bf16; its output is sent in ``pipeline_dtype`` (a bf16 tensor sent into
    Megatron's fp32 receive buffer read as NaN losses before `precision.megatron.send_as`)."""
    for r in runs:
        ours, plain = r["precision"]["losses"], r["plain"]["losses"]
        assert ours != plain and max(abs(a - b) / b for a, b in zip(ours, plain)) < 1e-4  # the TP=2 bound


@pytest.mark.distributed
def test_grad_release_is_refused_under_pipeline_parallelism(runs):
    for r in runs:
        assert "pipeline parallelism" in r["grad_release"] and "--pipeline-model-parallel-size" in r["grad_release"]
