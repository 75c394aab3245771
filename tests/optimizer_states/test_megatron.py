"""The optimizer_states plugin under Megatron-core: GPTModel (local spec) at tensor-parallel size 2 over
gloo, Megatron's DDP and its FP32Optimizer around torch.optim.AdamW, through ``examples/megatron_gpt.py``.

* fp32 states: every loss bit-identical to plain Megatron (DynamicAdamW in fp32 is AdamW bit for bit).
* int8 / int4 states on each TP shard: final loss within the DeepSpeed tests' bounds (2% / 3%), the
  tracker's optimizer_states bytes per rank equal the states held, about 2 bytes (int8) or 1 byte (int4)
  per quantized element; parameters replicated on the TP group stay bit-identical on both ranks.
* Megatron's optimizer ``state_dict`` / ``load_state_dict`` round trip resumes bit for bit (int8 codes,
  a format change and stochastic rounding included); removal hands Megatron a torch AdamW that continues
  exactly like plain Megatron; Megatron's distributed checkpoint is refused with the fix; a bad glob
  names key, value and fix.
"""
import pytest

from tests.harness import megatron_runs
from xirang_ds.launch import run_ranks

pytest.importorskip("megatron.core")

STEPS = 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(megatron_runs.tp2_optimizer_states, 2, str(tmp_path_factory.mktemp("states")), STEPS,
                     megatron_runs.STATE_SCHEDULES)


def _states(run):
    return run["memory"]["peak_by_category"]["optimizer_states"]


@pytest.mark.distributed
def test_fp32_states_are_bit_identical_to_megatron_adamw(runs):
    for r in runs:
        assert r["fp32"]["inner"] == ["DynamicAdamW"] and r["plain"]["inner"] == ["AdamW"]
        assert r["fp32"]["losses"] == r["plain"]["losses"]
        assert _states(r["fp32"]) == _states(r["plain"]) == r["fp32"]["held"]
        assert r["fp32"]["replicated"] == r["plain"]["replicated"]


@pytest.mark.distributed
@pytest.mark.parametrize("dtype, bound, bytes_per_element", [("int8", 0.02, 2.1), ("int4", 0.03, 1.1)])
def test_quantized_states_per_tp_shard(runs, dtype, bound, bytes_per_element):
    for r in runs:
        run = r[dtype]
        assert abs(run["losses"][-1] / r["plain"]["losses"][-1] - 1) < bound
        formats = run["formats"][0]
        assert set(formats) == {"fp32", dtype} and formats[dtype] > 2 * formats["fp32"]
        assert _states(run) == run["held"] < 0.6 * _states(r["plain"])  # measured by the tracker
        assert run["quantized_bytes"] / run["quantized_numel"] <= bytes_per_element
    assert runs[0][dtype]["replicated"] == runs[1][dtype]["replicated"]  # norms, row biases: same on both ranks
    assert runs[0][dtype]["losses"] == runs[1][dtype]["losses"]


@pytest.mark.distributed
def test_kept_fp32_parameters_include_the_vocab_parallel_embedding(runs):
    kept = runs[0]["int8"]["kept"]
    assert kept["embedding.word_embeddings.weight"] == "embedding (VocabParallelEmbedding embedding.word_embeddings)"
    assert kept["decoder.layers.0.input_layernorm.weight"].startswith("norm")
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in kept


@pytest.mark.distributed
def test_megatron_state_dict_round_trip_resumes_bit_for_bit(runs):
    for r in runs:
        resume = r["resume"]
        assert resume["resumed"] == resume["continued"]
        assert set(resume["formats"]) == {"fp32", "int8"}
        assert resume["saved_codes"] == ["torch.int8", "torch.uint8"]


@pytest.mark.distributed
def test_remove_hands_back_adamw_and_bad_glob_names_key_value_and_fix(runs):
    for r in runs:
        removal = r["removal"]
        assert removal["during"] == ["DynamicAdamW"] and removal["after"] == ["AdamW"]
        assert removal["losses"] == removal["plain"]
        assert "--ckpt-format torch_dist) needs every optimizer state shaped like its parameter" in removal["sharded"]
        assert "save with --ckpt-format torch" in removal["sharded"] and not removal["sharded_after_removal"]
        assert ("xirang.optimizer_states.keep_fp32[0]: 'decoder.layer.*' matches no parameter name (globs match "
                "whole names, e.g. embedding.word_embeddings.weight") in r["bad_glob"]
        assert "fix the pattern or remove it" in r["bad_glob"]
