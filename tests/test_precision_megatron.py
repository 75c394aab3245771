"""Megatron-core's ColumnParallelLinear/RowParallelLinear under the precision lists: tensor parallel 2
over gloo, forward and backward on CPU, the dtypes their matmuls run in, gradients against fp32."""
import pytest

from xirang_ds.launch import run_ranks

pytest.importorskip("megatron.core")


def _tp2(rank, world):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from torch.utils._python_dispatch import TorchDispatchMode

    from xirang_ds.config.schema import PrecisionConfig
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
