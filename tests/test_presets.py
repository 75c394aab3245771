"""Presets in the configurations large runs use (ZeRO 0-3, optimizer and parameter offload, fp32 /
bf16 / fp16, clipping, accumulation): a plugin that cannot run there is left out of the preset with
one line saying why; a section the user wrote that clashes is an error, every problem at once."""
import math

import pytest

from tests.engine_runs import data_iter, ds_config
from xirang_ds.config.fit import fit_block
from xirang_ds.config.presets import PRESETS
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.launch import run_ranks

CONFIGS = {
    "zero3 bf16, accumulation 4, clipping": dict(stage=3, dtype="bf16", gas=4, clip=1.0),
    "zero2 bf16, offload_optimizer": dict(stage=2, dtype="bf16", zero_extra={"offload_optimizer": {"device": "cpu"}}),
    "zero3 fp16, offload_param": dict(stage=3, dtype="fp16", zero_extra={"offload_param": {"device": "cpu"}}),
    "zero1 fp32, accumulation 4, clipping": dict(stage=1, dtype="fp32", gas=4, clip=1.0),
}
LEFT_OUT = {
    "zero3 bf16, accumulation 4, clipping": {"grad_release"},
    "zero2 bf16, offload_optimizer": {"grad_release", "optimizer_states"},
    "zero3 fp16, offload_param": {"grad_release"},
    "zero1 fp32, accumulation 4, clipping": set(),
}
"""What each preset leaves out there (conservative has no optimizer_states to leave out)."""


def _config(name, xirang=None):
    spec = dict(CONFIGS[name])
    zero_extra = spec.pop("zero_extra", {})
    cfg = ds_config(micro=2, xirang=xirang, **spec)
    cfg["zero_optimization"].update(zero_extra)
    return cfg


def _train(rank, world, cfg, steps):
    import deepspeed

    import xirang_ds
    from xirang_ds.bench import optimizer_step
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    init = xirang_ds.initialize if "xirang" in cfg else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
    data = data_iter(engine.train_micro_batch_size_per_gpu(), 64, rank, world)
    losses = [optimizer_step(engine, data) for _ in range(steps)]
    session = getattr(engine, "xirang", None)
    out = {"losses": losses}
    if session is not None:
        out.update(plugins=[p.section for p in session.plugins], left_out=[i.section for i in session.left_out],
                   summary=session.summary())
        session.remove()
    return out


def matrix(rank, world, steps):
    """Every configuration plain, then with each preset, in one process per rank (engines in turn)."""
    results = {}
    for name in CONFIGS:
        results[name, "plain"] = _train(rank, world, _config(name), steps)
        for preset in PRESETS:
            results[name, preset] = _train(rank, world, _config(name, {"preset": preset}), steps)
    return results


@pytest.fixture(scope="module")
def runs():
    return run_ranks(matrix, 2, 2)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_runs_and_says_what_it_left_out(runs, name, preset):
    rank0 = runs[0][name, preset]
    expected = LEFT_OUT[name] & {k for k, v in PRESETS[preset].items() if v.get("enabled")}
    assert set(rank0["left_out"]) == expected
    assert not expected & set(rank0["plugins"])
    for section in expected:
        assert f"{section}: left out of preset {preset!r}: " in rank0["summary"]
    # conservative is lossless; the others quantize optimizer states, which moves two steps' loss little
    tolerance = 1e-3 if preset == "conservative" else 2e-2
    for rank in runs:  # each rank's own data against the plain run's same rank
        assert all(math.isfinite(x) for x in rank[name, preset]["losses"])
        assert rank[name, preset]["losses"] == pytest.approx(rank[name, "plain"]["losses"], rel=tolerance)


def test_a_section_the_user_wrote_clashes_with_every_problem_at_once():
    cfg = _config("zero2 bf16, offload_optimizer")
    cfg["zero_optimization"]["stage"] = 3
    block = {"preset": "balanced", "grad_release": {"clipping": "exact"}, "optimizer_states": {"enabled": True}}
    with pytest.raises(XirangConfigError) as e:
        fit_block(block, cfg)
    text = str(e.value)
    assert "3 problems" in text
    assert "xirang.optimizer_states.enabled: zero_optimization.offload_optimizer.device is 'cpu'" in text
    assert "xirang.grad_release cannot run with zero_optimization.stage = 3" in text
    assert "xirang.grad_release cannot run with zero_optimization.offload_optimizer.device = 'cpu'" in text


def test_validate_show_resolved_prints_the_left_out_lines(tmp_path, capsys):
    import json

    from xirang_ds.cli import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config("zero3 bf16, accumulation 4, clipping", {"preset": "conservative"})))
    assert main(["validate", str(path), "--show-resolved"]) == 0
    out = capsys.readouterr().out
    assert ("grad_release: left out of preset 'conservative': cannot run with zero_optimization.stage = 3; "
            "ZeRO-3 partitions the parameters themselves") in out
    resolved = json.loads(out[out.index("{"):])
    assert resolved["xirang"]["grad_release"]["enabled"] is False
    assert resolved["xirang"]["activations"]["enabled"] is True
