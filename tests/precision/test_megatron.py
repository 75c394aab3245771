"""The precision plugin under Megatron-core: GPTModel (local spec) at tensor-parallel size 2 over gloo,
fp32 weights and Megatron's FP32Optimizer, bf16 per op with on-demand weight copies, 5 steps.

* Every loss within 1e-4 relative of plain fp32 Megatron (the DeepSpeed tests' on-demand bound is
  1e-3), the same on both TP ranks; the parameters stay fp32 (the masters are the weights).
* Megatron's tensor-parallel linears (and the output layer) run whole in bf16; activation bytes per
  rank drop (the tracker's activations role at the step peak).
* Removal restores every forward; fp16 and ``persistent`` are refused by name under Megatron.
* Megatron's ColumnParallelLinear/RowParallelLinear alone (TP=2, no model around them): their matmuls
  run in bf16 forward and backward, gradients within bf16 rounding of fp32, an fp32 module stays fp32.
"""
from __future__ import annotations

import os
from typing import Any

import pytest

from tests.harness.checks import megatron_built_and_removed, replaced_methods
from tests.harness.megatron_runs import example, write_block
from xirang_ds.launch import run_ranks

pytest.importorskip("megatron.core")


STEPS = 5


def tp2_precision(rank: int, world: int, tmp: str, steps: int) -> dict:
    """TP=2 on 2 ranks: plain fp32 Megatron, then xirang.precision (bf16, on-demand weight copies);
    removal; the settings refused under Megatron."""
    from xirang_ds.integration import megatron as xm

    ex = example()
    created = ex.setup(rank, world, 2)

    def rules(model: Any, optimizer: Any, session: Any) -> dict:
        plugin = session.plugin("precision")
        return {"megatron_layers": list(plugin.rules.megatron_layers), "dtype": str(plugin.plan.dtype),
                "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}

    try:
        common = ["--steps", str(steps), "--overlap-grad-reduce"]
        out = {"plain": ex.train(ex.parse_args(common))}
        config = write_block(os.path.join(tmp, f"precision{rank}.json"), {"precision": {"enabled": True}})
        out["bf16"] = ex.train(ex.parse_args(common + ["--xirang-config", config]), rules)
        out["removal"] = megatron_built_and_removed(ex, ["--xirang-config", config], lambda model, *_: replaced_methods(
            model, ("forward", "compute_language_model_loss")))
        refused = {}
        for key, value in (("dtype", "fp16"), ("weight_copies", "persistent")):
            try:
                xm.build_session({"xirang": {"precision": {"enabled": True, key: value}}})
                refused[key] = ""
            except Exception as e:  # XirangConfigError
                refused[key] = str(e)
        out["refused"] = refused
        return out
    finally:
        ex.teardown(created)


def _tp2(rank, world):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from torch.utils._python_dispatch import TorchDispatchMode

    from xirang_ds.plugins.precision.config import PrecisionConfig
    from xirang_ds.plugins.precision.runtime import apply_precision

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    config = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True,
                                 gradient_accumulation_fusion=False)
    torch.manual_seed(0)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            init = torch.nn.init.xavier_normal_
            self.fc1 = ColumnParallelLinear(64, 256, config=config, init_method=init, bias=True, gather_output=False)
            self.fc2 = RowParallelLinear(256, 64, config=config, init_method=init, bias=True, input_is_parallel=True,
                                         skip_bias_add=False)

        def forward(self, x):
            h, _ = self.fc1(x)
            y, _ = self.fc2(torch.nn.functional.gelu(h))
            return y

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "addmm", "bmm"):
                self.dtypes.add(tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    model = MLP()
    x = torch.randn(8, 4, 64)

    def step(label):
        for p in model.parameters():
            p.grad = None
        seen = Matmuls()
        with seen:
            y = model(x)
            y.float().pow(2).mean().backward()
        return y.detach(), [p.grad.clone() for p in model.parameters()], seen.dtypes

    y32, g32, _ = step("fp32")
    out = {}
    for name, section in (("lists", PrecisionConfig()), ("fc2_fp32", PrecisionConfig(fp32_modules=("fc2",)))):
        handle = apply_precision(model, section)
        try:
            y, grads, dtypes = step(name)
        finally:
            handle.remove()
        out[name] = {"rules": handle.runtime.rules.megatron_layers, "out": str(y.dtype), "matmuls": sorted(dtypes),
                     "grad_dtypes": sorted({str(g.dtype) for g in grads}),
                     "grad_err": max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, g32)),
                     "out_err": float((y.float() - y32).abs().max() / y32.abs().max())}
    out["restored"] = all("forward" not in vars(m) for m in model.modules())
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return out


@pytest.mark.distributed
def test_megatron_parallel_linears_tp2():
    for out in run_ranks(_tp2, 2):
        lists = out["lists"]
        assert lists["rules"] == ("fc1", "fc2")
        assert lists["out"] == "torch.bfloat16"
        assert lists["matmuls"] == [("torch.bfloat16", "torch.bfloat16")]  # forward and backward, both layers
        assert lists["grad_dtypes"] == ["torch.float32"]
        assert lists["grad_err"] < 2e-2 and lists["out_err"] < 2e-2
        fc2_fp32 = out["fc2_fp32"]
        assert fc2_fp32["out"] == "torch.float32"
        assert fc2_fp32["matmuls"] == [("torch.bfloat16", "torch.bfloat16"), ("torch.float32", "torch.float32")]
        assert fc2_fp32["grad_err"] < 2e-2
        assert out["restored"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(tp2_precision, 2, str(tmp_path_factory.mktemp("precision")), STEPS)


@pytest.mark.distributed
def test_bf16_trains_like_fp32_megatron(runs):
    for r in runs:
        for ours, plain in zip(r["bf16"]["losses"], r["plain"]["losses"]):
            assert abs(ours - plain) / plain < 1e-4
        assert r["bf16"]["losses"] != r["plain"]["losses"]  # it did compute in bf16
        assert r["bf16"]["dtype"] == "torch.bfloat16" and r["bf16"]["param_dtypes"] == ["torch.float32"]
    assert runs[0]["bf16"]["losses"] == runs[1]["bf16"]["losses"]


@pytest.mark.distributed
def test_parallel_linears_run_in_bf16_and_activation_bytes_drop(runs):
    for r in runs:
        layers = r["bf16"]["megatron_layers"]
        assert "output_layer" in layers and "decoder.layers.1.mlp.linear_fc2" in layers and len(layers) == 9
        ours, plain = r["bf16"]["memory"]["peak_by_category"], r["plain"]["memory"]["peak_by_category"]
        assert ours["activations"] < 0.85 * plain["activations"]
        assert ours["parameters"] == plain["parameters"]  # no persistent 16-bit copy
        assert r["bf16"]["memory"]["peak_bytes"] < r["plain"]["memory"]["peak_bytes"]


@pytest.mark.distributed
def test_remove_restores_forwards_and_refused_settings_name_key_value_and_fix(runs):
    for r in runs:
        assert "module.output_layer" in r["removal"]["before"] and r["removal"]["after"] == []
        assert ("xirang.precision.dtype: 'fp16' is not available under Megatron-core (allowed there: 'bf16', "
                "'auto')") in r["refused"]["dtype"]
        assert "use bf16, or Megatron's own --fp16 with xirang.precision disabled" in r["refused"]["dtype"]
        assert ("xirang.precision.weight_copies: 'persistent' is not available under Megatron-core (allowed there: "
                "'on_demand', 'auto')") in r["refused"]["weight_copies"]
