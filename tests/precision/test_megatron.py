"""The precision plugin under Megatron-core: GPTModel (local spec) at tensor-parallel size 2 over gloo,
fp32 weights and Megatron's FP32Optimizer, bf16 per op with on-demand weight copies, 5 steps.

* Every loss within 1e-4 relative of plain fp32 Megatron (the DeepSpeed tests' on-demand bound is
  1e-3), the same on both TP ranks; the parameters stay fp32 (the masters are the weights).
* Megatron's tensor-parallel linears (and the output layer) run whole in bf16; activation bytes per
  rank drop (the tracker's activations role at the step peak).
* Removal restores every forward; fp16 and ``persistent`` are refused by name under Megatron.
"""
import pytest

from tests.harness import megatron_runs
from xirang_ds.launch import run_ranks

pytest.importorskip("megatron.core")

STEPS = 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(megatron_runs.tp2_precision, 2, str(tmp_path_factory.mktemp("precision")), STEPS)


@pytest.mark.distributed
def test_bf16_trains_like_fp32_megatron(runs):
    for r in runs:
        for ours, plain in zip(r["bf16"]["losses"], r["plain"]["losses"]):
            assert abs(ours - plain) / plain < 1e-4
        assert r["bf16"]["losses"] != r["plain"]["losses"]  # it did compute in bf16
        assert r["bf16"]["dtype"] == "torch.bfloat16" and r["bf16"]["param_dtypes"] == ["torch.float32"]
    assert runs[0]["bf16"]["losses"] == runs[1]["bf16"]["losses"]


@pytest.mark.distributed
def test_parallel_linears_run_in_bf16_and_activation_bytes_drop(runs):
    for r in runs:
        layers = r["bf16"]["megatron_layers"]
        assert "output_layer" in layers and "decoder.layers.1.mlp.linear_fc2" in layers and len(layers) == 9
        ours, plain = r["bf16"]["memory"]["peak_by_category"], r["plain"]["memory"]["peak_by_category"]
        assert ours["activations"] < 0.85 * plain["activations"]
        assert ours["parameters"] == plain["parameters"]  # no persistent 16-bit copy
        assert r["bf16"]["memory"]["peak_bytes"] < r["plain"]["memory"]["peak_bytes"]


@pytest.mark.distributed
def test_remove_restores_forwards_and_refused_settings_name_key_value_and_fix(runs):
    for r in runs:
        assert "module.output_layer" in r["removal"]["before"] and r["removal"]["after"] == []
        assert ("xirang.precision.dtype: 'fp16' is not available under Megatron-core (allowed there: 'bf16', "
                "'auto')") in r["refused"]["dtype"]
        assert "use bf16, or Megatron's own --fp16 with xirang.precision disabled" in r["refused"]["dtype"]
        assert ("xirang.precision.weight_copies: 'persistent' is not available under Megatron-core (allowed there: "
                "'on_demand', 'auto')") in r["refused"]["weight_copies"]
