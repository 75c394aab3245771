"""grad_release on real DeepSpeed engines over 1 and 2 gloo ranks: numerics against the same run
without it, fp16 overflow late in backward, checkpoints, removal, errors and memory.

Run functions are module-level so `run_ranks` can start them in fresh processes; each process
trains several configurations to keep process starts (the slow part on CPU) few.
"""
import copy
import math

import pytest
import torch

from tests.harness import engine_runs
from tests.harness.checks import assert_resumed
from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks

SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}}
BUCKET = 20_000  # gpt-tiny has 136,960 trainable elements: 9 buckets
MEMORY_BUCKET = 8192


def _block(**keys):
    return {"grad_release": {"enabled": True, "bucket_size_numel": BUCKET, **keys}}


def _train(rank, world, config, steps, use_xirang=True, inject=None, until=None):
    """Train gpt-tiny; return losses, flat parameters, counters and the engine.

    Args:
        inject: ``(step, rank, param_name)``: that rank's gradient of that parameter becomes inf in the
            last micro-step of that optimizer step (1-based).
        until: a callable ``(engine, step) -> None`` run after each optimizer step.
    """
    import deepspeed

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-tiny"]
    model = build_model(spec, seed=0)
    init = xirang_ds.initialize if use_xirang else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    data = engine_runs.data_iter(engine.train_micro_batch_size_per_gpu(), spec.seq, rank, world)
    gas = engine.gradient_accumulation_steps()
    losses = []
    for step in range(1, steps + 1):
        total = 0.0
        for micro in range(gas):
            x, y = next(data)
            loss = engine(x, y)
            handle = None
            if inject and inject[0] == step and micro == gas - 1:  # a hook on every rank, inf on one
                param = dict(engine.module.named_parameters())[inject[2]]
                handle = param.register_hook(lambda g: torch.full_like(g, float("inf")) if rank == inject[1] else g)
            engine.backward(loss)
            if handle is not None:
                handle.remove()
            engine.step()
            total += loss.item()
        losses.append(total / gas)
        if until is not None:
            until(engine, step)
    return {"losses": losses, "params": _flat(engine), "global_steps": engine.global_steps,
            "skipped": engine.skipped_steps, "lr": engine.get_lr()[0], "samples": engine.global_samples}, engine


def _flat(engine):
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def _max_diff(a, b):
    return float((a - b).abs().max())


# numerics ----------------------------------------------------------------------------------------------
def _numerics(rank, world):
    """fp32, 3 steps, every stage x accumulation 1 and 4 x clipping off and on, with a scheduler."""
    out = {}
    for stage in (0, 1, 2):
        for gas in (1, 4):
            for clip in (0.0, 0.05):
                config = ds_config(stage=stage, dtype="fp32", micro=2, gas=gas, clip=clip, scheduler=SCHEDULER)
                if not clip:
                    config["gradient_clipping"] = 0.0  # DeepSpeed clips at 1.0 by default
                plain, _ = _train(rank, world, config, 3, use_xirang=False)
                ours, engine = _train(rank, world, {**config, "xirang": _block()}, 3)
                out[(stage, gas, clip)] = {
                    "diff": _max_diff(plain["params"], ours["params"]),
                    "moved": _max_diff(plain["params"], _initial_params()), "plain": _counters(plain),
                    "ours": _counters(ours), "summary": engine.xirang.summary(),
                    "loss_diff": max(abs(a - b) for a, b in zip(plain["losses"], ours["losses"]))}
    return out


def _initial_params():
    from xirang_ds.models import BUILTIN_SPECS, build_model

    return torch.cat([p.detach().float().reshape(-1) for p in build_model(BUILTIN_SPECS["gpt-tiny"], 0).parameters()])


def _counters(result):
    return {k: result[k] for k in ("global_steps", "skipped", "lr", "samples")}


def _bf16(rank, world):
    """bf16 ZeRO-2, accumulation 2, clipping that bites: the exact methods against plain DeepSpeed."""
    config = ds_config(stage=2, dtype="bf16", micro=2, gas=2, clip=0.05)
    plain, _ = _train(rank, world, config, 3, use_xirang=False)
    out = {"plain_losses": plain["losses"]}
    for name, keys in {"host": {"exact_method": "host"}, "hold": {"exact_method": "hold"},
                       "two_pass": {"exact_method": "two_pass"},
                       "no_overlap": {"overlap_comm": False}, "fp32_masters": {"masters": "fp32"}}.items():
        ours, engine = _train(rank, world, {**config, "xirang": _block(**keys)}, 3)
        out[name] = {"diff": _max_diff(plain["params"], ours["params"]), "losses": ours["losses"],
                     "params": ours["params"], "counters": _counters(ours) == _counters(plain),
                     "remainders": [b.remainders for b in engine.xirang.plugin("grad_release").buckets]}
    stage0 = ds_config(stage=0, dtype="bf16", micro=2, gas=2, clip=0.05)  # not sharded: the whole bucket per rank
    for name, masters in (("stage0", "auto"), ("stage0_fp32_masters", "fp32")):
        ours, _ = _train(rank, world, {**stage0, "xirang": _block(masters=masters)}, 3)
        out[name] = {"losses": ours["losses"], "params": ours["params"]}
    return out


def _approximations(rank, world):
    """fp32 ZeRO-2, clipping that bites: how far previous_step and per_layer land from exact."""
    config = ds_config(stage=2, dtype="fp32", micro=2, gas=2, clip=0.05)
    exact, _ = _train(rank, world, {**config, "xirang": _block()}, 4)
    update = (exact["params"] - _initial_params()).norm()
    out = {}
    for mode in ("previous_step", "per_layer"):
        ours, _ = _train(rank, world, {**config, "xirang": _block(clipping=mode)}, 4)
        out[mode] = float((ours["params"] - exact["params"]).norm() / update)
    return out


# fp16: an overflow late in backward skips the whole step ------------------------------------------------
def _fp16_overflow(rank, world, method):
    config = ds_config(stage=2, dtype="fp16", micro=2, gas=2, clip=0.05, scheduler=SCHEDULER)
    config["fp16"]["hysteresis"] = 1  # DeepSpeed's default 2 would halve the scale at the second overflow
    snapshots = {}

    def snap(engine, step):
        snapshots[step] = {"params": _flat(engine), "lr": engine.get_lr()[0],
                           "scale": engine.xirang.plugin("grad_release").policy.loss_scale,
                           "skipped": engine.skipped_steps}

    ours, engine = _train(rank, world, {**config, "xirang": _block(exact_method=method)}, 3,
                          inject=(2, 1, "embed.weight"), until=snap)
    plugin = engine.xirang.plugin("grad_release")
    return {"snapshots": snapshots, "last_bucket": plugin.buckets[-1].names, "buckets": len(plugin.buckets)}


# checkpoints ---------------------------------------------------------------------------------------------
CKPT_CONFIG = ds_config(stage=2, dtype="bf16", micro=2, gas=2, clip=0.05, scheduler=SCHEDULER,
                        xirang=_block(clipping="previous_step"))


def _ckpt(rank, world, steps, save_dir=None, load_dir=None, skip=0):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-tiny"]
    model = build_model(spec, seed=0)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(CKPT_CONFIG))
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    data = engine_runs.data_iter(2, spec.seq, rank, world)
    for _ in range(skip * 2):
        next(data)
    # each step's gradient norm, which clips the next step's update (``previous_step``): a failed comparison names
    # the norms beside the losses
    policy = engine.xirang.plugin("grad_release").policy
    losses, norms = [], [policy.previous_norm]
    for _ in range(steps):
        for _ in range(2):
            x, y = next(data)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        norms.append(policy.previous_norm)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    return {"losses": losses, "norms": norms, "params": _flat(engine), "steps": engine.global_steps,
            "lr": engine.get_lr()[0]}


# removal -------------------------------------------------------------------------------------------------
def _removal(rank, world):
    """fp32 ZeRO-2: grad_release for 2 steps, removed, plain DeepSpeed for 2 more; against plain 4 steps."""
    config = ds_config(stage=2, dtype="fp32", micro=2, gas=2, clip=0.05)
    plain, _ = _train(rank, world, config, 4, use_xirang=False)
    state = {}

    def remove_after_2(engine, step):
        if step == 2:
            plugin = engine.xirang.plugin("grad_release")
            params = list(engine.module.parameters())
            engine.xirang.remove()
            state["restored"] = {
                "no_wrappers": not any(n in vars(engine) for n in ("backward", "step", "save_checkpoint")),
                "allreduce": engine.enable_backward_allreduce,
                "hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in params),
                "buckets": plugin.buckets, "states": len(engine.basic_optimizer.state)}

    ours, _ = _train(rank, world, {**config, "xirang": _block()}, 4, until=remove_after_2)
    return {"diff": _max_diff(plain["params"], ours["params"]), "restored": state["restored"],
            "counters": _counters(plain) == _counters(ours)}


# errors --------------------------------------------------------------------------------------------------
def _errors(rank, world):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    def init(config, optimizer=None, freeze=False):
        model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
        if callable(optimizer):
            optimizer = optimizer(model)
        if freeze:
            optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "lm_head.weight"])
        try:
            engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config,
                                              optimizer=optimizer)
        except xirang_ds.XirangConfigError as e:
            return "XirangConfigError: " + str(e)
        return engine

    no_block = {k: v for k, v in ds_config(stage=2, xirang=_block()).items() if k != "optimizer"}
    out = {"stage3": init(ds_config(stage=3, xirang=_block())),
           "lbfgs": init({**no_block, "zero_optimization": {"stage": 0}},
                         optimizer=lambda m: torch.optim.LBFGS(m.parameters())),
           "adafactor_stage2": init(no_block, optimizer=lambda m: torch.optim.Adafactor(m.parameters())),
           "adafactor_stage0": type(init({**no_block, "zero_optimization": {"stage": 0}},
                                         optimizer=lambda m: torch.optim.Adafactor(m.parameters()))).__name__,
           "not_in_optimizer": init(no_block, freeze=True),
           "no_optimizer": init(no_block)}
    x, y = next(engine_runs.data_iter(4, 64, rank, world))
    fused = {**ds_config(stage=2, dtype="bf16", gas=1, xirang=_block()), "gradient_clipping": 0.0}
    for mode, config in (("fused", fused), ("hold", {**fused, "gradient_clipping": 1.0})):
        # nonfinite "raise": a NaN gradient on rank 0 stops every rank, naming the bucket
        engine = init(config)
        loss = engine(x, y)
        engine.module.lm_head.weight.register_hook(lambda g: g * float("nan") if rank == 0 else g)
        try:
            engine.backward(loss)
            out[mode] = None
        except RuntimeError as e:
            out[mode] = str(e)
    engine = init(fused)
    engine.backward(engine(x, y))
    try:  # a second backward in the same boundary micro-step (its update already happened)
        engine.backward(engine(x, y))
        out["twice"] = None
    except RuntimeError as e:
        out["twice"] = str(e)
    return out


# memory --------------------------------------------------------------------------------------------------
def _memory(rank, world, use_xirang, clip=0.0, exact_method="host"):
    """bf16 ZeRO-2, same bucket size on both sides; the third step measured with the live-storage tracker."""
    import deepspeed

    import xirang_ds
    from xirang_ds.memory.engine_roles import watch_engine
    from xirang_ds.memory.tracker import MemoryTracker
    from xirang_ds.models import BUILTIN_SPECS, build_model

    config = ds_config(stage=2, dtype="bf16", micro=1, gas=1, clip=clip, bucket=MEMORY_BUCKET)
    config["gradient_clipping"] = clip
    if use_xirang:
        config["xirang"] = _block(bucket_size_numel=MEMORY_BUCKET, exact_method=exact_method)
    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    numel = sum(p.numel() for p in model.parameters())
    engine, *_ = (xirang_ds.initialize if use_xirang else deepspeed.initialize)(
        model=model, model_parameters=model.parameters(), config=config)
    data = engine_runs.data_iter(1, 64, rank, world)  # the corpus tensor exists before tracking starts
    if use_xirang:
        tracker, watch = engine.xirang.track_memory(), None
    else:
        tracker = MemoryTracker()
        watch = watch_engine(tracker, engine)
        tracker.start()
    for step in range(3):
        if step == 2:
            window = tracker.open_window()
        x, y = next(data)
        engine.backward(engine(x, y))
        engine.step()
    report = window.report()
    out = {"numel": numel, "grad_max": window.most_at_once()["gradients"], "at_peak": report.by_category,
           "peak": report.peak_bytes, "phase": report.phase, "host_max": window.category_peaks()["host"],
           "params": _flat(engine)}
    if use_xirang:
        buckets = engine.xirang.plugin("grad_release").buckets
        out["shards"] = [b.remainder.numel() for b in buckets]
        out["remainder_bytes"] = sum(b.remainder.nbytes + b.ties.nbytes for b in buckets)
    window.close()
    if watch is not None:
        watch.remove()
    if use_xirang:
        engine.xirang.remove()
    tracker.stop()
    return out


# the runs, few processes ---------------------------------------------------------------------------------
def _two_rank_scenarios(rank, world, ckpt_dir):
    """Everything that runs on 2 ranks, in one process pair (a process start costs more than a run)."""
    return {"numerics": _numerics(rank, world), "bf16": _bf16(rank, world),
            "approximations": _approximations(rank, world),
            "fp16": {m: _fp16_overflow(rank, world, m) for m in ("host", "hold", "two_pass")},
            "ckpt_full": _ckpt(rank, world, 4), "ckpt_saved": _ckpt(rank, world, 2, ckpt_dir),
            "removal": _removal(rank, world), "errors": _errors(rank, world),
            "memory": {"plain": _memory(rank, world, False), "ours": _memory(rank, world, True)},
            "memory_clipped": {"plain": _memory(rank, world, False, clip=1.0),
                               **{m: _memory(rank, world, True, clip=1.0, exact_method=m) for m in ("host", "hold")}}}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("grad_release_ckpt")
    return {"ranks": run_ranks(_two_rank_scenarios, 2, str(ckpt)), "ckpt": ckpt}


@pytest.fixture(scope="module")
def one_rank():
    return {"ranks": [{"numerics": r} for r in run_ranks(_numerics, 1)]}


# the tests -----------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [1, 2])
def test_parameters_equal_plain_deepspeed(world, stage, request):
    """fp32, 3 steps, accumulation 1 and 4, clipping off and on, a WarmupLR scheduler: the parameters
    equal plain DeepSpeed's to float tolerance; step, sample, skip and lr counters are the same."""
    runs = request.getfixturevalue("one_rank" if world == 1 else "two_ranks")["ranks"]
    for rank_results in runs:
        for (s, gas, clip), r in rank_results["numerics"].items():
            if s != stage:
                continue
            case = f"stage={stage} gas={gas} clip={clip}"
            assert r["moved"] > 1e-3, case  # training moved the weights: the comparison means something
            # Adam moves each weight by up to lr (1e-3..1e-2) a step; 1e-5 is float noise of a different
            # summation order (DeepSpeed's ZeRO-1 sums micro-steps before reducing, grad_release after)
            assert r["diff"] < 1e-5, (case, r["diff"])
            assert r["loss_diff"] < 1e-5, case
            assert r["ours"] == r["plain"], case
            assert f"ZeRO-{stage} semantics over {world} rank(s)" in r["summary"]
            assert ("sharded 1/2" in r["summary"]) == (stage > 0 and world == 2)


@pytest.mark.distributed
def test_bf16_matches_plain_deepspeed_2_ranks(two_ranks):
    """bf16 ZeRO-2, accumulation 2, clipping that bites: hold, two_pass and no overlap end within bf16
    rounding of DeepSpeed, and the two exact methods give the same numbers."""
    for rank_results in two_ranks["ranks"]:
        r = rank_results["bf16"]
        for exact in ("host", "hold", "two_pass", "no_overlap"):
            assert r[exact]["diff"] <= 2 ** -8, (exact, r[exact]["diff"])  # one bf16 ulp of weights below 2
            assert r[exact]["counters"], exact
            assert max(abs(a - b) for a, b in zip(r[exact]["losses"], r["plain_losses"])) < 2e-3
        assert torch.equal(r["hold"]["params"], r["two_pass"]["params"])
        assert torch.equal(r["host"]["params"], r["hold"]["params"])  # the shards' trip to the host is exact


@pytest.mark.distributed
def test_bf16_masters_kept_as_remainders_train_bit_for_bit_as_fp32_masters(two_ranks):
    """ZeRO-2 (each rank its shard) and stage 0 (whole buckets), accumulation 2, clipping that bites:
    the masters rebuilt from the bf16 weights, the 16-bit remainders and the tie bits give the fp32
    masters' run exactly."""
    for rank_results in two_ranks["ranks"]:
        r = rank_results["bf16"]
        assert all(r["host"]["remainders"]) and not any(r["fp32_masters"]["remainders"])  # auto: bf16 → remainders
        assert r["host"]["losses"] == r["fp32_masters"]["losses"]
        assert torch.equal(r["host"]["params"], r["fp32_masters"]["params"])
        assert r["stage0"]["losses"] == r["stage0_fp32_masters"]["losses"]
        assert torch.equal(r["stage0"]["params"], r["stage0_fp32_masters"]["params"])


@pytest.mark.distributed
def test_clipping_approximations_stay_near_exact(two_ranks):
    """fp32, 4 steps with clipping that bites every step: previous_step and per_layer differ from exact
    (they are approximations), by a bounded fraction of the update (measured figures: docs)."""
    for rank_results in two_ranks["ranks"]:
        r = rank_results["approximations"]
        assert 0 < r["previous_step"] < 0.05, r
        assert 0 < r["per_layer"] < 0.5, r


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["host", "hold", "two_pass"])
def test_fp16_overflow_late_in_backward_updates_no_layer(method, two_ranks):
    """Rank 1's gradient of embed.weight, in the last bucket of backward, overflows in step 2: no
    parameter of any layer changes on any rank, the loss scale halves, the step and the scheduler are
    skipped; step 3 trains again."""
    for rank_results in two_ranks["ranks"]:
        r = rank_results["fp16"][method]
        s = r["snapshots"]
        assert "embed.weight" in r["last_bucket"] and r["buckets"] > 2  # the overflow comes last
        assert _max_diff(s[1]["params"], _initial_params()) > 0  # step 1 applied
        assert torch.equal(s[2]["params"], s[1]["params"])  # step 2: nothing changed anywhere
        assert s[2]["scale"] == s[1]["scale"] / 2
        assert (s[1]["skipped"], s[2]["skipped"], s[3]["skipped"]) == (0, 1, 1)
        assert s[2]["lr"] == s[1]["lr"] and s[3]["lr"] > s[2]["lr"]  # the scheduler skipped step 2 only
        assert _max_diff(s[3]["params"], s[2]["params"]) > 0


@pytest.mark.distributed
def test_checkpoint_round_trip_resumes_identically(two_ranks):
    """bf16 ZeRO-2, 2 ranks, accumulation, previous_step clipping (its norm is carried by the file):
    4 steps straight equal 2 steps, save, and 2 steps resumed in fresh processes, bit for bit."""
    ckpt = two_ranks["ckpt"]
    assert sorted(p.name for p in (ckpt / "global_step2" / "xirang_grad_release").iterdir()) == \
        ["rank00000.pt", "rank00001.pt"]
    resumed = run_ranks(_ckpt, 2, 2, None, str(ckpt), 2)
    for rank_results, r in zip(two_ranks["ranks"], resumed):
        full = rank_results["ckpt_full"]
        assert_resumed(full, r, at=2, first=rank_results["ckpt_saved"], params=True)
        assert (r["steps"], r["lr"]) == (full["steps"], full["lr"])


@pytest.mark.distributed
def test_removal_hands_back_to_plain_deepspeed(two_ranks):
    """Removed after 2 of 4 steps: every hook and wrapper is gone, the basic optimizer holds the whole
    state, and the last 2 (plain DeepSpeed) steps end where a plain 4-step run ends (fp32)."""
    for rank_results in two_ranks["ranks"]:
        r = rank_results["removal"]
        assert r["restored"] == {"no_wrappers": True, "allreduce": True, "hooks": 0, "buckets": [], "states": 29}
        assert r["diff"] < 1e-5 and r["counters"]


@pytest.mark.distributed
def test_bad_configurations_fail_at_initialize_naming_both(two_ranks):
    r0, r1 = (r["errors"] for r in two_ranks["ranks"])
    assert "zero_optimization.stage = 3" in r0["stage3"] and "xirang.grad_release" in r0["stage3"]
    assert "LBFGS needs a closure" in r0["lbfgs"] and "xirang.grad_release" in r0["lbfgs"]
    assert "Adafactor is not known to update each element independently" in r0["adafactor_stage2"]
    assert r0["adafactor_stage0"] == "DeepSpeedEngine"  # whole parameters at stage 0: it works
    assert "lm_head.weight requires grad but is in no param group" in r0["not_in_optimizer"]
    assert "needs an optimizer" in r0["no_optimizer"]
    for r in (r0, r1):
        for mode, state in (("fused", "every bucket was applied as it was reduced"),
                            ("hold", "no parameter was updated")):
            assert "non-finite gradient at step 1" in r[mode] and "lm_head.weight" in r[mode], r[mode]
            assert state in r[mode] and "skip_step" in r[mode], r[mode]
        assert "already applied in the previous engine.backward" in r["twice"]


@pytest.mark.distributed
def test_gradient_memory_falls_to_about_one_bucket(two_ranks):
    """Live-storage tracker, bf16 ZeRO-2, 2 ranks, same bucket size on both sides: the most gradient
    bytes alive at once fall from more than the whole model's bf16 gradients to about one bucket's,
    the peak falls, and the tracker counts grad_release's fp32 masters and Adam states (the
    memory-roles seam)."""
    for rank_results in two_ranks["ranks"]:
        plain, ours = rank_results["memory"]["plain"], rank_results["memory"]["ours"]
        numel = ours["numel"]
        assert plain["grad_max"] >= 2 * numel  # DeepSpeed: every bf16 gradient, then fp32 partitions
        bucket_bytes = MEMORY_BUCKET * (2 + 2 + 4)  # bf16 buffer, reduced bf16 shard, fp32 copy, generously
        assert ours["grad_max"] <= 2 * bucket_bytes, (ours["grad_max"], bucket_bytes)
        assert ours["grad_max"] < plain["grad_max"] / 4
        # bf16 weights, and this rank's masters as 2-byte remainders and tie bits instead of DeepSpeed's fp32
        # partition (none is rebuilt at the peak, the start of backward)
        assert ours["remainder_bytes"] == sum(2 * n + math.ceil(n / 8) for n in ours["shards"])
        assert ours["at_peak"]["parameters"] == 2 * numel + ours["remainder_bytes"]
        assert plain["at_peak"]["parameters"] >= 2 * numel + 4 * sum(ours["shards"]) - 4 * 64
        # fp32 Adam moments sharded 1/2 on both sides; grad_release keeps one 4-byte step count per slice
        assert 0 <= ours["at_peak"]["optimizer_states"] - plain["at_peak"]["optimizer_states"] <= 4 * 64
        # micro-batch 1: DeepSpeed peaks in its optimizer step (all gradients, fp32 partitions and Adam's
        # temporaries); grad_release has no such moment and peaks at the start of backward instead
        assert plain["phase"] == "optimizer_step" and ours["phase"] == "backward"
        assert ours["peak"] < 0.9 * plain["peak"]


@pytest.mark.distributed
def test_exact_clipping_keeps_gradients_to_a_few_buckets(two_ranks):
    """gradient_clipping 1.0 (DeepSpeed's default), exact clipping: ``host`` keeps the reduced shards in
    host memory until the norm is known, so the device's gradients stay at a few buckets as without
    clipping (at most 0.25x plain ZeRO-2's), where ``hold`` keeps this rank's whole shard; both give
    the same parameters, and the host holds that shard."""
    for rank_results in two_ranks["ranks"]:
        r = rank_results["memory_clipped"]
        plain, host, hold = r["plain"], r["host"], r["hold"]
        assert host["grad_max"] <= 0.25 * plain["grad_max"], (host["grad_max"], plain["grad_max"])
        assert hold["grad_max"] - host["grad_max"] >= host["numel"] // 2  # hold: this rank's bf16 shard more
        assert torch.equal(host["params"], hold["params"])
        assert host["host_max"] >= 2 * (host["numel"] // 2) and hold["host_max"] == 0
        assert host["peak"] <= hold["peak"]

