"""grad_release's ``two_pass`` beside the activations plugin, on 2 ranks of real DeepSpeed engines: its norm pass
retains the graph and its update pass backs through it again, so offloaded, compressed and recomputed modules
(and the planner's profiling passes, which offload every saved tensor) give each backward its tensors; the run
is the one ``hold`` gives, bit for bit. Selective recompute allows one backward: the planner leaves it out beside
``two_pass``, and a module fixed to it is refused at validation, naming the key and the fix."""
import math

import pytest

from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks

FIXED = {"enabled": True, "planner": False, "min_tensor_bytes": 0, "offload": ["blocks.0"],
         "recompute_offload": ["blocks.1.attn"], "compress": ["blocks.1.mlp"], "chunk": ["lm_head"]}


def _release(method):
    return {"enabled": True, "exact_method": method}


def _run(rank, world, xirang, steps=3):
    import torch

    import xirang_ds
    from tests.harness.engine_runs import data_iter
    from xirang_ds.bench import optimizer_step
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-tiny"]
    model = build_model(spec, seed=0)
    cfg = ds_config(stage=2, dtype="fp32", micro=2, gas=2, clip=0.05, xirang=xirang)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = data_iter(engine.train_micro_batch_size_per_gpu(), spec.seq, rank, world)
    losses = [optimizer_step(engine, data) for _ in range(steps)]
    plugin = engine.xirang.plugin("activations")
    out = {"losses": losses, "plan": dict(plugin.plan), "params": torch.cat([p.detach().flatten()
                                                                              for p in engine.module.parameters()])}
    engine.xirang.remove()
    return out


def _runs(rank, world):
    out = {method: _run(rank, world, {"grad_release": _release(method), "activations": FIXED})
           for method in ("hold", "two_pass")}
    planned = {"preset": "balanced", "grad_release": {"exact_method": "two_pass"},
               "activations": {"budget_fraction": 0.4, "min_tensor_bytes": 0}}
    out["balanced"] = _run(rank, world, planned, steps=4)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_runs, 2)


def test_two_pass_beside_offload_compress_recompute_and_chunk_trains_as_hold_does(runs):
    import torch

    for rank in runs:
        hold, two_pass = rank["hold"], rank["two_pass"]
        assert set(two_pass["plan"].values()) == {"offload", "recompute_offload", "compress", "chunk"}
        assert two_pass["losses"] == hold["losses"]
        assert torch.equal(two_pass["params"], hold["params"])


def test_two_pass_under_a_preset_profiles_plans_without_selective_recompute_and_trains(runs):
    for rank in runs:
        run = rank["balanced"]
        assert all(math.isfinite(x) for x in run["losses"])
        assert "selective_recompute" not in run["plan"].values()
        assert set(run["plan"].values()) - {"keep"}  # the budget made the plan act


def test_two_pass_beside_fixed_selective_recompute_is_refused_at_validation_with_every_other_problem():
    from xirang_ds import XirangConfigError, load_config

    block = {"grad_release": _release("two_pass"), "activations": {"enabled": True, "selective_recompute": ["blocks.0"]},
             "monitor": {"enabled": True, "on_oom": "halve_micro_batch"}}
    with pytest.raises(XirangConfigError) as e:
        load_config({"xirang": block})
    found = dict(e.value.problems)
    assert "xirang.monitor.on_oom" in found  # reported together
    message = found["xirang.grad_release.exact_method"]
    assert '"two_pass"' in message and "activations.selective_recompute" in message
    assert 'set exact_method to "host" or "hold"' in message and "activations.recompute" in message
