"""optimizer_states' ``masters`` under Megatron-core: the Float16 optimizer's fp32 masters of bf16
parameters parked as remainders between steps.

``examples/megatron_gpt.py --bf16`` at DP=2 on 2 CPU ranks (Float16Module and Megatron's
``Float16OptimizerWithFloat16Params``), 2 micro-batches per step, int8 states; the reference is the same
run with ``masters: "fp32"`` (Megatron's own masters).
"""
import math
import os
from typing import Any

import pytest
import torch

from tests.harness.checks import megatron_dist_checkpoint_round_trip, megatron_state_dict_round_trip
from tests.harness.megatron_runs import config_error, example, write_block
from xirang_ds.launch import run_ranks

BF16 = ["--tp", "1", "--steps", "4", "--overlap-grad-reduce", "--bf16"]


def _block(tmp: str, rank: int, masters: str) -> list[str]:
    path = write_block(os.path.join(tmp, f"masters_{masters}{rank}.json"), {"optimizer_states": {
        "enabled": True, "schedule": [{"dtype": "int8"}], "masters": masters}})
    return ["--xirang-config", path]


def _inspect(model: Any, optimizer: Any, session: Any) -> dict:
    from xirang_ds.compat.megatron import unwrap

    plugin = session.plugin("optimizer_states")
    return {"weights": [p.detach().clone() for p in unwrap(model).parameters()],
            "held": sum(p.held_bytes() for p in plugin.parked),
            "bf16_numels": [w.numel() for p in plugin.parked for w in p.weights],
            "between": [m.numel() for p in plugin.parked for m in p.masters],
            "line": plugin.masters_line, "describe": plugin.describe()}


def megatron_masters(rank: int, world: int, tmp: str) -> dict:
    ex = example()
    created = ex.setup(rank, world, 1)
    try:
        fp32, auto = _block(tmp, rank, "fp32"), _block(tmp, rank, "auto")
        out = {"fp32": ex.train(ex.parse_args(BF16 + fp32), _inspect),
               "auto": ex.train(ex.parse_args(BF16 + auto), _inspect)}
        out["torch"] = megatron_state_dict_round_trip(ex, BF16 + auto, 2, 2, {"resumed": BF16 + auto,
                                                                            "fp32_masters": BF16 + fp32})
        out["torch_dist"] = megatron_dist_checkpoint_round_trip(
            ex, BF16 + auto, 2, 2, os.path.join(tmp, "dist"), {"resumed": BF16 + auto, "fp32_masters": BF16 + fp32})
        # the distributed optimizer: each rank's ranges of the bf16 parameters and their masters
        dist = BF16 + ["--use-distributed-optimizer"]
        out["dist_fp32"] = ex.train(ex.parse_args(dist + fp32), _inspect)
        out["dist_auto"] = ex.train(ex.parse_args(dist + auto), _inspect)
        out["dist_torch"] = megatron_state_dict_round_trip(
            ex, dist + auto, 2, 2, {"resumed": dist + auto, "fp32_masters": dist + fp32},
            parameter_state=os.path.join(tmp, "param_state.pt"))
        out["dist_torch_dist"] = megatron_dist_checkpoint_round_trip(
            ex, dist + auto, 2, 2, os.path.join(tmp, "dist_ranges"),
            {"resumed": dist + auto, "fp32_masters": dist + fp32}, {"distrib_optim_sharding_type": "dp_reshardable"})
        out["refused"] = config_error(ex, {"optimizer_states": {"enabled": True, "masters": "remainders"}}, tmp)
        out["refused_none"] = config_error(ex, {"optimizer_states": {"enabled": True, "masters": "none"}}, tmp)
        # the aggressive preset keeps no master through grad_release, which it leaves off under Megatron:
        # its masters stay Megatron's, kept as remainders (nothing hands them a no-master mode it refuses)
        aggressive = write_block(os.path.join(tmp, f"aggressive{rank}.json"), {"preset": "aggressive"})
        out["aggressive"] = ex.train(ex.parse_args(BF16 + ["--xirang-config", aggressive]), _inspect)
        return out
    finally:
        ex.teardown(created)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(megatron_masters, 2, str(tmp_path_factory.mktemp("megatron_masters")))


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["", "dist_"])
def test_megatron_masters_parked_between_steps_are_exact(runs, kind):
    """Float16OptimizerWithFloat16Params (``""``) and the distributed optimizer (``"dist_"``)."""
    for r in runs:
        fp32, auto = r[kind + "fp32"], r[kind + "auto"]
        assert auto["losses"] == fp32["losses"]
        assert all(torch.equal(a, b) for a, b in zip(auto["weights"], fp32["weights"]))
        # every bf16 master (of a parameter, or of this rank's range) parked after the last step
        numels = auto["bf16_numels"]
        assert numels and auto["between"] == [0] * len(numels)
        assert auto["held"] == sum(2 * n + -(-n // 8) for n in numels)
        assert "remainders between steps in 1 member(s)" in auto["line"] and "masters as remainders" in auto["describe"]
        assert fp32["held"] == 0 and fp32["line"].startswith("fp32")
        # the peak: the masters' bytes between steps (forward and backward) fall from 4 to 2.125 per element
        assert auto["memory"]["peak_phase"] == fp32["memory"]["peak_phase"] == "forward"
        assert fp32["memory"]["peak_bytes"] - auto["memory"]["peak_bytes"] == 4 * sum(numels) - auto["held"]
        # the step holds what it held (to a 0-dim tensor: which scalars are alive at its peak varies by a few bytes)
        steps = [run["memory"]["phase_peaks"]["optimizer_step"] for run in (auto, fp32)]
        assert abs(steps[0] - steps[1]) <= 16
        # Megatron's checkpoints (torch, with the distributed optimizer's parameter-state file, and torch_dist)
        # resume bit for bit, with parked or fp32 masters
        for fmt in ("torch", "torch_dist"):
            run = r[kind + fmt]
            assert run["resumed"] == run["continued"] == run["fp32_masters"]


@pytest.mark.distributed
def test_megatron_masters_remainders_without_bf16_masters_is_refused(runs):
    for r in runs:
        assert "xirang.optimizer_states.masters" in r["refused"] and "keeps no fp32 masters" in r["refused"]
        # no master is ZeRO-3's: Megatron copies (and gathers) its masters inside its own step
        assert "is 'none' but this is a Megatron-core run" in r["refused_none"] and "Fix:" in r["refused_none"]
        aggressive = r["aggressive"]
        assert all(math.isfinite(loss) for loss in aggressive["losses"]) and len(aggressive["losses"]) == 4
        assert "remainders between steps in 1 member(s)" in aggressive["line"]
        assert "Fix: set masters" in r["refused"]
