"""Lossy activations' reserves under Megatron-core (GPTModel, tensor-parallel size 2 over gloo, 2 micro-batches
per step): a tolerant MLP whose saved tensors hold an inf switches to its lossless reserve on both ranks, and
the losses equal those of the run where that MLP used the reserve from the start, and both ranks hold one
plan (they switch together: a recompute reserve would re-issue the layer's collectives). On this model the
reserve is offload: a recompute holds the MLP's whole saved bytes in its backward, more than quantize does."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.harness.megatron_runs import example, write_block
from xirang_ds.launch import run_ranks

pytest.importorskip("megatron.core")

STEPS = 3
TOLERANT = "decoder.layers.*.mlp"


def _inject_inf(model: Any) -> Any:
    """Every call of layer 0's ``linear_fc1`` takes its input through ``clamp``, which saves it with -inf in a few
    places (as `test_reserve._inject_inf` does on gpt-tiny); its output stays finite."""
    fc1 = next(m for n, m in model.named_modules() if n.endswith("decoder.layers.0.mlp.linear_fc1"))

    def pre(mod: Any, args: tuple) -> tuple:
        x = args[0]
        offset = torch.zeros_like(x)
        offset.view(-1)[::97] = -float("inf")
        return ((x + offset).clamp(min=-30.0), *args[1:])

    return fc1.register_forward_pre_hook(pre)


def _train(ex: Any, tmp: str, name: str, rank: int, fixed: dict) -> dict:
    block = {"activations": {"enabled": True, "budget_fraction": 1.0, "profile_steps": 1, "tolerant": [TOLERANT],
                             "options": ["keep", "recompute", "offload", "quantize"], **fixed}}
    opts = ex.parse_args(["--steps", str(STEPS), "--xirang-config",
                          write_block(os.path.join(tmp, f"{name}{rank}.json"), block)])
    model, optimizer, session, make_data = ex.build_loop(opts)
    handle = _inject_inf(model)
    run_step = ex.step_function(opts, model, optimizer, make_data())
    plugin = session.plugin("activations")
    losses, plans = [], []
    for _ in range(STEPS):
        losses.append(run_step())
        plans.append(dict(plugin.plan))
    out = {"losses": losses, "plans": plans, "taken": dict(plugin.reserves_taken),
           "reserves": {n: c.reserve.option for n, c in plugin.choices.items() if c.reserve is not None}}
    handle.remove()
    session.remove()
    return out


def _runs(rank: int, world: int, tmp: str) -> dict:
    ex = example()
    created = ex.setup(rank, world, 2)
    try:
        switched = _train(ex, tmp, "switched", rank, {"quantize": [TOLERANT]})
        reserve = switched["reserves"]["decoder.layers.1.mlp"]  # still lossy: its data are finite
        from_start = _train(ex, tmp, "from_start", rank, {reserve: ["decoder.layers.0.mlp"],
                                                          "quantize": ["decoder.layers.1.mlp"]})
        return {"switched": switched, "from_start": from_start, "reserve": reserve}
    finally:
        ex.teardown(created)


@pytest.mark.distributed
def test_an_inf_switches_a_tensor_parallel_mlp_to_its_reserve_on_both_ranks(tmp_path):
    outs = run_ranks(_runs, 2, str(tmp_path), threads=1)
    for out in outs:
        s, f, reserve = out["switched"], out["from_start"], out["reserve"]
        assert s["taken"] == {"decoder.layers.0.mlp": "non-finite values"}
        last = s["plans"][-1]
        assert last["decoder.layers.0.mlp"] == reserve and last["decoder.layers.1.mlp"] == "quantize"
        assert s["losses"] == f["losses"]
    assert outs[0]["switched"]["plans"] == outs[1]["switched"]["plans"]  # one plan on both ranks
