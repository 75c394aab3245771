"""grad_release with ``masters: none`` on real DeepSpeed engines over 2 gloo ranks: bf16 weights
rounded stochastically, no master between updates, against fp32 masters; stage 0's ranks agree; a
checkpoint round trip resumes bit for bit. The same under optimizer_states (DynamicAdamW steps the
bf16 weights in place, a chunk at a time): no fp32 copy of a shard even during the update. And
``masters: remainders_8bit`` (the balanced preset's): one byte per master element, the same checks,
and nearer the fp32-master run than ``none``."""
import copy

import pytest
import torch

from tests.harness import engine_runs
from tests.harness.checks import assert_resumed
from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks

SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}}
STEPS = 6


STATES = {"enabled": True, "schedule": [{"dtype": "fp32"}], "min_numel": 0, "chunk_numel": 4096}
"""optimizer_states with fp32 states, in 4096-element chunks: Adam's math as torch's, the weights stepped in place."""


def _config(stage=2, masters="none", states=False, gas=2):
    xirang = {"grad_release": {"enabled": True, "bucket_size_numel": 20_000, "masters": masters}}
    if states:
        xirang["optimizer_states"] = STATES
    return ds_config(stage=stage, dtype="bf16", micro=2, gas=gas, clip=0.05, scheduler=SCHEDULER, xirang=xirang)


def _train(rank, world, config, steps, skip=0, save_dir=None, load_dir=None, measure=False):
    gas = config["gradient_accumulation_steps"]
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-tiny"]
    model = build_model(spec, seed=0)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    data = engine_runs.data_iter(2, spec.seq, rank, world)
    for _ in range(skip * gas):
        next(data)
    losses, window, widened = [], None, []
    if measure:  # which buckets widen their whole gradient shard to fp32 for the update
        from xirang_ds.plugins.grad_release.bucket import Bucket

        grad32 = Bucket._grad32
        Bucket._grad32 = lambda self: widened.append(self.in_place) or grad32(self)  # the parameters' bytes at their highest over the run, against at rest
        tracker = engine.xirang.track_memory()
        window = tracker.open_window()
        at_rest = tracker.by_category(tracker.live_records())["parameters"]
    for _ in range(steps):
        total = 0.0
        for _ in range(gas):
            x, y = next(data)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    buckets = engine.xirang.plugin("grad_release").buckets
    held = {"masters": [b.master is None for b in buckets], "remainders": [b.remainder is None for b in buckets],
            "kinds": sorted({b.masters for b in buckets}), "ties": [b.ties is None for b in buckets],
            "remainder_bytes": [(b.remainder.numel() * b.remainder.element_size(), b.layout.shard_numel)
                                for b in buckets if b.remainder is not None]}
    params = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    out = {"losses": losses, "params": params, "held": held, "summary": engine.xirang.summary(),
           "in_place": [b.in_place for b in buckets]}
    if window is not None:
        out["parameters"] = (at_rest, window.category_peaks()["parameters"])
        out["widened_in_place"] = any(widened)
        out["widened"] = len(widened)
        Bucket._grad32 = grad32
        out["largest_shard"] = max(b.layout.shard_numel for b in buckets)
        window.close()
    return out


def _scenarios(rank, world, ckpt_dir):
    import os

    out = {"fp32": _train(rank, world, _config(masters="fp32"), STEPS),
           "none": _train(rank, world, _config(), STEPS, measure=True),
           "stage0": _train(rank, world, _config(stage=0), 3)}
    out["first_half"] = _train(rank, world, _config(), STEPS // 2, save_dir=ckpt_dir)
    out["resumed"] = _train(rank, world, _config(), STEPS - STEPS // 2, skip=STEPS // 2, load_dir=ckpt_dir)
    states_dir = os.path.join(ckpt_dir, "in_place")
    out["states_fp32"] = _train(rank, world, _config(masters="fp32", states=True), STEPS)
    out["in_place"] = _train(rank, world, _config(states=True), STEPS, measure=True)
    out["in_place_stage0"] = _train(rank, world, _config(stage=0, states=True), 3)
    # accumulation 1: the gradient shard stays in the communication dtype (bf16) until the update
    out["states_fp32_gas1"] = _train(rank, world, _config(masters="fp32", states=True, gas=1), 3)
    out["in_place_gas1"] = _train(rank, world, _config(states=True, gas=1), 3, measure=True)
    out["in_place_first_half"] = _train(rank, world, _config(states=True), STEPS // 2, save_dir=states_dir)
    out["in_place_resumed"] = _train(rank, world, _config(states=True), STEPS - STEPS // 2, skip=STEPS // 2,
                                     load_dir=states_dir)
    eight_dir = os.path.join(ckpt_dir, "eight")
    out["eight"] = _train(rank, world, _config(masters="remainders_8bit"), STEPS, measure=True)
    out["eight_stage0"] = _train(rank, world, _config(stage=0, masters="remainders_8bit"), 3)
    out["eight_first_half"] = _train(rank, world, _config(masters="remainders_8bit"), STEPS // 2, save_dir=eight_dir)
    out["eight_resumed"] = _train(rank, world, _config(masters="remainders_8bit"), STEPS - STEPS // 2,
                                  skip=STEPS // 2, load_dir=eight_dir)
    out["eight_states"] = _train(rank, world, _config(masters="remainders_8bit", states=True), STEPS)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_scenarios, 2, str(tmp_path_factory.mktemp("no_master_ckpt")))


@pytest.mark.distributed
def test_no_master_is_kept_between_updates(runs):
    for r in runs:
        held = r["none"]["held"]
        assert held["kinds"] == ["none"] and all(held["masters"]) and all(held["remainders"])
        assert "none: bf16 weights rounded stochastically" in r["none"]["summary"]


@pytest.mark.distributed
def test_stochastic_rounding_trains_near_fp32_masters_and_differs_from_them(runs):
    """ZeRO-2, accumulation 2, clipping that bites, WarmupLR: the same first loss, and each later
    loss within 1% of the fp32-master run's; the weights are not the fp32-master run's (the mode is
    on) but within a few bf16 steps of them."""
    for r in runs:
        fp32, none = r["fp32"], r["none"]
        assert none["losses"][0] == fp32["losses"][0]
        for a, b in zip(none["losses"], fp32["losses"]):
            assert abs(a / b - 1) < 0.01, (none["losses"], fp32["losses"])
        assert torch.equal(none["params"], runs[0]["none"]["params"])  # each rank rounded its shard, all-gathered
        diff = (none["params"] - fp32["params"]).abs()
        assert float(diff.max()) > 0
        assert float(diff.max()) < 0.05


@pytest.mark.distributed
def test_stage0_ranks_draw_the_same_noise_and_keep_identical_weights(runs):
    """Stage 0 updates the whole bucket on every rank: the noise is the bucket's and the step's, so
    the ranks' weights stay equal bit for bit."""
    assert torch.equal(runs[0]["stage0"]["params"], runs[1]["stage0"]["params"])
    assert all(runs[0]["stage0"]["held"]["masters"])


@pytest.mark.distributed
def test_a_checkpoint_round_trip_resumes_bit_for_bit(runs):
    """Saved after 3 steps, loaded by a fresh engine: the next 3 steps' losses and the weights equal
    the uninterrupted run's (the noise is seeded by the bucket's step, which the checkpoint keeps)."""
    for r in runs:
        assert_resumed(r["none"], r["resumed"], at=STEPS // 2, first=r["first_half"], params=True)


@pytest.mark.distributed
def test_under_optimizer_states_the_weights_are_stepped_in_place_without_any_fp32_copy(runs):
    """DynamicAdamW widens, steps and rounds back a chunk at a time (``xirang_write_back``): the
    parameters' bytes never rise above their resting bytes, where the update through a transient
    master holds 4 bytes per element of a bucket's shard beside them; the gradient is widened and
    scaled a chunk at a time too (``xirang_grad_scale``), so the gradients' highest falls; training
    near fp32 masters, stage 0's ranks alike, a checkpoint round trip bit for bit."""
    for r in runs:
        assert all(r["in_place"]["in_place"]) and not any(r["none"]["in_place"])
        at_rest, highest = r["in_place"]["parameters"]
        assert highest == at_rest, r["in_place"]["parameters"]
        at_rest, highest = r["none"]["parameters"]
        assert highest - at_rest >= 4 * r["none"]["largest_shard"], r["none"]["parameters"]
        # the gradient shard is never widened whole (the optimizer widens and scales a chunk at a time);
        # at accumulation 1 it reaches the optimizer in bf16 with the 1/world scale and the clip coefficient
        assert r["none"]["widened"] > 0 and not r["in_place"]["widened_in_place"]
        assert not r["in_place_gas1"]["widened_in_place"]
        fp32, mine = r["states_fp32_gas1"], r["in_place_gas1"]
        assert mine["losses"][0] == fp32["losses"][0]
        assert all(abs(a / b - 1) < 0.01 for a, b in zip(mine["losses"], fp32["losses"])), (mine, fp32)
        fp32, mine = r["states_fp32"], r["in_place"]
        assert mine["losses"][0] == fp32["losses"][0]
        for a, b in zip(mine["losses"], fp32["losses"]):
            assert abs(a / b - 1) < 0.01, (mine["losses"], fp32["losses"])
        diff = (mine["params"] - fp32["params"]).abs()
        assert 0 < float(diff.max()) < 0.05
        assert torch.equal(mine["params"], runs[0]["in_place"]["params"])
        assert_resumed(mine, r["in_place_resumed"], at=STEPS // 2, first=r["in_place_first_half"], params=True)
    assert torch.equal(runs[0]["in_place_stage0"]["params"], runs[1]["in_place_stage0"]["params"])


@pytest.mark.distributed
def test_8bit_remainders_hold_one_byte_per_master_element_and_no_tie_bit(runs):
    """Between updates each bucket keeps no master and an int8 remainder of its shard's size, no tie
    bits; the parameters' bytes at rest are exactly the no-master run's plus one byte per element of
    this rank's shards."""
    for r in runs:
        held = r["eight"]["held"]
        assert held["kinds"] == ["remainders_8bit"] and all(held["masters"]) and all(held["ties"])
        assert not any(held["remainders"])
        assert all(nbytes == numel for nbytes, numel in held["remainder_bytes"])
        shard_elements = sum(numel for _, numel in held["remainder_bytes"])
        assert r["eight"]["parameters"][0] == r["none"]["parameters"][0] + shard_elements
        assert "8-bit remainders" in r["eight"]["summary"]


@pytest.mark.distributed
def test_8bit_remainders_train_nearer_fp32_masters_than_no_master(runs):
    """The same first loss as the fp32-master run, every later loss within 0.2% of it, and the
    weights nearer its weights than ``none``'s (mean absolute difference, a third or less)."""
    for r in runs:
        fp32, eight, none = r["fp32"], r["eight"], r["none"]
        assert eight["losses"][0] == fp32["losses"][0]
        for a, b in zip(eight["losses"], fp32["losses"]):
            assert abs(a / b - 1) < 0.002, (eight["losses"], fp32["losses"])
        assert torch.equal(eight["params"], runs[0]["eight"]["params"])
        near = float((eight["params"] - fp32["params"]).abs().mean())
        far = float((none["params"] - fp32["params"]).abs().mean())
        assert 0 < near < far / 3, (near, far)
        states, states_fp32 = r["eight_states"], r["states_fp32"]
        assert states["held"]["kinds"] == ["remainders_8bit"]
        for a, b in zip(states["losses"], states_fp32["losses"]):
            assert abs(a / b - 1) < 0.002, (states["losses"], states_fp32["losses"])
    assert torch.equal(runs[0]["eight_stage0"]["params"], runs[1]["eight_stage0"]["params"])


@pytest.mark.distributed
def test_8bit_remainders_resume_bit_for_bit(runs):
    """The checkpoint keeps the masters rebuilt from the remainders (on the 16-significant-bit grid, so
    a load rounds each to itself) and the buckets' step counts (the noise's seeds)."""
    for r in runs:
        assert_resumed(r["eight"], r["eight_resumed"], at=STEPS // 2, first=r["eight_first_half"], params=True)
