"""Small tensors with fp32 states stepped together (`plugins/optimizer_states/together.py`): torch's
AdamW bit for bit, a constant number of ops whatever the number of tensors, the other tensors' updates
and noise unchanged, batches within the eager chunk."""
import pytest
import torch

from tests.optimizer_states.test_units import one_thread  # noqa: F401  (autouse: one thread per test)
from xirang_ds.plugins.optimizer_states import DynamicAdamW
from xirang_ds.plugins.optimizer_states import optimizer as optimizer_module
from xirang_ds.plugins.optimizer_states.together import batches
from xirang_ds.step_counts import count_ops


def _params(count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16 + 7 * i, generator=gen)) for i in range(count)]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2


@pytest.mark.parametrize("torch_cls,adam_w_mode,maximize", [(torch.optim.AdamW, True, False),
                                                             (torch.optim.Adam, False, True)])
def test_small_fp32_tensors_step_together_as_torch_adam_steps_them_bit_for_bit(torch_cls, adam_w_mode, maximize):
    ours, ref = _params(12), _params(12)
    opt = DynamicAdamW(ours, lr=3e-3, weight_decay=0.1, adam_w_mode=adam_w_mode, maximize=maximize,
                       states={"schedule": [{"dtype": "int8"}], "min_numel": 4096})  # all below: pinned fp32
    torch_opt = torch_cls(ref, lr=3e-3, weight_decay=0.1, maximize=maximize, foreach=False)
    _assert_five_steps_equal(opt, ours, torch_opt, ref)


def _assert_five_steps_equal(opt, ours, torch_opt, ref):
    """Five steps of both on the same gradients: parameters, moments and step counters equal bit for bit."""
    for step in range(5):
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        torch_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    for a, b in zip(ours, ref):
        ours_state, ref_state = opt.state[a], torch_opt.state[b]
        assert torch.equal(ours_state["exp_avg"].view_as(a), ref_state["exp_avg"])
        assert torch.equal(ours_state["exp_avg_sq"].view_as(a), ref_state["exp_avg_sq"])
        assert float(ours_state["step"]) == float(ref_state["step"]) == 5.0


def test_the_ops_of_a_step_do_not_grow_with_the_number_of_small_tensors():
    def ops(count):
        params = _params(count)
        opt = DynamicAdamW(params, lr=1e-3, states={"schedule": [{"dtype": "int8"}], "min_numel": 4096})
        _grads(params, 0)
        opt.step()  # the first update makes each tensor's states, one by one
        return count_ops(opt.step)[1].optimizer_kernels

    assert ops(4) == ops(40) <= 12


def test_the_other_tensors_update_and_draw_as_before(monkeypatch):
    """Quantized tensors rounded stochastically between small fp32 ones: their noise is drawn at the offsets
    the tensor-by-tensor loop gives them, so every value equals that loop's."""
    def run(together):
        if not together:
            monkeypatch.setattr(optimizer_module, "steps_together", lambda opt, p, group: False)
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (64, 5000, 32, 9000, 48)]
        opt = DynamicAdamW(params, lr=1e-3, states={"schedule": [{"dtype": "int8"}], "min_numel": 4096,
                                                    "stochastic_rounding": True})
        for step in range(4):
            _grads(params, step)
            opt.step()
        monkeypatch.undo()
        return params, [opt.state[p] for p in params]

    (ours, our_states), (loop, loop_states) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(ours, loop))
    for a, b in zip(our_states, loop_states):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def test_batches_keep_order_and_stay_within_the_chunk():
    params = [torch.zeros(n) for n in (3, 4, 2, 5, 1)]
    runs = list(batches(params, 6))
    assert [[p.numel() for p in run] for run in runs] == [[3], [4, 2], [5, 1]]
    assert [p for run in runs for p in run] == params


def _sized(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


@pytest.mark.parametrize("torch_cls,adam_w_mode,maximize", [(torch.optim.AdamW, True, False),
                                                             (torch.optim.Adam, False, True)])
def test_with_the_fused_update_on_fp32_states_step_as_torch_fused_adam_bit_for_bit(torch_cls, adam_w_mode, maximize):
    """Small tensors (together) and ones above the chunk (one by one) alike: torch's fused kernel, one op each."""
    sizes = (16, 9000, 40, 20000)
    ours, ref = _sized(sizes), _sized(sizes)
    opt = DynamicAdamW(ours, lr=3e-3, weight_decay=0.1, adam_w_mode=adam_w_mode, maximize=maximize,
                       states={"schedule": [{"dtype": "fp32"}], "min_numel": 4096, "chunk_numel": 4096, "fused": True})
    torch_opt = torch_cls(ref, lr=3e-3, weight_decay=0.1, maximize=maximize, fused=True)
    _assert_five_steps_equal(opt, ours, torch_opt, ref)
    assert opt.fused.adam_calls == 4 + 4 * 3  # the first step makes the states one by one; then the two
    # large tensors, and the small ones (kept fp32 below ``min_numel``) together
    assert "fused fp32 Adam call" in opt.fused.describe()


def test_with_the_fused_update_on_the_fp32_step_does_not_grow_with_the_tensor():
    def ops(scale):
        params = _sized((9000 * scale, 20000 * scale, 16))
        opt = DynamicAdamW(params, lr=1e-3, states={"schedule": [{"dtype": "fp32"}], "min_numel": 0,
                                                    "chunk_numel": 4096, "fused": True})
        _grads(params, 0)
        opt.step()
        return count_ops(opt.step)[1].optimizer_kernels

    assert ops(1) == ops(13) <= 8  # three fused calls, the step counters, the step values made once


def test_without_bias_correction_fp32_states_stay_on_the_eager_path():
    """torch's fused kernel always corrects the bias: DeepSpeed's ``bias_correction: false`` runs eagerly."""
    params = _sized((9000, 16))
    opt = DynamicAdamW(params, lr=1e-3, bias_correction=False,
                       states={"schedule": [{"dtype": "fp32"}], "min_numel": 0, "chunk_numel": 4096, "fused": True})
    _grads(params, 0)
    opt.step()
    assert opt.fused.adam_calls == 0 and all(torch.isfinite(p).all() for p in params)
