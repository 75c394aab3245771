"""Plugins together: each pair that shares a seam trains like its parts and can be removed."""
import pytest

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.launch import run_ranks

FP32_STATES = {"enabled": True, "schedule": [{"dtype": "fp32"}]}
INT8_STATES = {"enabled": True, "schedule": [{"dtype": "int8"}]}


def _release_then_remove(rank, world, stage, states):
    """grad_release stepping the basic optimizer (torch AdamW, or DynamicAdamW with ``states``) for
    3 steps of 2 micro-batches, then removal hands the states back and the plain engine continues."""
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-tiny"]
    model = build_model(spec)
    block = {"grad_release": {"enabled": True}}
    if states is not None:
        block["optimizer_states"] = states
    config = ds_config(stage=stage, dtype="fp32", micro=4, gas=2, xirang=block)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = data_iter(4, spec.seq, rank, world)
    losses = []
    for _ in range(3 * 2):
        x, y = next(data)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    plugins = [p.section for p in engine.xirang.plugins]
    engine.xirang.remove()
    for _ in range(2):  # the plain engine continues from the handed-back states
        x, y = next(data)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return plugins, losses


STAGES = [0, 2]


def _stages(rank, world):
    """Every stage's three runs (fp32 states, torch AdamW, int8 states) in one process pair (a process start
    costs more than a run); each run removes its session before the next."""
    return {stage: [_release_then_remove(rank, world, stage, states) for states in (FP32_STATES, None, INT8_STATES)]
            for stage in STAGES}


@pytest.fixture(scope="module")
def stages():
    return run_ranks(_stages, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_grad_release_steps_dynamic_adamw(stage, stages):
    """fp32 states: DynamicAdamW under grad_release equals torch AdamW under grad_release, before and
    after removal; int8 states compose and stay within 2% of them."""
    for (plugins, ours), (_, ref), (_, low) in (r[stage] for r in stages):
        assert plugins == ["optimizer_states", "grad_release"]
        assert ours == pytest.approx(ref, rel=1e-6)
        assert low == pytest.approx(ref, rel=2e-2)
        assert low != ref
