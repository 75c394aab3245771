"""Resuming across the block's life: a checkpoint whose optimizer state another block owns (plain
DeepSpeed's ZeRO files under grad_release or optimizer_states, grad_release's own folder in a run
without it) is refused before DeepSpeed reads anything, naming the section, what the checkpoint
holds and the fix; ``load_optimizer_states=False`` resumes weights, LR schedule and counters."""
import os

import pytest

from tests.engine_runs import data_iter, ds_config
from xirang_ds.launch import run_ranks

GRAD_RELEASE = {"grad_release": {"enabled": True}}


def _engine(block):
    import deepspeed

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    init = xirang_ds.initialize if block is not None else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(),
                      config=ds_config(stage=2, dtype="bf16", micro=2, xirang=block))
    return engine


def _steps(engine, rank, world, skip, count):
    from xirang_ds.bench import optimizer_step

    data = data_iter(2, 64, rank, world)
    for _ in range(skip):
        next(data)
    return [optimizer_step(engine, data) for _ in range(count)]


def _load_error(block, path, **kwargs):
    from xirang_ds.config.validate import XirangConfigError

    engine = _engine(block)
    try:
        engine.load_checkpoint(path, **kwargs)
    except XirangConfigError as e:
        return str(e)
    return None


def scenarios(rank, world, tmp):
    plain_dir, ours_dir = os.path.join(tmp, "plain"), os.path.join(tmp, "grad_release")
    out = {}
    engine = _engine(None)
    out["plain"] = _steps(engine, rank, world, 0, 2)
    engine.save_checkpoint(plain_dir)
    out["plain"] += _steps(engine, rank, world, 2, 2)
    out["plain_into_balanced"] = _load_error({"preset": "balanced"}, plain_dir)
    engine = _engine({"preset": "balanced"})
    engine.load_checkpoint(plain_dir, load_optimizer_states=False)
    out["warm_start"] = {"steps": engine.global_steps, "losses": _steps(engine, rank, world, 2, 2)}
    engine = _engine(GRAD_RELEASE)
    out["ours"] = _steps(engine, rank, world, 0, 2)
    engine.save_checkpoint(ours_dir)
    out["ours"] += _steps(engine, rank, world, 2, 2)
    out["marker"] = sorted(os.listdir(os.path.join(ours_dir, "global_step2")))
    out["ours_into_int8"] = _load_error({"optimizer_states": {"enabled": True}}, ours_dir)
    engine = _engine(GRAD_RELEASE)
    assert _load_error(GRAD_RELEASE, ours_dir) is None
    engine.load_checkpoint(ours_dir)
    out["resumed"] = _steps(engine, rank, world, 2, 2)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(scenarios, 2, str(tmp_path_factory.mktemp("resume")))


@pytest.mark.distributed
def test_a_plain_checkpoint_into_a_preset_is_refused_with_the_fix(runs):
    for r in runs:
        text = r["plain_into_balanced"]
        assert text.startswith("cannot resume from this checkpoint (2 problems):")
        assert "xirang.grad_release: " in text and "xirang.optimizer_states: " in text
        assert "was written without xirang.grad_release (by plain DeepSpeed), and this run has it on" in text
        assert "Fix: engine.load_checkpoint(..., load_optimizer_states=False)" in text


@pytest.mark.distributed
def test_a_warm_start_keeps_the_counters_and_the_weights(runs):
    for r in runs:
        assert r["warm_start"]["steps"] == 2
        assert r["warm_start"]["losses"][0] == pytest.approx(r["plain"][2], rel=1e-6)  # the weights loaded


@pytest.mark.distributed
def test_grad_release_state_is_refused_by_a_run_without_it_and_resumes_identically_with_it(runs):
    for r in runs:
        assert "xirang_block.json" in r["marker"] and "xirang_grad_release" in r["marker"]
        text = r["ours_into_int8"]
        assert "xirang.grad_release: " in text and "was written with xirang.grad_release, and this run has it off" in text
        assert "xirang_grad_release/ folder" in text
        assert r["resumed"] == r["ours"][2:]
