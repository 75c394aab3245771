"""Resuming across the block's life (docs/checkpoints.md): a checkpoint whose optimizer state another
owner wrote (plain DeepSpeed's ZeRO files under grad_release or optimizer_states, grad_release's
shards in a run without it, another layout) is taken over through whole per-parameter states, with
the LR schedule and counters; lossless sections continue bit for bit where the run they replace
would have gone. What cannot be taken over is refused before anything is modified, with the fix."""
import copy
import os
import shutil

import pytest

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.launch import run_ranks

GRAD_RELEASE = {"grad_release": {"enabled": True}}
OPTIMIZER_STATES = {"optimizer_states": {"enabled": True}}
INT8 = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]}}
STAGE0 = [("fp32", False), ("bf16", False), ("fp16", True)]
"""Plain DeepSpeed's stage-0 layouts: torch's optimizer, FP16_UnfusedOptimizer, FP16_Optimizer over FusedAdam."""
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}}


def _engine(block, stage=2, dtype="bf16", fused=False):
    """``fused``: the model's optimizer is DeepSpeed's FusedAdam (a stand-in on CPU, tests/harness/engine_runs.py)."""
    import deepspeed

    import xirang_ds
    from tests.harness.engine_runs import fused_adam_stand_in
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    init = xirang_ds.initialize if block is not None else deepspeed.initialize
    config = ds_config(stage=stage, dtype=dtype, micro=2, xirang=block, gradient_clipping=0.0,
                       scheduler=copy.deepcopy(SCHEDULER))
    optimizer = None
    if fused:
        del config["optimizer"]
        optimizer = fused_adam_stand_in()(model.parameters(), lr=1e-3, weight_decay=0.01)
    engine, *_ = init(model=model, model_parameters=model.parameters(), optimizer=optimizer, config=config)
    return engine


def _steps(engine, rank, world, skip, count):
    from xirang_ds.bench import optimizer_step

    data = data_iter(2, 64, rank, world)
    for _ in range(skip):
        next(data)
    return [optimizer_step(engine, data) for _ in range(count)]


BALANCED = {"preset": "balanced", "grad_release": {"masters": "auto"}}
"""balanced with exact masters (remainders): the preset keeps them to 16 significant bits, which no
other run's arithmetic follows, and the checks here compare trajectories bit for bit across runs."""
BALANCED3 = {"preset": "balanced", "optimizer_states": {"masters": "auto"}}
"""The same at ZeRO-3, where the preset hands its masters to optimizer_states."""


def _run(block, rank, world, save_dir, count, stage=2, **kind):
    """``count`` steps from scratch, saved after the second."""
    engine = _engine(block, stage, **kind)
    losses = _steps(engine, rank, world, 0, 2)
    engine.save_checkpoint(save_dir)
    return losses + _steps(engine, rank, world, 2, count - 2)


def _resume(block, rank, world, load_dir, count, stage=2, save_to=None, **kind):
    engine = _engine(block, stage, **kind)
    engine.load_checkpoint(load_dir)
    session = getattr(engine, "xirang", None)
    out = {"masters": _plain_stage0_masters(engine) if stage == 0 and block is None else None,
           "formats": _state_formats(session)}
    out.update(losses=_steps(engine, rank, world, 2, count), steps=engine.global_steps, lr=engine.get_lr()[0],
               events=[e["kind"] for e in session.events] if session else [])
    if save_to is not None:
        engine.save_checkpoint(save_to)
    return out


def _state_formats(session):
    """The formats of optimizer_states' states as loaded (``None`` without the section)."""
    from xirang_ds.plugins.optimizer_states.formats import format_of

    plugin = session.plugin("optimizer_states") if session is not None else None
    if plugin is None or plugin.optimizer is None:
        return None
    return sorted({format_of(s) for s in plugin.optimizer.state.values() if s})


def _plain_stage0_masters(engine):
    """The fp32 masters plain DeepSpeed steps at stage 0, flat (its fp16 wrappers' copies, else the
    parameters)."""
    import torch

    optimizer = engine.optimizer
    if hasattr(optimizer, "fp32_groups_flat"):  # FP16_Optimizer over FusedAdam
        return torch.cat([f.detach().reshape(-1) for f in optimizer.fp32_groups_flat])
    groups = getattr(optimizer, "fp32_groups", None) or [g["params"] for g in optimizer.param_groups]
    return torch.cat([p.detach().float().reshape(-1) for group in groups for p in group])


def _zero_to_fp32_matches(folder):
    """DeepSpeed's zero_to_fp32 on a checkpoint whose DeepSpeed files optimizer_states wrote (int8 codes
    over its split groups, fp32 masters): its weights against the masters xirang reads, and whether
    the decoded second moments are all >= 0."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from xirang_ds.checkpoints.tags import read_marker, read_states, resolve_tag

    weights = get_fp32_state_dict_from_zero_checkpoint(folder)
    tag_dir = resolve_tag(folder, None)
    states = read_states(tag_dir, read_marker(tag_dir), list(weights), {n: w.shape for n, w in weights.items()})
    return {"count": len(weights),
            "equal": all(torch.equal(w.float(), states.params[n].master.view_as(w)) for n, w in weights.items()),
            "moments": all(bool(states.params[n].moments["exp_avg_sq"].min() >= 0) for n in weights)}


def scenarios(rank, world, tmp):
    import torch

    from xirang_ds.config.validate import XirangConfigError

    plain, ours, broken, fp16 = (os.path.join(tmp, n) for n in ("plain", "grad_release", "broken", "fp16"))
    out = {"plain": _run(None, rank, world, plain, 5), "ours": _run(GRAD_RELEASE, rank, world, ours, 4)}
    with open(os.path.join(tmp, "crash", "latest")) as f:  # `crash_mid_save` ran first
        out["after_the_crash"] = {"latest": f.read().strip(), **_resume(GRAD_RELEASE, rank, world,
                                                                       os.path.join(tmp, "crash"), 2)}
    out["after_the_crash"]["plain"] = _resume(None, rank, world, os.path.join(tmp, "crash"), 2)["losses"]
    out["plain_into_grad_release"] = _resume(GRAD_RELEASE, rank, world, plain, 2)
    out["plain_into_optimizer_states"] = _resume(OPTIMIZER_STATES, rank, world, plain, 2)
    out["plain_into_balanced"] = _resume(BALANCED, rank, world, plain, 3)
    out["ours_into_optimizer_states"] = _resume(OPTIMIZER_STATES, rank, world, ours, 2)
    out["int8"] = _run(INT8, rank, world, os.path.join(tmp, "int8"), 4)
    if rank == 0:
        out["zero_to_fp32_int8"] = _zero_to_fp32_matches(os.path.join(tmp, "int8"))
    out["int8_into_a_block_without_owners"] = _resume({"monitor": {"enabled": True}}, rank, world,
                                                      os.path.join(tmp, "int8"), 2)
    # the codes beside plain ZeRO files (deepspeed_files): plain DeepSpeed reads the plain ones as they are, and
    # optimizer_states its own codes (no take-over, no decoding)
    out["int8_files"] = sorted(os.listdir(os.path.join(tmp, "int8", "global_step2", "xirang_optimizer_states")))
    out["int8_into_plain_deepspeed"] = _resume(None, rank, world, os.path.join(tmp, "int8"), 2)
    out["int8_into_int8"] = _resume(INT8, rank, world, os.path.join(tmp, "int8"), 2)
    out["balanced"] = _run(BALANCED, rank, world, os.path.join(tmp, "balanced"), 4)
    out["balanced_into_grad_release"] = _resume(GRAD_RELEASE, rank, world, os.path.join(tmp, "balanced"), 2)
    out["balanced_into_balanced"] = _resume(BALANCED, rank, world, os.path.join(tmp, "balanced"), 2)
    out["ours_into_plain_deepspeed"] = _resume(None, rank, world, ours, 2)
    out["balanced_into_plain_deepspeed"] = _resume(None, rank, world, os.path.join(tmp, "balanced"), 2)
    # the preset as it is: masters kept to 16 significant bits (8-bit remainders)
    out["balanced8"] = _run({"preset": "balanced"}, rank, world, os.path.join(tmp, "balanced8"), 4)
    out["balanced8_into_balanced8"] = _resume({"preset": "balanced"}, rank, world, os.path.join(tmp, "balanced8"), 2)
    out["balanced8_into_plain_deepspeed"] = _resume(None, rank, world, os.path.join(tmp, "balanced8"), 2)
    engine = _engine(GRAD_RELEASE, stage=1, dtype="fp16")  # fp16 at ZeRO-1, a loss scale that moved
    out["fp16"] = _steps(engine, rank, world, 0, 2)
    engine.xirang.plugin("grad_release").policy.loss_scaler.cur_scale = 1024.0
    engine.save_checkpoint(fp16)
    out["fp16"] += _steps(engine, rank, world, 2, 2)
    engine = _engine(None, stage=1, dtype="fp16")
    engine.load_checkpoint(fp16)
    out["fp16_into_plain_deepspeed"] = {"scale": engine.optimizer.loss_scaler.cur_scale,
                                        "losses": _steps(engine, rank, world, 2, 2)}
    out["files"] = sorted(os.listdir(os.path.join(ours, "global_step2"))) + sorted(os.listdir(ours))
    if rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        from xirang_ds.plugins.grad_release.checkpoint import read_param_states

        weights = get_fp32_state_dict_from_zero_checkpoint(ours)
        masters = read_param_states(os.path.join(ours, "global_step2"))
        out["zero_to_fp32"] = {"count": len(weights), "equal": all(
            torch.equal(weights[n].reshape(-1), masters.params[n].master.reshape(-1)) for n in masters.params)}
    for dtype, fused in STAGE0:  # grad_release at stage 0 (one GPU, no ZeRO), the block removed and kept
        kind = {"dtype": dtype, "fused": fused}
        folder = os.path.join(tmp, f"stage0_{dtype}")
        out[f"stage0_{dtype}"] = {"run": _run(GRAD_RELEASE, rank, world, folder, 4, stage=0, **kind),
                                  "plain": _resume(None, rank, world, folder, 2, stage=0, **kind),
                                  "own": _resume(GRAD_RELEASE, rank, world, folder, 2, stage=0, **kind)}
        if rank == 0:
            from xirang_ds.plugins.grad_release.checkpoint import read_param_states

            saved = read_param_states(os.path.join(folder, "global_step2"))
            from xirang_ds.models import BUILTIN_SPECS, build_model

            names = [n for n, _ in build_model(BUILTIN_SPECS["gpt-tiny"], seed=0).named_parameters()]
            out[f"stage0_{dtype}"]["saved_masters"] = None if dtype == "fp32" else torch.cat(
                [saved.params[n].master.reshape(-1) for n in names])
    unwritten = os.path.join(tmp, "stage0_unwritten")  # saved without plain files, exported for stage 0 later
    _run({**GRAD_RELEASE, "deepspeed_files": False}, rank, world, unwritten, 2, stage=0, dtype="fp32")
    torch.distributed.barrier()
    if rank == 0:
        from xirang_ds.checkpoints.tags import describe, export_deepspeed_files

        out["show_unwritten"] = describe(os.path.join(unwritten, "global_step2"))
        out["exported_unwritten"] = export_deepspeed_files(unwritten, stage=0)
        out["show_stage0_fp16"] = describe(os.path.join(tmp, "stage0_fp16", "global_step2"))
    torch.distributed.barrier()
    out["exported_unwritten_into_plain"] = _resume(None, rank, world, unwritten, 2, stage=0, dtype="fp32")
    stage0 = os.path.join(tmp, "stage0_bf16")  # and exported for ZeRO-2
    out["stage0"] = out["stage0_bf16"]["run"]
    if rank == 0:
        from xirang_ds.checkpoints.tags import export_deepspeed_files

        out["exported0"] = len(export_deepspeed_files(stage0, stage=2))
    torch.distributed.barrier()
    out["exported_stage0_into_plain_zero2"] = _resume(None, rank, world, stage0, 2, stage=2)
    out["plain_zero3"] = _run(None, rank, world, os.path.join(tmp, "plain3"), 4, stage=3)
    # saved without plain files (codes in DeepSpeed's files), exported below
    out["plain_zero3_into_balanced"] = _resume({**BALANCED3, "deepspeed_files": False}, rank, world,
                                               os.path.join(tmp, "plain3"), 2, stage=3,
                                               save_to=os.path.join(tmp, "balanced3"))
    balanced3, beside3 = os.path.join(tmp, "balanced3"), os.path.join(tmp, "balanced3_beside")
    if rank == 0:
        out["zero_to_fp32_balanced3"] = _zero_to_fp32_matches(balanced3)
    out["balanced3_into_balanced3"] = _resume(BALANCED3, rank, world, balanced3, 2, stage=3,
                                              save_to=beside3)
    out["beside3_into_plain_deepspeed"] = _resume(None, rank, world, beside3, 2, stage=3)
    out["beside3_into_balanced3"] = _resume(BALANCED3, rank, world, beside3, 2, stage=3)
    if rank == 0:
        out["zero_to_fp32_beside3"] = _zero_to_fp32_matches(beside3)
    torch.distributed.barrier()
    if rank == 0:  # ZeRO-3: DeepSpeed's files rewritten in plain layout (sub-groups, per-rank param_shapes)
        from xirang_ds.checkpoints.tags import export_deepspeed_files

        out["exported3"] = len(export_deepspeed_files(balanced3))
        out["zero_to_fp32_exported3"] = _zero_to_fp32_matches(balanced3)
    torch.distributed.barrier()
    out["exported_balanced3_into_plain_deepspeed"] = _resume(None, rank, world, balanced3, 2, stage=3)
    if rank == 0:
        shutil.copytree(ours, broken)
        os.remove(os.path.join(broken, "global_step2", "xirang_grad_release", "rank00001.pt"))
    torch.distributed.barrier()
    engine = _engine(OPTIMIZER_STATES)
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        engine.load_checkpoint(broken)
        out["refused"] = None
    except XirangConfigError as e:
        out["refused"] = str(e)
    out["untouched"] = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    out["untouched_steps"] = engine.global_steps
    return out


def other_world(rank, world, tmp):
    """The 2-rank grad_release checkpoint resumed on one rank: every moment element is the saved one."""
    import torch

    from xirang_ds.plugins.grad_release.checkpoint import read_param_states

    engine = _engine(GRAD_RELEASE)
    engine.load_checkpoint(os.path.join(tmp, "grad_release"))
    saved = read_param_states(os.path.join(tmp, "grad_release", "global_step2"))
    plugin = engine.xirang.plugin("grad_release")
    same = []
    for bucket in plugin.buckets:
        with bucket.fp32_masters():  # bf16 remainders: the masters rebuilt
            for piece, view in zip(bucket.pieces, bucket.views):
                name = bucket.names[piece.index]
                state, whole = bucket.optimizer.state[view], saved.params[name]
                same.append(torch.equal(state["exp_avg_sq"].reshape(-1), whole.moments["exp_avg_sq"].reshape(-1))
                            and torch.equal(view.reshape(-1), saved.params[name].master.reshape(-1)))
    out = {"same": all(same), "checked": len(same), "steps": engine.global_steps,
           "losses": _steps(engine, rank, world, 2, 2)}
    # DeepSpeed's own route to another world size: ds_to_universal, then load_universal
    from deepspeed.utils import safe_get_full_fp32_param

    plain = _universal(os.path.join(tmp, "grad_release"), stage=2)
    out["universal_masters"] = all(torch.equal(safe_get_full_fp32_param(p).reshape(-1),
                                               saved.params[n].master.reshape(-1))
                                   for n, p in plain.module.named_parameters())
    out["universal_losses"] = _steps(plain, rank, world, 2, 2)
    # optimizer_states' codes beside plain files at ZeRO-3 (the presets there): taken over at one rank, and
    # ds_to_universal converts the plain files
    beside3 = os.path.join(tmp, "balanced3_beside")
    taken = _resume(INT8, rank, world, beside3, 2, stage=3)
    out["beside3_one_rank"] = {"events": taken["events"], "losses": taken["losses"],
                               "universal_losses": _steps(_universal(beside3, stage=3),
                                                          rank, world, 2, 2)}
    return out


def _universal(folder, stage):
    """Plain DeepSpeed at one rank, loaded from ``ds_to_universal``'s conversion of ``folder``'s latest tag."""
    import subprocess
    import sys

    import deepspeed

    from xirang_ds.checkpoints.tags import resolve_tag
    from xirang_ds.models import BUILTIN_SPECS, build_model

    tag = os.path.basename(resolve_tag(folder, None))

    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(folder, tag), "--output_folder", os.path.join(folder, "universal"),
                    "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"],
                   check=True, capture_output=True)
    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    plain, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(
        stage=stage, dtype="bf16", micro=2, gradient_clipping=0.0, scheduler=copy.deepcopy(SCHEDULER),
        checkpoint={"load_universal": True}))
    plain.load_checkpoint(folder, tag="universal")
    return plain


def crash_mid_save(rank, world, tmp):
    """Two steps saved; then every rank dies while writing a second checkpoint's ZeRO files."""
    import xirang_ds.checkpoints.deepspeed_writer as writer

    engine = _engine(GRAD_RELEASE)
    _steps(engine, rank, world, 0, 2)
    engine.save_checkpoint(os.path.join(tmp, "crash"))

    def die(obj, path):
        with open(f"{path}.xirang-tmp", "wb") as f:
            f.write(b"partial")
        os._exit(17)

    writer.save_atomically = die
    engine.save_checkpoint(os.path.join(tmp, "crash"), tag="second")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("resume"))
    with pytest.raises(RuntimeError, match="exited with code 17"):
        run_ranks(crash_mid_save, 2, tmp)
    results = run_ranks(scenarios, 2, tmp)
    results[0]["other_world"] = run_ranks(other_world, 1, tmp)[0]
    return results


@pytest.mark.distributed
def test_a_plain_checkpoint_is_taken_over_by_grad_release_and_optimizer_states_bit_for_bit(runs):
    for r in runs:
        for name in ("plain_into_grad_release", "plain_into_optimizer_states"):
            assert r[name]["losses"] == r["plain"][2:4], name
            assert r[name]["steps"] == 4
            assert r[name]["events"] == ["optimizer_state_taken_over"]
        # mid-warmup: a schedule restarted at step 0, or a learning rate not taken over, would change step 4's loss
        assert 0 < r["plain_into_grad_release"]["lr"] == r["plain_into_optimizer_states"]["lr"] < 1e-3


@pytest.mark.distributed
def test_a_plain_checkpoint_into_a_preset_continues_on_the_plain_trajectory(runs):
    for r in runs:
        got = r["plain_into_balanced"]["losses"]
        assert got[:2] == r["plain"][2:4]  # the update at step 3 used the taken-over fp32 moments
        assert got[2] == pytest.approx(r["plain"][4], rel=2e-3) and got[2] != r["plain"][4]  # int8 from then on
        zero3 = r["plain_zero3_into_balanced"]
        assert zero3["losses"] == r["plain_zero3"][2:4] and zero3["steps"] == 4


@pytest.mark.distributed
def test_grad_release_shards_are_taken_over_by_a_run_without_grad_release(runs):
    for r in runs:
        assert r["ours_into_optimizer_states"]["losses"] == r["ours"][2:]
        # grad_release resuming its own shards (no take-over): the crash test's first resume below


@pytest.mark.distributed
def test_int8_states_are_decoded_for_an_owner_that_keeps_fp32(runs):
    for r in runs:
        # the next update decodes the same codes into the same fp32 moments: step 4's loss agrees
        assert r["int8_into_a_block_without_owners"]["losses"] == r["int8"][2:]
        assert r["balanced_into_grad_release"]["losses"] == r["balanced"][2:]
        # its own int8 codes into grad_release's buckets, whose masters are remainders between steps
        assert r["balanced_into_balanced"]["losses"] == r["balanced"][2:]
        assert r["balanced_into_balanced"]["events"] == []  # its own files, no take-over


@pytest.mark.distributed
def test_plain_deepspeed_and_zero_to_fp32_read_a_grad_release_checkpoint(runs):
    for r in runs:
        assert {"bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                "xirang_grad_release", "zero_to_fp32.py", "latest"} <= set(r["files"])
        assert r["ours_into_plain_deepspeed"]["losses"] == r["ours"][2:]  # grad_release is ZeRO-2's arithmetic
        assert r["ours_into_plain_deepspeed"]["steps"] == 4
        assert r["balanced_into_plain_deepspeed"]["losses"] == r["balanced"][2:]  # int8 decoded, as its next step did
        # 8-bit remainders: the checkpoint's masters are the rebuilt ones, so the preset resumes bit for bit, and
        # plain DeepSpeed goes on from the same masters and moments with its own rounding (to nearest even)
        assert r["balanced8_into_balanced8"]["losses"] == r["balanced8"][2:]
        plain8 = r["balanced8_into_plain_deepspeed"]["losses"]
        assert plain8 != r["balanced8"][2:] and plain8 == pytest.approx(r["balanced8"][2:], rel=1e-3)
    assert runs[0]["zero_to_fp32"] == {"count": 29, "equal": True}
    # optimizer_states alone keeps DeepSpeed's own files (its codes inside): zero_to_fp32 reads them at ZeRO 2 and 3
    assert runs[0]["zero_to_fp32_int8"] == runs[0]["zero_to_fp32_balanced3"] == {"count": 29, "equal": True,
                                                                                 "moments": True}
    for r in runs:  # fp16 at ZeRO-1: DeepSpeed's fp16 arithmetic from there on, with grad_release's loss scale
        fp16 = r["fp16_into_plain_deepspeed"]
        assert fp16["scale"] == 1024.0
        assert fp16["losses"] == pytest.approx(r["fp16"][2:], rel=1e-5)


@pytest.mark.distributed
def test_an_optimizer_states_checkpoint_loads_into_plain_deepspeed_and_resumes_its_own_codes(runs):
    assert runs[0]["int8_files"] == ["rank00000.pt", "rank00001.pt"]  # not named like ZeRO files: tools walk the tag
    for r in runs:
        assert r["int8_into_plain_deepspeed"]["losses"] == r["int8"][2:]  # the codes decoded, as its next step did
        assert r["int8_into_plain_deepspeed"]["steps"] == 4 and 0 < r["int8_into_plain_deepspeed"]["lr"] < 1e-3
        own = r["int8_into_int8"]
        assert own["losses"] == r["int8"][2:] and own["events"] == [] and "int8" in own["formats"]
        # ZeRO-3 (presets there hold no grad_release): the same, with DeepSpeed's sub-groups
        assert r["beside3_into_plain_deepspeed"]["losses"] == r["beside3_into_balanced3"]["losses"]
        assert r["beside3_into_balanced3"]["events"] == [] and "int8" in r["beside3_into_balanced3"]["formats"]
    assert runs[0]["zero_to_fp32_beside3"] == {"count": 29, "equal": True, "moments": True}


def test_deepspeed_writes_zero_files_before_latest():
    """The codes' save (`xirang_ds.checkpoints.codes`) runs inside ``_save_zero_checkpoint``: a crash there
    must leave ``latest`` on the previous checkpoint, which holds while DeepSpeed keeps this order."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine

    source = inspect.getsource(DeepSpeedEngine.save_checkpoint)
    assert 0 < source.index("self._save_zero_checkpoint(") < source.index("os.path.join(save_dir, 'latest')")
    assert "self._get_zero_ckpt_name(" in inspect.getsource(DeepSpeedEngine._save_zero_checkpoint)
    assert "_get_all_zero_checkpoint_names(" in inspect.getsource(DeepSpeedEngine._get_all_zero_checkpoints)


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [d for d, _ in STAGE0])
def test_a_stage0_grad_release_checkpoint_loads_into_plain_deepspeed_at_stage0_and_back(runs, dtype):
    import torch

    saved = runs[0][f"stage0_{dtype}"]["saved_masters"]
    for r in runs:
        got = r[f"stage0_{dtype}"]
        assert got["own"]["losses"] == got["run"][2:] and got["own"]["steps"] == 4
        assert got["plain"]["steps"] == 4 and 0 < got["plain"]["lr"] == got["own"]["lr"] < 1e-3
        if dtype == "fp16":  # plain fp16 rounds its updates differently (its own run differs too): the state is exact
            assert torch.equal(got["plain"]["masters"], saved)
        else:  # the moments, the masters and the step the plain wrapper continues from are grad_release's
            assert got["plain"]["losses"] == got["run"][2:]
            assert saved is None or torch.equal(got["plain"]["masters"], saved)


@pytest.mark.distributed
def test_a_stage0_checkpoint_saved_without_plain_files_says_so_and_exports_for_stage0(runs):
    show = "\n".join(runs[0]["show_unwritten"])
    assert "cannot read it (grad_release at stage 0, saved without plain files)" in show and "--stage 0" in show
    assert runs[0]["exported_unwritten"][0].endswith("mp_rank_00_model_states.pt")
    assert "written for FP16_Optimizer over FusedAdam" in "\n".join(runs[0]["show_stage0_fp16"])
    for r in runs:  # without the export plain DeepSpeed would restart the moments and lose this trajectory
        assert r["exported_unwritten_into_plain"]["losses"] == r["stage0_fp32"]["run"][2:]


@pytest.mark.distributed
def test_a_stage0_grad_release_checkpoint_exported_for_zero2_loads_into_plain_deepspeed(runs):
    assert runs[0]["exported0"] == 2
    for r in runs:  # grad_release at stage 0 lands where DeepSpeed's ZeRO-1/2 land (docs/grad_release.md)
        assert r["exported_stage0_into_plain_zero2"]["losses"] == r["stage0"][2:]


@pytest.mark.distributed
def test_a_zero3_preset_checkpoint_saved_without_plain_files_is_exported_for_plain_deepspeed(runs):
    assert runs[0]["exported3"] == 2
    assert runs[0]["zero_to_fp32_exported3"] == {"count": 29, "equal": True, "moments": True}
    for r in runs:  # the moments decoded from int8 are what the preset's own next step decodes
        assert r["exported_balanced3_into_plain_deepspeed"]["losses"] == r["balanced3_into_balanced3"]["losses"]


@pytest.mark.distributed
def test_grad_release_and_zero3_preset_checkpoints_resume_at_another_world_size(runs):
    other = runs[0]["other_world"]
    assert other["same"] and other["checked"] >= 29 and other["steps"] == 2
    assert other["universal_masters"]
    # one rank sees the same batches either way: the take-over and DeepSpeed's universal route agree
    assert other["universal_losses"] == other["losses"]
    beside3 = other["beside3_one_rank"]  # the same for a ZeRO-3 preset's codes beside plain files
    assert beside3["events"] == ["optimizer_state_taken_over"]
    assert beside3["universal_losses"] == beside3["losses"]


@pytest.mark.distributed
def test_a_save_that_dies_midway_leaves_latest_on_the_previous_checkpoint(runs):
    for r in runs:
        after = r["after_the_crash"]
        assert after["latest"] == "global_step2" and after["steps"] == 4 and after["events"] == []
        assert after["losses"] == r["ours"][2:] and after["plain"] == r["ours"][2:]


@pytest.mark.distributed
def test_what_cannot_be_taken_over_is_refused_before_anything_changes(runs):
    for r in runs:
        text = r["refused"]
        assert text.startswith("cannot resume from this checkpoint")
        assert "written by xirang sections grad_release" in text and "this run's sections (optimizer_states)" in text
        assert "rank00001.pt" in text and "Fix: engine.load_checkpoint(..., load_optimizer_states=False)" in text
        assert r["untouched"] and r["untouched_steps"] == 0
