"""optimizer_states' ``masters: none``: ZeRO-3 keeps no fp32 master; each sub-group's update starts from
its bf16 weights and is rounded back into them stochastically (the aggressive preset at ZeRO-3). And
``masters: remainders_8bit`` (the balanced preset at ZeRO-3): one byte an element, the master rounded
to 16 significant bits.

Real DeepSpeed ZeRO-3 engines in bf16 on 2 CPU ranks, gradient accumulation 2, clipping that bites,
several sub-groups; the reference is the same run with DeepSpeed's own fp32 masters.
"""
import math
import os

import pytest
import torch

from tests.harness.engine_runs import data_iter
from tests.optimizer_states.test_masters import _config, _engine, _weights
from xirang_ds.bench import optimizer_step
from xirang_ds.launch import run_ranks


def _runs(rank, world, tmp, masters="none"):
    from xirang_ds.memory.categories import PARAMETERS

    out = {}
    ref = _engine(_config("fp32"))
    ref_tracker = ref.xirang.track_memory()
    data = data_iter(4, 64, rank, world)
    out["ref"] = [optimizer_step(ref, data) for _ in range(4)]
    out["ref_params_bytes"] = ref_tracker.by_category(ref_tracker.live_records())[PARAMETERS]
    out["sizes"] = [m.numel() for m in ref.optimizer.fp32_partitioned_groups_flat]

    ours = _engine(_config(masters))
    tracker = ours.xirang.track_memory()
    plugin = ours.xirang.plugin("optimizer_states")
    parked = plugin.parked[0]
    rounded, round_into_weight = [], parked._round_into_weight
    parked._round_into_weight = lambda i, *a: rounded.append((i, parked.updates(i))) or round_into_weight(i, *a)
    data = data_iter(4, 64, rank, world)
    out["ours"] = [optimizer_step(ours, data) for _ in range(2)]
    ours.save_checkpoint(os.path.join(tmp, "none"), tag="s2")
    out["ours"] += [optimizer_step(ours, data) for _ in range(2)]
    out["weights"] = _weights(ours)
    out["rounded"] = list(rounded)
    out["between"] = [m.numel() for m in ours.optimizer.fp32_partitioned_groups_flat]
    out["held"] = parked.held_bytes()
    out["params_bytes"] = tracker.by_category(tracker.live_records())[PARAMETERS]
    out["describe"] = plugin.describe()
    out["saved_masters_are_bf16"] = all(torch.equal(m, m.to(torch.bfloat16).float()) for m in _zero_groups(tmp, rank))
    out["saved_masters_on_16_bits"] = all(bool((m.view(torch.int32) & 0xFF).eq(0).all()) for m in _zero_groups(tmp, rank))

    # a fresh engine resumes the checkpoint on the same draws (the noise follows the step count)
    resumed = _engine(_config(masters))
    resumed.load_checkpoint(os.path.join(tmp, "none"), tag="s2")
    data = data_iter(4, 64, rank, world)
    for _ in range(4):  # the two steps' micro-batches already trained
        next(data)
    out["resumed"] = [optimizer_step(resumed, data) for _ in range(2)]
    out["resumed_weights"] = _weights(resumed)

    # removal: DeepSpeed's masters whole again (the weights widened), and its own step from there
    resumed.xirang.remove()
    out["whole_after_removal"] = [m.numel() for m in resumed.optimizer.fp32_partitioned_groups_flat]
    pairs = list(zip(resumed.optimizer.fp32_partitioned_groups_flat, resumed.optimizer.fp16_partitioned_groups_flat))
    out["masters_after_removal"] = all(torch.equal(m, w.float()) for m, w in pairs)
    # the weight is its master's nearest bf16, ties away from zero
    out["weights_nearest_after_removal"] = all(torch.equal(((m.view(torch.int32) + 0x8000) & -(1 << 16)).view(
        torch.float32), w.float()) for m, w in pairs)
    out["after_removal"] = optimizer_step(resumed, data)
    return out


def _zero_groups(tmp, rank):
    path = os.path.join(tmp, "none", "s2", f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]["fp32_flat_groups"]


@pytest.mark.distributed
def test_zero3_no_master_keeps_nothing_rounds_stochastically_and_resumes(tmp_path):
    runs = run_ranks(_runs, 2, str(tmp_path), threads=1)
    for r in runs:
        sizes = r["sizes"]
        assert len(sizes) >= 3  # several sub-groups
        # nothing is kept of the masters: the parameters are 4 bytes per partition element lighter
        assert r["between"] == [0] * len(sizes) and r["held"] == 0
        assert r["ref_params_bytes"] - r["params_bytes"] == sum(4 * n for n in sizes)
        assert "no masters" in r["describe"]
        # every sub-group's update rounded into its weights stochastically, its draws seeded by the step count
        assert r["rounded"] == [(i, step) for step in range(1, 5) for i in range(len(sizes))]
        # trains as fp32 masters do, not bit for bit (the rounding is stochastic)
        assert r["ours"] != r["ref"]
        assert max(abs(a / b - 1) for a, b in zip(r["ours"], r["ref"])) < 2e-2
        # the checkpoint's masters are the weights widened; a fresh engine resumes on the same draws
        assert r["saved_masters_are_bf16"]
        assert r["resumed"] == r["ours"][2:]
        assert all(torch.equal(a, b) for a, b in zip(r["resumed_weights"], r["weights"]))
        assert r["whole_after_removal"] == sizes and r["masters_after_removal"]
        assert math.isfinite(r["after_removal"])  # DeepSpeed's own step from the widened weights


@pytest.mark.distributed
def test_zero3_8bit_remainders_keep_one_byte_train_near_fp32_masters_and_resume(tmp_path):
    """The parameters are 3 bytes per partition element lighter than with DeepSpeed's fp32 masters (1
    kept of 4), every park rounds into the weights with the step's draws, each loss within 0.2% of
    the fp32-master run's (``none`` is held to 2%), the checkpoint's masters on the 16-bit grid, and
    a fresh engine resumes bit for bit; removal leaves each master whole beside its nearest weight."""
    runs = run_ranks(_runs, 2, str(tmp_path), "remainders_8bit", threads=1)
    for r in runs:
        sizes = r["sizes"]
        assert len(sizes) >= 3
        assert r["between"] == [0] * len(sizes) and r["held"] == sum(sizes)
        assert r["ref_params_bytes"] - r["params_bytes"] == sum(3 * n for n in sizes)
        assert "8-bit remainders" in r["describe"]
        assert r["rounded"] == [(i, step) for step in range(1, 5) for i in range(len(sizes))]
        assert max(abs(a / b - 1) for a, b in zip(r["ours"], r["ref"])) < 2e-3, (r["ours"], r["ref"])
        assert r["saved_masters_on_16_bits"] and not r["saved_masters_are_bf16"]
        assert r["resumed"] == r["ours"][2:]
        assert all(torch.equal(a, b) for a, b in zip(r["resumed_weights"], r["weights"]))
        assert r["whole_after_removal"] == sizes and r["weights_nearest_after_removal"]
        assert math.isfinite(r["after_removal"])


def test_parking_without_a_master_rounds_into_the_weight_unbiased():
    from xirang_ds.plugins.optimizer_states.masters import Parking

    scope = lambda category: torch.no_grad()  # noqa: E731
    weight = torch.full((4096,), 1.0, dtype=torch.bfloat16)
    step = 2.0 ** -7 / 4  # a quarter of a bf16 step at 1.0: round to nearest would drop it
    moved = []
    for update in range(8):
        master = weight.float() + step
        parking = Parking([weight], [master], scope, stochastic=True)
        parking.updates = lambda i, update=update: update
        parking.park(0)
        assert master.numel() == 0 and parking.held_bytes() == 0
        moved.append(((weight.float() - 1.0) / 2.0 ** -7).mean().item())
        assert set(weight.float().unique().tolist()) <= {1.0, 1.0 + 2.0 ** -7}
        parking.unpark(0)
        assert torch.equal(master, weight.float())  # the weight is the master
        weight.fill_(1.0)
    assert abs(sum(moved) / len(moved) - 0.25) < 0.02  # unbiased: a quarter step on average
    assert len(set(moved)) > 1  # the draws follow the update count


@pytest.mark.parametrize("preset,masters", [("aggressive", "none"), ("balanced", "remainders_8bit")])
def test_the_preset_hands_its_masters_over_where_grad_release_is_left_out(preset, masters):
    """aggressive keeps no master and balanced 8-bit remainders through grad_release; where grad_release
    is left out (ZeRO-3) its ``masters`` goes to DeepSpeed's ZeRO-3 masters, where they can take it (bf16),
    unless the user wrote ``optimizer_states.masters``; elsewhere nothing changes and nothing is said.
    Written by the user where it cannot run it is an error
    (`test_masters.test_remainders_elsewhere_is_refused_with_every_problem`)."""
    from tests.harness.engine_runs import ds_config
    from xirang_ds.planning.fit import fit_block

    def fitted(stage, dtype, **block):
        return fit_block({"preset": preset, **block}, ds_config(stage=stage, dtype=dtype))

    at_zero2, at_zero3 = fitted(2, "bf16"), fitted(3, "bf16")
    assert at_zero2.config.grad_release.masters == masters and at_zero2.config.optimizer_states.masters == "auto"
    assert not any(line.startswith("optimizer_states") for line in at_zero2.lines())
    assert not at_zero3.config.grad_release.enabled and at_zero3.config.optimizer_states.masters == masters
    assert fitted(3, "fp16").config.optimizer_states.masters == "auto"  # no bf16 weights to round into
    written = fitted(3, "bf16", optimizer_states={"masters": "remainders"})
    assert written.config.optimizer_states.masters == "remainders"
    import xirang_ds.integration.megatron as xm

    assert xm.validate_for_megatron({"preset": preset}).optimizer_states.masters == "auto"  # Megatron's own
