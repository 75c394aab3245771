"""optimizer_states' ``masters`` on CUDA (skipped without one; `tools/gpu_check/run.sh` runs them on a lent
GPU): ZeRO-3's masters parked as remainders train as fp32 masters do, and the allocator holds less; the
fused low-bit kernel (Triton on CUDA) trains as the eager path does."""
import pytest
import torch

from tests.optimizer_states.test_fused import _assert_few_codes_moved, _distance, _train, _train_no_master
from xirang_ds.launch import run_ranks

pytestmark = pytest.mark.gpu


def _zero3(rank, world, masters):
    import xirang_ds
    from tests.harness.engine_runs import data_iter, ds_config
    from xirang_ds.bench import optimizer_step
    from xirang_ds.models import BUILTIN_SPECS, build_model

    cfg = ds_config(stage=3, dtype="bf16", micro=4, gas=2, clip=0.05, xirang={"optimizer_states": {
        "enabled": True, "schedule": [{"dtype": "int8"}], "masters": masters}})
    model = build_model(BUILTIN_SPECS["gpt-small"], seed=0)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = data_iter(4, 64, rank, world)
    losses = [optimizer_step(engine, data) for _ in range(3)]
    torch.cuda.synchronize()
    plugin = engine.xirang.plugin("optimizer_states")
    return {"losses": losses, "allocated": torch.cuda.memory_allocated(),
            "weights": torch.cat([w.detach().float().cpu() for w in engine.optimizer.fp16_partitioned_groups_flat]),
            "numels": [w.numel() for w in engine.optimizer.fp16_partitioned_groups_flat],
            "held": sum(p.held_bytes() for p in plugin.parked)}


def test_zero3_parked_masters_equal_fp32_masters_on_cuda():
    parked, = run_ranks(_zero3, 1, "auto")
    fp32, = run_ranks(_zero3, 1, "fp32")
    assert parked["losses"] == fp32["losses"]
    assert torch.equal(parked["weights"], fp32["weights"])
    assert parked["held"] == sum(2 * n + -(-n // 8) for n in parked["numels"]) > 0 and fp32["held"] == 0
    saved = 4 * sum(parked["numels"]) - parked["held"]  # between steps: the fp32 masters less their remainders
    assert fp32["allocated"] - parked["allocated"] >= 0.9 * saved


def test_zero3_no_master_on_cuda_holds_nothing_and_trains_near_fp32_masters():
    """``masters: none`` on the device: the weights rounded stochastically on CUDA (its generator), the
    allocator holding the whole fp32 masters less, the losses near fp32 masters' and not equal to them."""
    none, = run_ranks(_zero3, 1, "none")
    fp32, = run_ranks(_zero3, 1, "fp32")
    assert none["held"] == 0 and none["losses"] != fp32["losses"]
    assert max(abs(a / b - 1) for a, b in zip(none["losses"], fp32["losses"])) < 2e-2
    assert fp32["allocated"] - none["allocated"] >= 0.9 * 4 * sum(none["numels"])


@pytest.mark.parametrize("dtype", ["int8", "int4", "bf16"])
def test_fused_kernel_on_cuda_trains_like_the_eager_path(dtype):
    """The compiled update of every full chunk and the dynamic-length tail kernel, on CUDA, against the
    eager path on the same device: within a small fraction of the format's own error (fp32 eager), and
    nearly every moment code equal (the CPU test's bound; Triton's and ATen's roundings may differ)."""
    eager, eager_opt = _train(dtype, False, device="cuda")
    fused, opt = _train(dtype, True, device="cuda")
    fp32, _ = _train("fp32", False, device="cuda")
    assert opt.fused.chunks > 0 and eager_opt.fused.chunks == 0, opt.fused.describe()
    assert _distance(fused, eager) <= 0.02 * _distance(eager, fp32)
    _assert_few_codes_moved(dtype, fused, opt, eager, eager_opt)


def test_no_master_update_on_cuda_is_one_triton_call_per_tensor_with_the_eager_noise():
    """Issue 58: grad_release's no-master bf16 update with stochastic int8 states, one compiled call per
    tensor (decode, Adam, encode, the rounding into the weight), drawing what the eager path draws."""
    eager, _ = _train_no_master(False, device="cuda")
    fused, opt = _train_no_master(True, device="cuda")
    reference, _ = _train_no_master(False, master=True, device="cuda")
    assert opt.fused.wholes == opt.fused.chunks == 4 * 3, opt.fused.describe()
    same = sum(int((a.view(torch.int16) == b.view(torch.int16)).sum()) for a, b in zip(fused, eager))
    assert same >= 0.99 * sum(p.numel() for p in eager)
    assert _distance(fused, eager) <= 0.05 * _distance(eager, reference)


def test_fp32_states_on_cuda_step_as_torch_fused_adamw_bit_for_bit():
    """With the fused update on (``auto`` on CUDA), fp32 states take torch's fused kernel: a tensor above the chunk
    and the small ones together, each one call, equal to ``torch.optim.AdamW(fused=True)``."""
    from xirang_ds.plugins.optimizer_states import DynamicAdamW

    gen = torch.Generator().manual_seed(0)
    sizes = (16, 300_000, 40)
    ours, ref = ([torch.nn.Parameter(t.clone().cuda()) for t in inits]
                 for inits in [[torch.randn(n, generator=gen) for n in sizes]] * 2)
    opt = DynamicAdamW(ours, lr=3e-3, weight_decay=0.1, states={"schedule": [{"dtype": "fp32"}], "min_numel": 4096})
    torch_opt = torch.optim.AdamW(ref, lr=3e-3, weight_decay=0.1, fused=True)
    for step in range(4):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=gen).cuda() * 1e-2
            b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert opt.fused.adam_calls == 3 + 3 * 2, opt.fused.describe()
