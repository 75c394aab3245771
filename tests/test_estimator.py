"""The estimator against measured peaks of real DeepSpeed runs (a subset of the matrix; the bench
covers the rest: docs/observability.md)."""
import re

import pytest

from tests.engine_runs import ds_config
from xirang_ds.bench import bench_rank
from xirang_ds.launch import run_ranks
from xirang_ds.memory.estimator import EstimateError, RunShape, estimate_spec, korthikanti_activations
from xirang_ds.models import ModelSpecError, parse_model_spec

INT8 = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}], "min_numel": 0}}
CASES = [  # model, stage, dtype, micro, world, bucket, xirang block
    ("gpt-tiny", 0, "bf16", 4, 1, 1e6, None),
    ("gpt-tiny", 2, "fp32", 4, 2, 1e6, None),
    ("llama-tiny", 1, "bf16", 8, 2, 1e5, None),
    ("gpt-tiny", 3, "bf16", 4, 2, 1e6, None),
    ("gpt-tiny", 2, "bf16", 4, 2, 1e6, INT8),
]


@pytest.mark.distributed
@pytest.mark.parametrize("model, stage, dtype, micro, world, bucket, xirang", CASES)
def test_estimate_within_ten_percent_of_measured(model, stage, dtype, micro, world, bucket, xirang):
    config = ds_config(stage=stage, dtype=dtype, micro=micro, bucket=bucket, xirang=xirang)
    measured = max(r["peak_bytes"] for r in run_ranks(bench_rank, world, model, config, 3, None, 0,
                                                      xirang is not None))
    predicted = estimate_spec(model, config, world).predicted_peak_bytes
    tolerance = 0.10 if stage == 3 else 0.01  # ZeRO 0-2 are modelled buffer by buffer
    assert abs(predicted - measured) / measured <= tolerance, (predicted, measured)


def test_estimate_breakdown_and_phases():
    est = estimate_spec("gpt-tiny", ds_config(stage=2, dtype="bf16", micro=4, bucket=5e8), 2)
    # the default 5e8-element bucket dominates, in backward, as measured (notes/cpu-runtime.md)
    assert est.peak_phase == "backward"
    assert est.by_category["comm_buffers"] == 2 * int(5e8)
    assert est.as_dict()["predicted_peak_bytes"] == est.predicted_peak_bytes
    assert est.korthikanti_activations == korthikanti_activations(2, 64, 4, 64, 4)


def test_micro_batch_from_train_batch_size_and_errors():
    shape = RunShape.from_ds_config({"train_batch_size": 32, "gradient_accumulation_steps": 2}, world_size=2)
    assert shape.micro_batch == 8
    with pytest.raises(EstimateError, match="neither"):
        RunShape.from_ds_config({})


@pytest.mark.parametrize("text, fragment", [
    ("gpt:layers=2,hidden=65,heads=4,seq=8,vocab=16", "heads (4) must divide hidden (65)"),
    ("gpt:layers=2,hidden=64", "missing heads, seq, vocab"),
    ("gpt:layers=2,hidden=64,heads=4,seq=8,vocab=16,depth=3", "'depth' is unknown"),
    ("resnet", "unknown model"),
    ("nosuch.module:factory", "cannot load model factory"),
])
def test_bad_model_specs(text, fragment):
    with pytest.raises(ModelSpecError, match=re.escape(fragment)):
        parse_model_spec(text)


def test_cli_estimate_json(tmp_path, capsys):
    import json

    from xirang_ds.cli import main

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(ds_config(stage=1, micro=2)))
    out = tmp_path / "e.json"
    assert main(["estimate", "--model", "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256",
                 "--ds-config", str(cfg), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["predicted_peak_bytes"] > 0 and set(data["by_category"]) >= {"parameters", "activations"}
    assert main(["estimate", "--model", "gpt:layers=2,hidden=65,heads=4,seq=8,vocab=16",
                 "--ds-config", str(cfg)]) == 2
    assert "must divide hidden" in capsys.readouterr().err
