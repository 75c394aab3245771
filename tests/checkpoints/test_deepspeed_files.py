"""DeepSpeed's checkpoint files as xirang reads and writes them (xirang_ds/checkpoints): every plain
layout (stage 0-3 x bf16/fp16/fp32, and stage 0's FusedAdam wrapper; 2 ranks) is read per parameter
into the masters zero_to_fp32 finds, and the ZeRO-1/2 files and stage-0 optimizer entries written
back from what was read equal DeepSpeed's own tensor for tensor."""
import math
import os

import pytest
import torch

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.launch import run_ranks

LAYOUTS = [(stage, dtype) for stage in (0, 1, 2, 3) for dtype in ("bf16", "fp16", "fp32")]
FUSED = [(0, "bf16_fused"), (0, "fp16_fused")]
"""Stage 0 over FusedAdam (DeepSpeed's default Adam on a GPU): FP16_Optimizer's flat layout."""


TAKEN_OVER = [(0, "fp32"), (0, "bf16"), (1, "fp16"), (2, "fp32")]
"""Layouts also loaded by grad_release (ZeRO-2 bf16 and ZeRO-3 are in tests/checkpoints/test_deepspeed_resume.py)."""


def save_every_layout(rank, world, tmp):
    import deepspeed

    import xirang_ds
    from xirang_ds.bench import optimizer_step
    from xirang_ds.checkpoints.deepspeed_files import read_deepspeed_states
    from tests.harness.engine_runs import fused_adam_stand_in
    from xirang_ds.models import BUILTIN_SPECS, build_model

    fused_adam = fused_adam_stand_in()
    for stage, dtype in LAYOUTS + FUSED:
        model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
        config = ds_config(stage=stage, dtype=dtype.split("_")[0], micro=2)
        optimizer = None
        if dtype.endswith("_fused"):
            del config["optimizer"]
            optimizer = fused_adam(model.parameters(), lr=1e-3, weight_decay=0.01)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                          config=config)
        optimizer_step(engine, data_iter(2, 64, rank, world))
        engine.save_checkpoint(os.path.join(tmp, f"s{stage}_{dtype}"))
    taken = {}
    for stage, dtype in TAKEN_OVER:  # every slice grad_release holds is the checkpoint's, and it steps on
        model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
        engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=ds_config(
            stage=stage, dtype=dtype, micro=2, xirang={"grad_release": {"enabled": True}}))
        folder = os.path.join(tmp, f"s{stage}_{dtype}")
        engine.load_checkpoint(folder)
        names = [n for n, _ in model.named_parameters()]
        saved = read_deepspeed_states(os.path.join(folder, "global_step1"), names,
                                      {n: p.shape for n, p in model.named_parameters()})
        same = []
        for bucket in engine.xirang.plugin("grad_release").buckets:
            with bucket.fp32_masters():  # bf16 remainders: the masters rebuilt
                for piece, view in zip(bucket.pieces, bucket.views):
                    state, whole = bucket.optimizer.state[view], saved.params[bucket.names[piece.index]]
                    span = slice(piece.start, piece.start + piece.numel)
                    saved_moment = whole.moments["exp_avg_sq"].reshape(-1)[span]
                    same.append(torch.equal(state["exp_avg_sq"].reshape(-1), saved_moment))
                    if whole.master is not None:
                        same.append(torch.equal(view.reshape(-1), whole.master.reshape(-1)[span]))
        loss = optimizer_step(engine, data_iter(2, 64, rank, world))
        taken[f"s{stage}_{dtype}"] = {"same": all(same), "checked": len(same), "loss": loss}
    return taken


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("layouts"))
    return tmp, run_ranks(save_every_layout, 2, tmp)


@pytest.fixture(scope="module")
def checkpoints(saved):
    return saved[0]


@pytest.mark.distributed
@pytest.mark.parametrize("stage,dtype", TAKEN_OVER)
def test_grad_release_takes_over_every_plain_layout(saved, stage, dtype):
    for rank in saved[1]:
        taken = rank[f"s{stage}_{dtype}"]
        assert taken["same"] and taken["checked"] >= 29 and math.isfinite(taken["loss"])


def _model():
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    return [n for n, _ in model.named_parameters()], {n: p.shape for n, p in model.named_parameters()}


def _same(a, b, path=""):
    """Differences between two loaded checkpoint objects, as paths."""
    if torch.is_tensor(a):
        return [] if torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b) else [path]
    if isinstance(a, dict):
        out = [f"{path}.{k} (one side)" for k in set(a) ^ set(b)]
        return out + [d for k in a if k in b for d in _same(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{path}[{i}]")]
    if type(a).__module__.startswith("deepspeed.runtime.fp16"):
        return [] if vars(a) == vars(b) else [path]
    return [] if a == b else [path]


@pytest.mark.distributed
@pytest.mark.parametrize("stage,dtype", LAYOUTS + FUSED)
def test_every_plain_layout_reads_into_the_trained_state(checkpoints, stage, dtype):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from xirang_ds.checkpoints.deepspeed_files import read_deepspeed_states

    names, shapes = _model()
    folder = os.path.join(checkpoints, f"s{stage}_{dtype}")
    states = read_deepspeed_states(os.path.join(folder, "global_step1"), names, shapes)
    assert sorted(states.params) == sorted(names)
    assert states.groups[0] == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    assert (states.loss_scale is not None) == dtype.startswith("fp16")
    first = states.params[names[0]]
    assert first.moments["exp_avg"].shape == shapes[names[0]] and first.step >= 1
    second = states.params[names[1]].moments["exp_avg_sq"]
    assert float(first.moments["exp_avg_sq"].abs().sum()) > 0 or float(second.abs().sum()) > 0
    if stage > 0:
        weights = get_fp32_state_dict_from_zero_checkpoint(folder)
        assert all(torch.equal(weights[n].float(), states.params[n].master) for n in names)


@pytest.mark.distributed
@pytest.mark.parametrize("stage,dtype", [(s, d) for s, d in LAYOUTS if s in (1, 2)])
def test_zero_files_written_from_the_states_equal_deepspeeds_own(checkpoints, stage, dtype, tmp_path):
    from xirang_ds.checkpoints.deepspeed_files import load_states_file, read_deepspeed_states
    from xirang_ds.checkpoints.deepspeed_writer import optim_file_name, write_zero_files

    names, shapes = _model()
    tag_dir = os.path.join(checkpoints, f"s{stage}_{dtype}", "global_step1")
    states = read_deepspeed_states(tag_dir, names, shapes)
    theirs = [load_states_file(os.path.join(tag_dir, optim_file_name(r, dtype))) for r in range(2)]
    torch_groups = theirs[0]["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    write_zero_files(str(tmp_path), states, [names], {n: shapes[n].numel() for n in names}, torch_groups, stage, dtype,
                     2, ds_config=theirs[0]["ds_config"])
    for rank in range(2):
        ours = load_states_file(os.path.join(tmp_path, optim_file_name(rank, dtype)))
        # clip_grad is left out (the loading run keeps its own), and so is a bf16/fp32 run's static scaler
        left_out = {".optimizer_state_dict.clip_grad (one side)"} | (
            set() if dtype == "fp16" else {".optimizer_state_dict.loss_scaler (one side)"})
        assert set(_same(theirs[rank], ours)) == left_out


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "bf16_fused", "fp16_fused"])
def test_the_stage0_entry_written_from_the_states_equals_deepspeeds_own(checkpoints, dtype):
    """torch's optimizer (fp32), FP16_UnfusedOptimizer and FP16_Optimizer over FusedAdam (bf16/fp16)."""
    from xirang_ds.checkpoints.deepspeed_files import MODEL_STATES, load_states_file, read_deepspeed_states
    from xirang_ds.checkpoints.deepspeed_writer import stage0_entry

    names, shapes = _model()
    model_states = load_states_file(os.path.join(checkpoints, f"s0_{dtype}", "global_step1", MODEL_STATES))
    theirs = model_states["optimizer"]
    states = read_deepspeed_states(os.path.join(checkpoints, f"s0_{dtype}", "global_step1"), names, shapes)
    torch_groups = theirs.get("optimizer_state_dict", theirs)["param_groups"]
    ours = stage0_entry(states, [names], shapes, torch_groups, dtype.split("_")[0], fused=dtype.endswith("_fused"),
                        ds_config=model_states["ds_config"])
    # bf16's static scale counts its steps in cur_iter, which nothing reads; the states do not carry it
    assert _same(theirs, ours) == ([".cur_iter"] if dtype == "bf16" else [])


@pytest.mark.distributed
def test_checkpoint_command_shows_the_writer_and_refuses_a_missing_folder(checkpoints, capsys, tmp_path):
    from xirang_ds.cli import main

    assert main(["checkpoint", "show", os.path.join(checkpoints, "s2_bf16")]) == 0
    out = capsys.readouterr().out
    assert "global_step1: written by plain DeepSpeed" in out
    assert "plain DeepSpeed, zero_to_fp32.py, ds_to_universal: read it (2 ZeRO file(s))" in out
    assert main(["checkpoint", "export", os.path.join(checkpoints, "s2_bf16")]) == 0
    assert "already in DeepSpeed's own files; nothing to write" in capsys.readouterr().out
    assert main(["checkpoint", "show", str(tmp_path)]) == 2
    assert "no checkpoint (no 'latest' file or no such folder)" in capsys.readouterr().err


def test_a_scheduler_state_saved_with_other_param_groups_is_fitted_before_it_steps():
    from torch.optim.lr_scheduler import LambdaLR, LRScheduler

    from xirang_ds.checkpoints.schedulers import fit_scheduler_groups, install

    one = torch.optim.AdamW([torch.zeros(2, requires_grad=True)], lr=0.1)
    saved = LambdaLR(one, lambda step: 0.5 ** step)
    saved.step()
    two = torch.optim.AdamW([{"params": [torch.zeros(2, requires_grad=True)]},
                             {"params": [torch.zeros(1, requires_grad=True)]}], lr=0.1)  # optimizer_states' halves
    resumed = LambdaLR(two, lambda step: 0.5 ** step)
    before = LRScheduler.step
    undo = install()
    try:
        resumed.load_state_dict(saved.state_dict())
        assert len(resumed.base_lrs) == 1
        resumed.step()  # torch alone: "zip() argument 2 is shorter than argument 1"
        assert resumed.base_lrs == [0.1, 0.1] and [g["lr"] for g in two.param_groups] == [0.025, 0.025]
    finally:
        undo()
    assert LRScheduler.step is before
    resumed.base_lrs = [0.1, 0.2, 0.3]
    with pytest.raises(ValueError, match=r"base_lrs has 3 entries with different values .* 2 param groups"):
        fit_scheduler_groups(resumed, 2)
