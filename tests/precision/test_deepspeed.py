"""The precision plugin on real DeepSpeed engines: 2 gloo ranks, gradient accumulation, ZeRO 0/1/2,
fp16 loss scaling with overflow, checkpoints, removal, bad input, weight bytes."""
import copy

import pytest
import torch

from tests.harness import engine_runs
from tests.harness.checks import assert_resumed, resume_runs
from tests.harness.engine_runs import ds_config
from xirang_ds.bench import optimizer_step
from xirang_ds.launch import run_ranks

PRECISION = {"precision": {"enabled": True, "weight_copies": "on_demand"}}


def _steps(engine, data, steps):
    """``steps`` optimizer steps; the mean loss of each step's micro-batches."""
    return [optimizer_step(engine, data) for _ in range(steps)]


def _numerics(rank, world, stage, copies):
    """fp32 reference, then the block (bf16); what the optimizer saw, masters, bytes, removal."""
    import deepspeed

    import xirang_ds
    from xirang_ds.memory.categories import PARAMETERS
    from xirang_ds.models import BUILTIN_SPECS, build_model
    from xirang_ds.plugins.precision.kernels import installed_policy

    out = {}
    for use in (False, True):
        block = {"precision": {"enabled": True, "weight_copies": copies, "fp32_modules": ["lm_head"]}}
        config = ds_config(stage=stage, dtype="bf16" if use else "fp32", gas=2, xirang=block if use else None)
        model = build_model(BUILTIN_SPECS["gpt-tiny"])
        engine, *_ = (xirang_ds.initialize if use else deepspeed.initialize)(
            model=model, model_parameters=model.parameters(), config=config)
        seen = set()
        basic = engine.basic_optimizer
        hook = basic.register_step_pre_hook(lambda opt, a, k: seen.update(
            (str(p.dtype), str(p.grad.dtype)) for g in opt.param_groups for p in g["params"] if p.grad is not None))
        tracker = xirang_ds.MemoryTracker("cpu")
        from xirang_ds.memory.engine_roles import watch_engine

        watch = watch_engine(tracker, engine)
        weights = tracker.by_category(tracker.live_records())[PARAMETERS]
        watch.remove()
        data = engine_runs.data_iter(4, 64, rank, world)
        losses = _steps(engine, data, 2)
        hook.remove()
        out[use] = {"losses": losses, "seen": sorted(seen), "weight_bytes": weights,
                    "modes": (engine.bfloat16_enabled(), engine.fp16_enabled())}
        if use:
            session = engine.xirang
            plugin = session.plugin("precision")
            out["masters_shared"] = plugin.masters_shared
            out["weight_copies"] = plugin.plan.weight_copies
            x, _ = next(data)
            with torch.no_grad():
                before = engine.module(x)
            session.remove()
            reference = copy.deepcopy(engine.module)
            with torch.no_grad():
                after = engine.module(x)
                plain = reference(x)
            out["removed"] = (installed_policy("cpu") is None, "forward" not in vars(engine.module),
                              str(before.dtype), str(after.dtype), torch.equal(after, plain))
    return out


NUMERICS = [(0, "auto", "on_demand"), (1, "on_demand", "on_demand"), (2, "auto", "persistent")]
OVERFLOW_STAGES = [0, 2]


def _two_rank_scenarios(rank, world):
    """The 2-rank runs of the tests below, in one process pair (starting ranks is the slow part); each
    run removes its session, and with it the precision policy, before the next."""
    return {"numerics": {stage: _numerics(rank, world, stage, copies) for stage, copies, _ in NUMERICS},
            "overflow": {stage: _overflow(rank, world, stage) for stage in OVERFLOW_STAGES},
            "shared_vs_separate": _shared_vs_separate(rank, world),
            "compositions": _compose(rank, world, list(COMPOSITIONS), False),
            "reference_adamw": _compose(rank, world, ["on_demand", "persistent"], True),
            "fp16_with_grad_release": _fp16_with_grad_release(rank, world)}


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_scenarios, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("stage, copies, layout", NUMERICS)
def test_trains_like_fp32_with_fp32_optimizer_view_2_ranks(stage, copies, layout, two_ranks):
    for rank_out in (r["numerics"][stage] for r in two_ranks):
        ref, ours = rank_out[False], rank_out[True]
        for a, b in zip(ours["losses"], ref["losses"]):
            assert abs(a - b) / b < 1e-3, (ours["losses"], ref["losses"])
        assert rank_out["weight_copies"] == layout
        # on_demand: DeepSpeed runs in fp32; persistent: in its bf16 mode
        assert ours["modes"] == (layout == "persistent", False)
        assert ours["seen"] == [("torch.float32", "torch.float32")]  # the optimizer sees fp32 params and grads
        if stage:
            # on_demand: the rank's fp32 master partition is a view of the weights (DeepSpeed's clone is
            # gone); persistent: 16-bit weights plus the partition
            assert rank_out["masters_shared"] == (layout == "on_demand")
            assert ours["weight_bytes"] < ref["weight_bytes"]
        # lm_head is an fp32 module: fp32 logits (persistent: from an fp32 copy of its bf16 weight)
        model_dtype = "torch.bfloat16" if layout == "persistent" else "torch.float32"
        assert rank_out["removed"] == (True, True, "torch.float32", model_dtype, True)


def _overflow(rank, world, stage):
    """fp16 with loss scale 256, hysteresis 1: rank 1's loss is inf in one micro-step of step 3."""
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    config = ds_config(stage=stage, dtype="fp16", gas=2, xirang=PRECISION)
    config["fp16"].update(hysteresis=1)
    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    plugin = engine.xirang.plugin("precision")
    data = engine_runs.data_iter(4, 64, rank, world)
    record = []
    for step in range(4):
        before = [p.detach().clone() for p in engine.module.parameters()]
        scale = plugin.loss_scale
        for micro in range(2):
            x, y = next(data)
            loss = engine(x, y)
            if step == 2 and micro == 1 and rank == 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
        changed = any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
        record.append({"scale": scale, "changed": changed, "skipped": engine.skipped_steps,
                       "global_steps": engine.global_steps})
    engine.xirang.remove()
    return record


@pytest.mark.distributed
@pytest.mark.parametrize("stage", OVERFLOW_STAGES)
def test_fp16_overflow_skips_the_step_on_every_rank_and_halves_the_scale(stage, two_ranks):
    records = [r["overflow"][stage] for r in two_ranks]
    assert records[0] == records[1]  # every rank took the same decision
    r = records[0]
    assert [s["scale"] for s in r] == [256, 256, 256, 128]
    assert [s["changed"] for s in r] == [True, True, False, True]
    assert [s["skipped"] for s in r] == [0, 0, 1, 1]
    assert [s["global_steps"] for s in r] == [1, 2, 3, 4]


def _round_trip(rank, world, config, tmp):
    full, _, resumed = resume_runs(engine_runs.train, tmp, rank, world, config,
                                   skip=2 * config["gradient_accumulation_steps"])
    return full, resumed


@pytest.mark.distributed
@pytest.mark.parametrize("stage, dtype", [(2, "bf16"), (0, "fp16")])
def test_checkpoint_round_trip_resumes_identically(stage, dtype, tmp_path):
    config = ds_config(stage=stage, dtype=dtype, gas=2 if dtype == "bf16" else 1, xirang=PRECISION)
    if dtype == "fp16":
        config["fp16"].update(loss_scale_window=1)  # the scale doubles every step: its state must travel
    for full, resumed in run_ranks(_round_trip, 2, config, str(tmp_path)):
        assert_resumed(full, resumed, at=2)
        assert resumed["global_steps"] == full["global_steps"] == 4
        assert resumed["session_state"] == full["session_state"]
    if dtype == "fp16":
        assert full["session_state"]["precision"]["loss_scaler"]["cur_scale"] == 256 * 2 ** 3


def _bad(rank, world):
    import deepspeed.comm as dist

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    messages = []
    for block, ds_extra, to_bf16 in (({"fp32_modules": ["blocks.*.ln1"]}, {}, False),
                                     ({}, {"torch_autocast": {"enabled": True}}, False),
                                     ({}, {}, True)):
        model = build_model(BUILTIN_SPECS["gpt-tiny"])
        if to_bf16:
            model = model.bfloat16()
        config = ds_config(stage=1, xirang={"precision": {"enabled": True, **block}}, **ds_extra)
        try:
            xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
            messages.append(None)
        except xirang_ds.XirangConfigError as e:
            messages.append(str(e))
    return messages, dist.is_initialized()


def test_bad_input_fails_before_deepspeed_runs():
    messages, started = run_ranks(_bad, 1)[0]
    assert started is False
    assert "xirang.precision.fp32_modules[0]: glob 'blocks.*.ln1' matches no module" in messages[0]
    assert "close names: blocks.1.ln_1, blocks.0.ln_1" in messages[0]
    assert "ds_config.torch_autocast.enabled: DeepSpeed's torch_autocast and xirang.precision both cast" in messages[1]
    assert "xirang.precision: 29 parameter(s) are not fp32 (first: embed.weight, torch.bfloat16)" in messages[2]


def _weight_bytes(rank, world):
    """Parameters bytes at the peak of one step: DeepSpeed bf16 vs the block (ZeRO 0, 1 rank)."""
    import deepspeed

    import xirang_ds
    from xirang_ds.memory.categories import PARAMETERS
    from xirang_ds.memory.engine_roles import watch_engine
    from xirang_ds.models import BUILTIN_SPECS, build_model

    out = {}
    for use in (False, True):
        model = build_model(BUILTIN_SPECS["gpt-tiny"])
        config = ds_config(stage=0, dtype="bf16", micro=2, xirang=PRECISION if use else None)
        engine, *_ = (xirang_ds.initialize if use else deepspeed.initialize)(
            model=model, model_parameters=model.parameters(), config=config)
        if use:
            tracker = engine.xirang.track_memory()
        else:
            tracker = xirang_ds.MemoryTracker("cpu")
            watch_engine(tracker, engine)
            tracker.start()
        window = tracker.open_window()
        x, y = next(engine_runs.data_iter(2, 64, rank, world))
        engine.backward(engine(x, y))
        engine.step()
        out[use] = window.report().by_category[PARAMETERS]
        tracker.stop()
    params = list(build_model(BUILTIN_SPECS["gpt-tiny"]).parameters())
    return out, sum(p.numel() for p in params), max(p.numel() for p in params)


def test_weights_kept_once_with_16_bit_copies_one_at_a_time():
    out, n, largest = run_ranks(_weight_bytes, 1)[0]
    assert out[False] >= 6 * n  # DeepSpeed bf16: 16-bit weights and fp32 masters, all the time
    assert 4 * n <= out[True] <= 4 * n + 2 * largest  # fp32 masters, plus at most one 16-bit copy


def _shared_vs_separate(rank, world):
    """Two engines from the same seed: masters shared (the plugin) and separated again by hand."""
    import deepspeed.comm as dist

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    out = []
    for separate in (False, True):
        model = build_model(BUILTIN_SPECS["gpt-tiny"])
        engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(stage=2, dtype="bf16", xirang=PRECISION))
        opt = engine.optimizer
        if separate:  # DeepSpeed's own layout: a cloned fp32 master partition
            for i, master in enumerate(opt.single_partition_of_fp32_groups):
                part = opt.parallel_partitioned_bit16_groups[i][dist.get_rank(group=opt.real_dp_process_group[i])]
                master.data = part.detach().clone()
            opt._link_all_hp_params()
        losses = _steps(engine, engine_runs.data_iter(4, 64, rank, world), 2)
        out.append((losses, [p.detach().clone() for p in engine.module.parameters()]))
        engine.xirang.remove()
    return out


@pytest.mark.distributed
def test_shared_zero_masters_change_no_result(two_ranks):
    for (shared_losses, shared), (separate_losses, separate) in (r["shared_vs_separate"] for r in two_ranks):
        assert shared_losses == separate_losses
        assert all(torch.equal(a, b) for a, b in zip(shared, separate))


# composing with grad_release and optimizer_states ------------------------------------------------------
COMPOSE_BUCKET = 8192  # grad_release's bucket and DeepSpeed's reduce bucket (gpt-tiny: 136,960 elements)
FP32_STATES = {"enabled": True, "schedule": [{"dtype": "fp32"}]}
INT8_STATES = {"enabled": True, "schedule": [{"dtype": "int8"}]}
COMPOSITIONS = {
    "on_demand": {"precision": {"enabled": True, "weight_copies": "on_demand"}},
    "on_demand+grad_release": {"precision": {"enabled": True, "weight_copies": "on_demand"},
                               "grad_release": {"enabled": True, "bucket_size_numel": COMPOSE_BUCKET}},
    "persistent": {"precision": {"enabled": True}},  # auto: persistent at ZeRO 2 on 2 ranks
    "persistent+grad_release": {"precision": {"enabled": True},
                                "grad_release": {"enabled": True, "bucket_size_numel": COMPOSE_BUCKET}},
    "on_demand+optimizer_states": {"precision": {"enabled": True, "weight_copies": "on_demand"},
                                   "optimizer_states": FP32_STATES},
    "persistent+optimizer_states": {"precision": {"enabled": True}, "optimizer_states": FP32_STATES},
    "on_demand+optimizer_states_int8": {"precision": {"enabled": True, "weight_copies": "on_demand"},
                                       "optimizer_states": INT8_STATES},
}


def _client_adamw(model, config):
    """torch.optim.AdamW over the groups optimizer_states builds (its fp32 schedule is AdamW's math)."""
    from xirang_ds.plugins.optimizer_states.config import OptimizerStatesConfig
    from xirang_ds.plugins.optimizer_states.build import keep_reasons, split_groups

    groups = split_groups([{"params": list(model.parameters())}], keep_reasons(model, OptimizerStatesConfig()))
    params = config["optimizer"]["params"]
    return torch.optim.AdamW(groups, lr=params["lr"], weight_decay=params["weight_decay"])


def _compose(rank, world, names, client_adamw):
    """bf16 ZeRO-2, accumulation 2, 3 steps per composition; the third step measured by the tracker."""
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    out = {}
    for name in names:
        config = ds_config(stage=2, dtype="bf16", micro=2, gas=2, bucket=COMPOSE_BUCKET, xirang=COMPOSITIONS[name])
        config["gradient_clipping"] = 0.0
        model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
        if client_adamw:
            optimizer = _client_adamw(model, config)
            config.pop("optimizer")
            engine, *_ = xirang_ds.initialize(model=model, optimizer=optimizer, config=config)
        else:
            engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
        data = engine_runs.data_iter(2, 64, rank, world)
        tracker = engine.xirang.track_memory()
        losses = _steps(engine, data, 2)
        window = tracker.open_window()
        losses += _steps(engine, data, 1)
        report = window.report()
        plugin = engine.xirang.plugin("precision")
        out[name] = {"losses": losses, "params": torch.cat([p.detach().float().reshape(-1)
                                                             for p in engine.module.parameters()]),
                     "weight_copies": plugin.plan.weight_copies, "grad_max": window.most_at_once()["gradients"],
                     "states": report.by_category.get("optimizer_states", 0), "peak": report.peak_bytes,
                     "plugins": [p.section for p in engine.xirang.plugins],
                     "optimizer": type(engine.basic_optimizer).__name__}
        window.close()
        engine.xirang.remove()
        tracker.stop()
    return out


@pytest.fixture(scope="module")
def compositions(two_ranks):
    """Every composition and the two references, per rank."""
    return [{**r["compositions"], "reference_adamw": r["reference_adamw"]} for r in two_ranks]


def _fp16_with_grad_release(rank, world):
    """fp16 ZeRO-2 with grad_release: on_demand is refused naming both sections; persistent hands
    scaling to grad_release where DeepSpeed's fp16 mode runs on the device, else it is refused."""
    import xirang_ds
    from deepspeed.accelerator import get_accelerator
    from xirang_ds.config.validate import XirangConfigError
    from xirang_ds.models import BUILTIN_SPECS, build_model

    out = {"deepspeed_fp16": bool(get_accelerator().is_fp16_supported())}
    persistent = copy.deepcopy(COMPOSITIONS["persistent+grad_release"])
    persistent["precision"]["weight_copies"] = "persistent"
    runs = {"on_demand": COMPOSITIONS["on_demand"], "auto": COMPOSITIONS["persistent"],
            "persistent": {"precision": persistent["precision"]},
            "on_demand+grad_release": COMPOSITIONS["on_demand+grad_release"], "persistent+grad_release": persistent}
    for name, block in runs.items():
        config = ds_config(stage=2, dtype="fp16", micro=2, gas=2, bucket=COMPOSE_BUCKET, xirang=block)
        config["gradient_clipping"] = 0.0
        model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
        try:
            engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
        except XirangConfigError as e:
            out[name] = str(e)
            continue
        out[name] = {"losses": _steps(engine, engine_runs.data_iter(2, 64, rank, world), 3),
                     "weight_copies": engine.xirang.plugin("precision").plan.weight_copies}
        engine.xirang.remove()
    return out


@pytest.mark.distributed
def test_composes_with_grad_release_and_optimizer_states_2_ranks(compositions):
    """bf16 ZeRO-2, 2 ranks, accumulation 2, 3 steps; tracker on the third step.

    on_demand + grad_release: the engine is fp32 underneath, so grad_release applies the same fp32
    AdamW to the same fp32 gradients: identical losses and weights to precision alone, with fewer
    gradient bytes alive at once. persistent + grad_release: grad_release keeps its own fp32 masters
    and reduces in its own order, so the 16-bit weights may round differently: within 2 bf16 ulps.
    optimizer_states with fp32 states is torch.optim.AdamW's math: identical to precision with a client
    AdamW over the same parameter groups, in both layouts; int8 states take fewer bytes."""
    for rank in compositions:
        ref = rank["reference_adamw"]
        for name in COMPOSITIONS:
            assert all(torch.isfinite(torch.tensor(rank[name]["losses"]))), name
            assert "precision" in rank[name]["plugins"], name
        assert rank["on_demand+grad_release"]["weight_copies"] == "on_demand"
        assert rank["persistent+grad_release"]["weight_copies"] == "persistent"
        # grad_release
        alone, released = rank["on_demand"], rank["on_demand+grad_release"]
        assert released["losses"] == alone["losses"] and torch.equal(released["params"], alone["params"])
        assert released["grad_max"] < alone["grad_max"]
        alone, released = rank["persistent"], rank["persistent+grad_release"]
        for a, b in zip(released["losses"], alone["losses"]):
            assert abs(a - b) / b < 1e-4, (released["losses"], alone["losses"])
        assert float((released["params"] - alone["params"]).abs().max()) <= 2 * 2.0 ** -8
        assert released["grad_max"] < alone["grad_max"]
        # optimizer_states
        for layout in ("on_demand", "persistent"):
            ours = rank[f"{layout}+optimizer_states"]
            assert ours["optimizer"] == "DynamicAdamW"
            assert ours["losses"] == ref[layout]["losses"] and torch.equal(ours["params"], ref[layout]["params"])
        int8, fp32 = rank["on_demand+optimizer_states_int8"], rank["on_demand+optimizer_states"]
        assert int8["states"] < 0.5 * fp32["states"]
        assert int8["peak"] < fp32["peak"]
        for a, b in zip(int8["losses"], fp32["losses"]):
            assert abs(a - b) / b < 1e-3


@pytest.mark.distributed
def test_fp16_with_grad_release_scales_in_grad_release_or_is_refused_2_ranks(two_ranks):
    for out in (r["fp16_with_grad_release"] for r in two_ranks):
        assert all(torch.isfinite(torch.tensor(out["on_demand"]["losses"])))
        message = out["on_demand+grad_release"]
        assert "xirang.precision.dtype" in message and "xirang.grad_release" in message
        assert "weight_copies to \"persistent\"" in message
        # grad_release takes DeepSpeed's fp16 section over (its own fp32 masters and loss scaler) and
        # hands DeepSpeed an fp32 config, so persistent fp16 runs with it even where DeepSpeed's fp16
        # mode does not; precision alone with persistent fp16 needs DeepSpeed's mode
        assert all(torch.isfinite(torch.tensor(out["persistent+grad_release"]["losses"])))
        assert out["persistent+grad_release"]["weight_copies"] == "persistent"
        for a, b in zip(out["persistent+grad_release"]["losses"], out["on_demand"]["losses"]):
            assert abs(a - b) / b < 1e-2, (out["persistent+grad_release"], out["on_demand"])
        # auto takes DeepSpeed's layout at ZeRO 2 on 2 ranks only where DeepSpeed's fp16 mode runs
        assert out["auto"]["weight_copies"] == ("persistent" if out["deepspeed_fp16"] else "on_demand")
        if out["deepspeed_fp16"]:
            assert out["persistent"]["weight_copies"] == "persistent"
        else:
            assert "xirang.precision.weight_copies" in out["persistent"] and "\"on_demand\"" in out["persistent"]
