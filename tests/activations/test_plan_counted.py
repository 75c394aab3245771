"""The planner prices counts, not timings (`xirang_ds.memory.device_profile`): a run whose clock is pure
noise plans exactly as a run with a true clock, and peaks to the byte; the profiles' times are the
device profile's prices of each op's FLOPs and bytes."""
import random
import time

import torch

from tests.activations.test_deepspeed import _train
from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks
from xirang_ds.memory.device_profile import PROFILES, op_counts, profile_for, profile_named


def _twice(rank, world):
    config = ds_config(stage=2, xirang={"activations": {"enabled": True, "budget_fraction": 0.3, "profile_steps": 2}})
    true = _train(rank, world, config, 3, track=True)
    real, rng = time.perf_counter, random.Random(rank)
    time.perf_counter = lambda: real() + rng.uniform(0.0, 0.05)  # a machine busy at random
    try:
        noisy = _train(rank, world, config, 3, track=True)
    finally:
        time.perf_counter = real
    return true, noisy


def test_a_noisy_clock_plans_and_peaks_exactly_as_a_true_one_on_two_ranks():
    for true, noisy in run_ranks(_twice, 2):
        assert set(true["plan"].values()) - {"keep"}  # the budget forced options
        assert noisy["plan"] == true["plan"] and noisy["planned"] == true["planned"]
        assert noisy["profiles"] == true["profiles"]  # every byte and every priced second
        assert noisy["peak_bytes"] == true["peak_bytes"] and noisy["losses"] == true["losses"]


def test_an_op_is_priced_by_its_flops_or_its_bytes_whichever_takes_longer():
    a, b = torch.randn(64, 128), torch.randn(128, 32)
    out = a @ b
    flops, moved, low = op_counts(torch.ops.aten.mm.default, (a, b), {}, out)
    assert (flops, moved, low) == (2 * 64 * 128 * 32, 4 * (64 * 128 + 128 * 32 + 64 * 32), False)
    h100 = PROFILES["h100"]
    assert h100.op_seconds(flops, moved, low) == max(flops / (67e12 * 0.8), moved / (3.35e12 * 0.85)) + 5e-6
    added = torch.ops.aten.add.Tensor
    x = torch.randn(1000)
    assert op_counts(added, (x, x), {}, x + x) == (0, 12_000, False)  # no table entry: its bytes price it


def test_profiles_by_device_name_and_by_hand():
    assert profile_for("cpu")[0] is PROFILES["cpu"]
    assert profile_for("cuda", "NVIDIA H200")[0] is PROFILES["h200"]
    assert profile_for("cuda", "NVIDIA A100-SXM4-80GB")[0] is PROFILES["a100"]
    profile, note = profile_for("cuda", "NVIDIA L4")
    assert profile is PROFILES["h100"] and "no profile for NVIDIA L4" in note
    assert profile_named("H200") is PROFILES["h200"]
    try:
        profile_named("tpu")
    except ValueError as e:
        assert "known: a100, cpu, h100, h200" in str(e)
    else:
        raise AssertionError("an unknown profile name must be refused")
