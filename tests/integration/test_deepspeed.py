"""xirang_ds.initialize and patch_deepspeed against real DeepSpeed engines on CPU ranks."""
import inspect
import json

import pytest

from tests.harness import engine_runs
from tests.harness.checks import assert_resumed, resume_in_fresh_processes
from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks

MONITOR = {"monitor": {"enabled": True}}


def test_signature_matches_deepspeed():
    import deepspeed

    import xirang_ds

    ours = inspect.signature(xirang_ds.initialize)
    theirs = inspect.signature(deepspeed.initialize)
    assert list(ours.parameters) == list(theirs.parameters)
    for name, p in theirs.parameters.items():
        assert ours.parameters[name].default == p.default, name


def _compare(rank, world, config, steps):
    plain = engine_runs.train(rank, world, {k: v for k, v in config.items() if k != "xirang"}, steps,
                              use_xirang=False)
    ours = engine_runs.train(rank, world, config, steps)
    return plain, ours


STAGES = [0, 1, 2, 3]


def _compare_stages(rank, world):
    """`_compare` at every stage, in one process pair (a process start costs more than a run)."""
    return {stage: _compare(rank, world, ds_config(stage=stage, dtype="bf16", xirang=MONITOR), 3) for stage in STAGES}


@pytest.fixture(scope="module")
def stages():
    return run_ranks(_compare_stages, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_block_trains_like_plain_deepspeed_2_ranks(stage, stages):
    """With the monitor on (it only observes), losses equal plain DeepSpeed's bit for bit."""
    for plain, ours in (r[stage] for r in stages):
        assert ours["plugins"] == ["monitor"]
        assert plain["plugins"] == []
        assert ours["losses"] == plain["losses"]
        assert ours["global_steps"] == 3


def _no_block(rank, world):
    import deepspeed

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    engine, opt, loader, sched = xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                                      config=ds_config(stage=1))
    return type(engine).__name__, hasattr(engine, "xirang"), type(opt).__name__, loader, sched, \
        isinstance(engine, deepspeed.DeepSpeedEngine)


def test_without_block_is_plain_deepspeed():
    name, has_session, opt, loader, sched, is_engine = run_ranks(_no_block, 1)[0]
    assert (name, has_session, loader, sched, is_engine) == ("DeepSpeedEngine", False, None, None, True)
    assert opt == "DeepSpeedZeroOptimizer"


def _patch_and_files(rank, world, tmp):
    import argparse
    import os

    import deepspeed

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    xirang_ds.patch_deepspeed()
    xirang_ds.patch_deepspeed()  # twice is harmless
    out = {"patched_twice_same": deepspeed.initialize is deepspeed.initialize}
    # a JSON path through args.deepspeed_config, as the deepspeed launcher's scripts do
    path = os.path.join(tmp, "c.json")
    with open(path, "w") as f:
        json.dump(ds_config(stage=2, xirang=MONITOR), f)
    args = argparse.Namespace(deepspeed_config=path, local_rank=0)
    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    out["args_path"] = [p.section for p in engine.xirang.plugins]
    out["args_restored"] = args.deepspeed_config == path
    # a YAML path through config=
    import yaml

    ypath = os.path.join(tmp, "c.yaml")
    with open(ypath, "w") as f:
        yaml.safe_dump(ds_config(stage=0, xirang=MONITOR), f)
    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ypath)
    out["yaml"] = [p.section for p in engine.xirang.plugins]
    # removal restores the original engine behaviour
    session = engine.xirang
    session.remove()
    out["removed"] = (not hasattr(engine, "xirang"), "step" not in vars(engine),
                      "save_checkpoint" not in vars(engine))
    xirang_ds.unpatch_deepspeed()
    out["unpatched"] = not getattr(deepspeed.initialize, "__xirang__", False)
    return out


def test_patch_deepspeed_args_path_yaml_and_removal(tmp_path):
    out = run_ranks(_patch_and_files, 1, str(tmp_path))[0]
    assert out["args_path"] == ["monitor"] and out["args_restored"]
    assert out["yaml"] == ["monitor"]
    assert out["removed"] == (True, True, True)
    assert out["unpatched"]


def _bad_block(rank, world):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    try:
        xirang_ds.initialize(model=model, config=ds_config(xirang={"monitor": {"warn_at": 2}}))
    except xirang_ds.XirangConfigError as e:
        import deepspeed.comm as dist

        return str(e), dist.is_initialized()
    return None, None


def test_bad_block_fails_before_deepspeed_runs():
    message, dist_started = run_ranks(_bad_block, 1)[0]
    assert "xirang.monitor.warn_at: must be between 0 and 1; got 2" in message
    assert dist_started is False


@pytest.mark.distributed
def test_checkpoint_round_trip_carries_plugin_state(tmp_path):
    """Save after 2 steps, resume in fresh processes: the resumed losses equal the uninterrupted run."""
    config = ds_config(stage=2, dtype="bf16", xirang=MONITOR)
    for f, r in resume_in_fresh_processes(engine_runs.train, 2, str(tmp_path), config, skip=2):
        assert_resumed(f, r, at=2)
        assert r["global_steps"] == 4
        assert r["session_state"]["monitor"] == f["session_state"]["monitor"]  # episode state resumed too
        assert r["session_state"]["monitor"] == {"pieces": 1, "level": "ok", "episode": 0, "in_episode": False,
                                                 "quiet_checks": 4}
