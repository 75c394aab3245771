"""The monitor: one rank over the threshold makes every rank act, the actions work (a loadable
checkpoint, a halved micro-batch that keeps the gradient), and events reach DeepSpeed's monitor."""
import os

import pytest

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.launch import run_ranks


def _run(rank, world, tmp, actions, stage, steps, hog_rank, dtype="bf16", split_from_start=False, activations=False,
         hog_steps=None, restore_after=0, auto_budget=False):
    import torch

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-tiny"]
    model = build_model(spec)
    now = {"step": 0}
    if rank == hog_rank:  # this rank alone needs 400 MB more in every forward (of the steps in hog_steps)
        def hog(module, args, output):
            if hog_steps is None or now["step"] in hog_steps:
                torch.empty(100_000_000).fill_(0)

        model.blocks[0].register_forward_hook(hog)
    block = {"memory_budget": "300MB", "monitor": {"enabled": True, "warn_at": 0.5, "act_at": 0.9,
                                                   "actions": actions, "checkpoint_dir": os.path.join(tmp, "ckpt"),
                                                   "restore_after_steps": restore_after}}
    if activations:
        # the hog is not an activation; with auto_budget the plan is made before the run under memory_budget
        block["activations"] = {"enabled": True} if auto_budget else {"enabled": True, "budget": "200MB"}
    config = ds_config(stage=stage, dtype=dtype, micro=4, xirang=block,
                       csv_monitor={"enabled": True, "output_path": os.path.join(tmp, "csv"), "job_name": "j"})
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    monitor = engine.xirang.plugin("monitor")
    if split_from_start:
        monitor.splitter.pieces = 2
    data = data_iter(4, spec.seq, rank, world)
    losses = []
    for i in range(steps):
        now["step"] = i + 1
        x, y = next(data)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    planner = engine.xirang.plugin("activations") if activations else None
    plan = dict(planner.plan) if activations else {}
    out = {"planned_step_peak": getattr(planner, "planned_step_peak", None), "history": list(monitor.history),
           "actions": list(monitor.actions_taken), "pieces": monitor.splitter.pieces if monitor.splitter else 1,
           "losses": losses, "plan": plan, "episodes": monitor.episode}
    engine.xirang.remove()  # nothing of this run's monitor reaches the next run in the process
    return out


def _two_rank_scenarios(rank, world, tmp):
    """The 2-rank runs of the tests below, in one process pair (a process start costs more than a run)."""
    return {"over_threshold": _run(rank, world, tmp, ["empty_cache", "checkpoint"], 2, 4, 1, "bf16", False, False,
                                   (1, 2, 4)),
            "split": _run(rank, world, "/tmp", ["halve_micro_batch"], 1, 3, -1, "fp32", True),
            "unsplit": _run(rank, world, "/tmp", ["halve_micro_batch"], 1, 3, -1, "fp32", False),
            "halve_and_restore": _run(rank, world, "/tmp", ["halve_micro_batch"], 2, 6, 0, "bf16", False, False,
                                      (1, 2), 2),
            "raise_recompute": _run(rank, world, "/tmp", ["raise_recompute"], 2, 4, 0, "bf16", False, True),
            "above_the_plan": _run(rank, world, "/tmp", ["empty_cache"], 2, 4, 1, "bf16", False, True, (2, 3), 0,
                                   True)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitor")
    return {"ranks": run_ranks(_two_rank_scenarios, 2, str(tmp)), "tmp": tmp}


@pytest.mark.distributed
def test_one_rank_over_threshold_both_act_once_per_episode(two_ranks):
    """Rank 1 is over act_at in steps 1, 2 and 4: every rank acts; the checkpoint is written when the
    threshold is first crossed (step 1), not again while memory stays high (step 2), and again when a
    new episode starts after a check below warn_at (step 3)."""
    results = [r["over_threshold"] for r in two_ranks["ranks"]]
    tmp_path = two_ranks["tmp"]
    r0, r1 = results
    assert r1["history"][0]["fraction"] > 0.9 > r0["history"][0]["fraction"]  # only rank 1 is over
    for r in results:
        assert [h["level"] for h in r["history"]] == ["act", "act", "ok", "act"]
        assert [(a["step"], a["action"], a["episode"]) for a in r["actions"]] == [
            (1, "empty_cache", 1), (1, "checkpoint", 1), (4, "empty_cache", 2), (4, "checkpoint", 2)]
        assert r["episodes"] == 2
    saved = set(os.listdir(tmp_path / "ckpt"))
    assert {"latest", "xirang-step1", "xirang-step4"} <= saved and "xirang-step2" not in saved
    # the events reached DeepSpeed's csv monitor (rank 0 writes)
    csv_files = [f for _, _, fs in os.walk(tmp_path / "csv") for f in fs]
    assert any("budget_fraction" in f for f in csv_files) and any("checkpoint" in f for f in csv_files)


def _load(rank, world, tmp):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=1)
    config = ds_config(stage=2, xirang={"monitor": {"enabled": True}})
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    path, _ = engine.load_checkpoint(os.path.join(tmp, "ckpt"), tag="xirang-step1")  # the episode's one
    return path is not None and engine.global_steps == 1


@pytest.mark.distributed
def test_emergency_checkpoint_loads(tmp_path):
    run_ranks(_run, 2, str(tmp_path), ["checkpoint"], 2, 2, 0)
    assert all(run_ranks(_load, 2, str(tmp_path)))


@pytest.mark.distributed
def test_halve_micro_batch_keeps_the_gradient(two_ranks):
    """fp32 so the comparison is tight: the split run follows the unsplit run's losses."""
    for s, p in ((r["split"], r["unsplit"]) for r in two_ranks["ranks"]):
        assert s["pieces"] == 2 and p["pieces"] == 1
        assert s["losses"] == pytest.approx(p["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.distributed
def test_halve_micro_batch_action_fires_on_all_ranks_and_restores_after_quiet_steps(two_ranks):
    """Over act_at in steps 1 and 2: halved at each (4 pieces); quiet in steps 3-6 with
    restore_after_steps 2: back one level after step 4 and whole again after step 6."""
    for r in (ranks["halve_and_restore"] for ranks in two_ranks["ranks"]):
        assert [(a["step"], a["action"]) for a in r["actions"]] == [
            (1, "halve_micro_batch"), (2, "halve_micro_batch"), (4, "restore_micro_batch"),
            (6, "restore_micro_batch")]
        assert r["pieces"] == 1 and all(a["done"] for a in r["actions"])


@pytest.mark.distributed
def test_raise_recompute_changes_the_activation_plan_on_all_ranks(two_ranks):
    results = [r["raise_recompute"] for r in two_ranks["ranks"]]
    plans = [r["plan"] for r in results]
    assert plans[0] == plans[1] and any("recompute" in o for o in plans[0].values())
    for r in results:
        assert any(a["action"] == "raise_recompute" and a["done"] for a in r["actions"])


def test_raise_actions_need_the_activations_plugin():
    with pytest.raises(Exception, match="'raise_compression' acts through the activations plugin"):
        run_ranks(_run, 1, "/tmp", ["raise_compression"], 2, 1, -1)


def test_budget_errors():
    from xirang_ds import XirangConfigError
    from xirang_ds.plugins.monitor import resolve_budget

    assert resolve_budget("auto", 1000, 10) == 1000
    with pytest.raises(XirangConfigError, match="more than the device has"):
        resolve_budget(2000, 1000, 10)
    with pytest.raises(XirangConfigError, match="below what this rank's model states already take"):
        resolve_budget(5, 1000, 10)


@pytest.mark.distributed
def test_a_step_above_the_planned_budget_says_so_and_the_actions_take_over(two_ranks):
    """The activation plan is made before the run at step 1 (budget auto under memory_budget 300MB); rank 1
    needs 400 MB more in steps 2 and 3, which the plan could not know: the monitor says once that the plan
    missed its budget on the fullest rank, the actions run on both ranks, and the miss ends at step 4."""
    for r in (ranks["above_the_plan"] for ranks in two_ranks["ranks"]):
        assert r["planned_step_peak"] is not None and r["planned_step_peak"] < 300e6
        assert [h["plan_missed_budget"] for h in r["history"]] == [False, True, True, False]
        assert [(a["step"], a["action"]) for a in r["actions"]] == [(2, "empty_cache")]
