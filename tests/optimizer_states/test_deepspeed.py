"""optimizer_states inside real DeepSpeed engines on 2 CPU ranks over gloo.

Reference: DeepSpeed with a client ``torch.optim.AdamW`` over the same param groups the plugin
builds (the plugin splits groups so ZeRO keeps the fp32-pinned parameters in their own
partitions; ZeRO's flat layout, and so its bf16 rounding, depends on the grouping).
"""
import pytest
import torch

from tests.harness.checks import assert_resumed
from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.bench import optimizer_step
from xirang_ds.launch import run_ranks

FP32 = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "fp32"}]}}
INT8_AFTER_2 = {"optimizer_states": {"enabled": True, "stochastic_rounding": True,
                                     "schedule": [{"dtype": "fp32", "until_step": 3}, {"dtype": "int8"}]}}


def _steps(engine, data, steps):
    return [optimizer_step(engine, data) for _ in range(steps)]


def _reference_engine(config):
    """Plain DeepSpeed with torch.optim.AdamW over the groups the plugin would build."""
    import deepspeed

    from xirang_ds.plugins.optimizer_states.config import OptimizerStatesConfig
    from xirang_ds.models import BUILTIN_SPECS, build_model
    from xirang_ds.plugins.optimizer_states.build import keep_reasons, split_groups

    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    groups = split_groups([{"params": list(model.parameters())}], keep_reasons(model, OptimizerStatesConfig()))
    params = config["optimizer"]["params"]
    opt = torch.optim.AdamW(groups, lr=params["lr"], weight_decay=params["weight_decay"])
    plain = {k: v for k, v in config.items() if k not in ("xirang", "optimizer")}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=plain)
    return engine


def _our_engine(config, client=None):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    if client == "adam_two_groups":
        optimizer = torch.optim.Adam([{"params": list(model.blocks.parameters()), "lr": 2e-3},
                                      {"params": [p for n, p in model.named_parameters() if not n.startswith("blocks")]}],
                                     lr=1e-3, weight_decay=0.01)
        config = {k: v for k, v in config.items() if k != "optimizer"}
        engine, *_ = xirang_ds.initialize(model=model, optimizer=optimizer, config=config)
    else:
        engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


STAGES = [(0, "fp32"), (0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16")]


def _compare_stages(rank, world, steps):
    """Every (stage, dtype) in one pair of processes: starting ranks costs more than engines."""
    from xirang_ds.plugins.optimizer_states import DynamicAdamW

    out = []
    for stage, dtype in STAGES:
        config = ds_config(stage=stage, dtype=dtype, gas=2, xirang=FP32)
        theirs = _steps(_reference_engine(config), data_iter(4, 64, rank, world), steps)
        engine = _our_engine(config)
        ours = _steps(engine, data_iter(4, 64, rank, world), steps)
        out.append((theirs, ours, isinstance(engine.basic_optimizer, DynamicAdamW),
                    engine.basic_optimizer.format_numel()))
    return out


@pytest.mark.distributed
def test_fp32_states_equal_deepspeed_adamw_at_zero_0_to_3_with_accumulation_on_2_ranks():
    for per_rank in run_ranks(_compare_stages, 2, 3, threads=1):
        for (stage, dtype), (theirs, ours, replaced, numel) in zip(STAGES, per_rank):
            assert replaced, (stage, dtype)
            assert ours == theirs, (stage, dtype)
            assert set(numel) == {"fp32"}, (stage, dtype)


def _train(engine, rank, world, steps, skip=0):
    data = data_iter(4, 64, rank, world)
    for _ in range(skip):
        next(data)
    losses = _steps(engine, data, steps)
    opt = engine.basic_optimizer
    codes = [t.dtype for s in opt.state.values() for k, t in s.items() if k.endswith("_codes")]
    return {"losses": losses, "formats": opt.format_numel(), "code_dtypes": sorted(set(map(str, codes)))}


def _full_and_saved(rank, world, config, save_dir):
    full = _train(_our_engine(config), rank, world, 5)
    engine = _our_engine(config)
    _train(engine, rank, world, 3)
    engine.save_checkpoint(save_dir)
    return full


def _resumed(rank, world, configs, load_dir):
    out = []
    for config, steps in configs:
        engine = _our_engine(config)
        engine.load_checkpoint(load_dir)
        out.append(_train(engine, rank, world, steps, skip=6))
    return out


def _load_elsewhere(rank, world, config, load_dir):
    engine = _our_engine(config)
    engine.load_checkpoint(load_dir)
    return {"events": [e["kind"] for e in engine.xirang.events], "steps": engine.global_steps}


@pytest.mark.distributed
def test_checkpoint_resume_is_bit_for_bit_and_converts_at_another_format_or_world_size(tmp_path):
    """Codes, scales, the schedule position and the rounding generator travel in the checkpoint."""
    config = ds_config(stage=2, dtype="bf16", gas=2, xirang=INT8_AFTER_2)
    int4 = ds_config(stage=2, dtype="bf16", gas=2, xirang={"optimizer_states": {
        "enabled": True, "schedule": [{"dtype": "fp32", "until_step": 3}, {"dtype": "int4"}]}})
    full = run_ranks(_full_and_saved, 2, config, str(tmp_path), threads=1)
    resumed = run_ranks(_resumed, 2, [(config, 2), (int4, 1)], str(tmp_path), threads=1)
    for f, (same, other) in zip(full, resumed):
        assert_resumed(f, same, at=3)
        assert set(same["formats"]) == {"fp32", "int8"}  # pinned embeddings/norms, quantized rest
        assert same["code_dtypes"] == ["torch.int8", "torch.uint8"]
        # saved as int8, resumed with an int4 schedule: converted by the next update
        assert set(other["formats"]) == {"fp32", "int4"}
        assert abs(other["losses"][0] - f["losses"][3]) < 0.05
    # another data-parallel world size: ZeRO partitions differ, so the codes (kept beside DeepSpeed's plain
    # files, docs/checkpoints.md) are taken over whole instead of loaded by DeepSpeed
    elsewhere = run_ranks(_load_elsewhere, 1, config, str(tmp_path), threads=1)[0]
    assert elsewhere["events"] == ["optimizer_state_taken_over"] and elsewhere["steps"] > 0


def _remove_client_and_tracker(rank, world, steps):
    from xirang_ds.memory.categories import OPTIMIZER_STATES

    # removal: a torch AdamW takes over and continues exactly like DeepSpeed's own
    config = ds_config(stage=2, dtype="bf16", gas=2, xirang=FP32)
    theirs = _steps(_reference_engine(config), data_iter(4, 64, rank, world), 2 * steps)
    engine = _our_engine(config)
    data = data_iter(4, 64, rank, world)
    ours = _steps(engine, data, steps)
    engine.xirang.remove()
    ours += _steps(engine, data, steps)
    removal = (theirs, ours, type(engine.basic_optimizer).__name__, type(engine.optimizer.optimizer).__name__)
    # a client torch.optim.Adam with two groups, int8 from the first step, measured by the tracker
    config = ds_config(stage=1, dtype="bf16", xirang={"optimizer_states": {"enabled": True,
                                                                           "schedule": [{"dtype": "int8"}]}})
    engine = _our_engine(config, client="adam_two_groups")
    tracker = engine.xirang.track_memory()
    _steps(engine, data_iter(4, 64, rank, world), steps)
    opt = engine.basic_optimizer
    measured = tracker.by_category(tracker.live_records())[OPTIMIZER_STATES]
    quantized = [p for p, s in opt.state.items() if "exp_avg_codes" in s]
    client = (measured, opt.state_nbytes(), sum(p.numel() for p in quantized),
              sum(opt.state_nbytes(p) for p in quantized),
              sorted((g["lr"], g["keep_fp32"], g["adam_w_mode"]) for g in opt.param_groups))
    return removal, client


@pytest.mark.distributed
def test_removal_client_adam_and_measured_int8_bytes():
    for removal, client in run_ranks(_remove_client_and_tracker, 2, 2, threads=1):
        theirs, ours, basic, inner = removal
        assert ours == theirs
        assert basic == inner == "AdamW"
        measured, held, quantized, quantized_bytes, groups = client
        assert measured == held  # the live-storage tracker sees exactly the state buffers
        assert quantized > 0 and quantized_bytes / quantized <= 2.1
        assert groups == [(1e-3, False, False), (1e-3, True, False), (2e-3, False, False), (2e-3, True, False)]


def _bad_initialize(rank, world):
    import deepspeed.comm as dist

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    block = {"optimizer_states": {"enabled": True}}
    cases = {
        "sgd_block": dict(config=ds_config(xirang=block, optimizer={"type": "SGD", "params": {"lr": 0.1}})),
        "offload": dict(config=ds_config(stage=2, xirang=block, zero_optimization={
            "stage": 2, "offload_optimizer": {"device": "cpu"}})),
        "no_optimizer": dict(config={k: v for k, v in ds_config(xirang=block).items() if k != "optimizer"}),
        "glob": dict(config=ds_config(xirang={"optimizer_states": {"enabled": True, "keep_fp32": ["blocks.9.*"]}})),
    }
    out = {}
    for name, kwargs in cases.items():
        model = build_model(BUILTIN_SPECS["gpt-tiny"])
        try:
            xirang_ds.initialize(model=model, model_parameters=model.parameters(), **kwargs)
            out[name] = None
        except xirang_ds.XirangConfigError as e:
            out[name] = str(e)
    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    try:
        xirang_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             config={k: v for k, v in ds_config(xirang=block).items() if k != "optimizer"})
        out["client_sgd"] = None
    except xirang_ds.XirangConfigError as e:
        out["client_sgd"] = str(e)
    out["deepspeed_started"] = dist.is_initialized()
    return out


def test_bad_optimizers_fail_at_initialize_before_deepspeed_runs():
    out = run_ranks(_bad_initialize, 1, threads=1)[0]
    assert "optimizer.type: optimizer_states replaces Adam and AdamW only; the optimizer is 'SGD'" in out["sgd_block"]
    assert "offload_optimizer.device is 'cpu'" in out["offload"]
    assert "there is no optimizer to replace" in out["no_optimizer"]
    assert "keep_fp32[0]: 'blocks.9.*' matches no parameter" in out["glob"]
    assert "the optimizer is torch.optim.sgd.SGD (client optimizer)" in out["client_sgd"]
    assert out["deepspeed_started"] is False


def _fp16_cuda(rank, world):
    theirs = _steps(_reference_engine(ds_config(stage=2, dtype="fp16", xirang=FP32)), data_iter(4, 64, rank, world), 3)
    ours = _steps(_our_engine(ds_config(stage=2, dtype="fp16", xirang=FP32)), data_iter(4, 64, rank, world), 3)
    return theirs, ours


@pytest.mark.gpu
def test_fp16_mode_on_cuda_matches_deepspeed_adamw():
    """DeepSpeed refuses fp16 on the CPU accelerator; this runs where CUDA is present."""
    for theirs, ours in run_ranks(_fp16_cuda, 1):
        assert ours == theirs
