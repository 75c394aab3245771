"""The fused update (`plugins/optimizer_states/fused.py`) on the CPU, where Inductor emits C++: the
same training as the eager path within a stated tolerance, one to three kernels per chunk, a constant number
of other ops per tensor, and the eager fallbacks."""
import pytest
import torch

from tests.optimizer_states.test_units import one_thread  # noqa: F401  (autouse: one thread per test)
from xirang_ds.compat.torch import TorchDispatchMode
from xirang_ds.plugins.optimizer_states import DynamicAdamW
from xirang_ds.plugins.optimizer_states import fused as fused_module
from xirang_ds.plugins.grad_release.stochastic import noise_keys
from xirang_ds.plugins.optimizer_states.formats import Draws, draw_chunk, make_format
from xirang_ds.plugins.optimizer_states.fused import FusedStep, FusedUnavailable, chunk_step, hyper_tensor
from xirang_ds.plugins.optimizer_states.update import AdamHyper

CHUNK = 4096
SHAPES = [(40, 410), (96, 256)]
"""Four full chunks and a last one of 16 elements, and six full chunks."""


def _train(dtype, fused, steps=6, adam_w_mode=True, maximize=False, shapes=SHAPES, device="cpu", stochastic=False):
    """The same parameters and gradients on any device (drawn on the CPU, then moved)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(device)) for s in shapes]
    opt = DynamicAdamW(params, lr=1e-3, weight_decay=0.1, adam_w_mode=adam_w_mode, maximize=maximize,
                       states={"schedule": [{"dtype": dtype}], "min_numel": 0, "chunk_numel": CHUNK, "fused": fused,
                               "stochastic_rounding": stochastic})
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:  # a few large entries among small ones, as in trained layers
            p.grad = (torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen).pow(8) * 1e-2).to(device)
        opt.step()
    return params, opt


def _distance(a, b):
    return torch.sqrt(sum((x - y).double().square().sum() for x, y in zip(a, b))).item()


@pytest.mark.parametrize("dtype", ["int8", "int4", "bf16"])
def test_fused_trains_like_the_eager_path_within_a_small_fraction_of_the_formats_own_error(dtype):
    eager, eager_opt = _train(dtype, False)
    fused, opt = _train(dtype, True)
    fp32, _ = _train("fp32", False)
    assert opt.fused.chunks == 6 * 10 and eager_opt.fused.chunks == 0  # the short last chunk runs eagerly
    # Not bit-identical (ATen's CPU lerp uses a fused multiply-add, Inductor's does not), so a value on
    # a rounding boundary may take the neighbouring code: measured 0.1-0.5% of the format's own error
    assert _distance(fused, eager) <= 0.02 * _distance(eager, fp32)
    _assert_few_codes_moved(dtype, fused, opt, eager, eager_opt)


def _assert_few_codes_moved(dtype, params, opt, ref_params, ref_opt):
    """Every moment decodes to the reference's but at a few elements (<= 1%): the scales may differ in
    their last bit; beyond that, a value on a rounding boundary takes the neighbouring code."""
    fmt = make_format(dtype)
    for p, q in zip(params, ref_params):
        for moment in ("exp_avg", "exp_avg_sq"):
            keys = fmt.keys(moment)
            a = fmt.decode(moment, {k: opt.state[p][k] for k in keys}, 0, p.numel())
            b = fmt.decode(moment, {k: ref_opt.state[q][k] for k in keys}, 0, q.numel())
            moved = (a - b).abs() > 1e-5 * b.abs() + 1e-30
            assert moved.float().mean() <= 0.01, (dtype, moment, moved.float().mean())


def test_adam_and_maximize_share_the_graph_through_neutral_values():
    for kwargs in ({"adam_w_mode": False}, {"maximize": True}):
        eager, _ = _train("int8", False, steps=3, **kwargs)
        fused, opt = _train("int8", True, steps=3, **kwargs)
        fp32, _ = _train("fp32", False, steps=3, **kwargs)
        assert opt.fused.chunks == 3 * 10
        assert _distance(fused, eager) <= 0.02 * _distance(eager, fp32), kwargs


WHOLE_SHAPES = [(40, 410), (4096 + 2 * 256 + 40,), (70,)]
"""A last chunk of 16 elements, one of two whole int8 blocks and 40 elements, and a tensor shorter than a chunk."""


@pytest.mark.parametrize("dtype", ["int8", "int4", "bf16"])
def test_off_the_cpu_a_tensor_is_one_compiled_call_whatever_its_size(dtype, monkeypatch):
    # as on a GPU (whole_tensor is false on the CPU only, where chunks are faster): one call per tensor,
    # the last block padded in the graph; the same count at 13 times the elements; training as the eager path's
    monkeypatch.setattr(fused_module, "whole_tensor", lambda device_type: True)
    eager, _ = _train(dtype, False, steps=4, shapes=WHOLE_SHAPES)
    fused, opt = _train(dtype, True, steps=4, shapes=WHOLE_SHAPES)
    fp32, _ = _train("fp32", False, steps=4, shapes=WHOLE_SHAPES)
    assert (opt.fused.chunks, opt.fused.wholes) == (4 * 3, 4 * 3) and not opt.fused.chunked
    assert "3 of them whole tensors" in _train(dtype, True, steps=1, shapes=WHOLE_SHAPES)[1].fused.describe()
    assert _distance(fused, eager) <= 0.02 * _distance(eager, fp32)
    assert _optimizer_kernels(dtype, 1) == _optimizer_kernels(dtype, 13)


def _optimizer_kernels(dtype, scale):
    """`count_ops`'s optimizer kernels of one step (after the first) over three tensors of ``scale``
    times WHOLE_SHAPES' elements."""
    from xirang_ds.step_counts import count_ops

    params, opt = _train(dtype, True, steps=1, shapes=[(scale * s[0],) + s[1:] for s in WHOLE_SHAPES])
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    return count_ops(opt.step)[1].optimizer_kernels


def _train_no_master(fused, steps=4, shapes=WHOLE_SHAPES, scale=1, master=False, device="cpu", dtype="int8"):
    """bf16 weights updated as grad_release's ``masters: none`` in place has them (`masters.MasterSlices`):
    each chunk's fp32 result rounded stochastically into the weight (``xirang_write_back`` eagerly, in the
    kernel where fused, both with ``xirang_weight_noise``'s seed), gradients scaled by ``xirang_grad_scale``,
    the states (``dtype``) encoded with stochastic rounding; ``master``: an fp32 master instead (the reference)."""
    from xirang_ds.plugins.grad_release.masters import MasterSlices
    from xirang_ds.plugins.grad_release.stochastic import noise_seed

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn((scale * s[0],) + s[1:]).to(device, torch.float32 if master else torch.bfloat16))
              for s in shapes]
    done = [0]
    for i, p in enumerate(params):
        if not master:
            p.xirang_weight_noise = (lambda i=i: (noise_seed(i, done[0], 0), 128 * i))
            p.xirang_write_back = MasterSlices._stochastic_write_back(p)
        p.xirang_grad_scale = (torch.tensor(0.5, device=device), 0.25) if not master else ()
    opt = DynamicAdamW(params, lr=1e-3, weight_decay=0.1, states={
        "schedule": [{"dtype": dtype}], "min_numel": 0, "chunk_numel": CHUNK, "fused": fused,
        "stochastic_rounding": True})
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen).pow(8) * 1e-2
            p.grad = (g if master else g / 0.125).to(device, p.dtype)
        opt.step()
        done[0] += 1
    return params, opt


@pytest.mark.parametrize("dtype", ["int8", "fp32"])
def test_a_no_master_bf16_update_with_stochastic_states_is_one_compiled_call_per_tensor(dtype, monkeypatch):
    """``masters: none`` with stochastic rounding of the states and of the weight (issue 58): off the CPU
    one call per tensor covers decode, Adam, encode and the rounding into the bf16 weight, the same kernel
    count at 13 times the elements; the same noise as the eager path, so the weights are the eager
    path's but where Adam's own arithmetic differs (`test_fused_trains_like_the_eager_path...`). fp32
    states too (the norms and biases kept in fp32 under ``masters: none``), which no path keeps equal to
    ``torch.optim.AdamW`` under a rounded weight."""
    monkeypatch.setattr(fused_module, "whole_tensor", lambda device_type: True)
    eager, _ = _train_no_master(False, dtype=dtype)
    fused, opt = _train_no_master(True, dtype=dtype)
    reference, _ = _train_no_master(False, master=True, dtype=dtype)
    assert (opt.fused.chunks, opt.fused.wholes) == (4 * 3, 4 * 3) and all(p.dtype == torch.bfloat16 for p in fused)
    same = sum(int((a.view(torch.int16) == b.view(torch.int16)).sum()) for a, b in zip(fused, eager))
    assert same >= 0.99 * sum(p.numel() for p in eager)
    assert _distance(fused, eager) <= 0.05 * _distance(eager, reference)

    def kernels(scale):
        from xirang_ds.step_counts import count_ops

        params, opt = _train_no_master(True, steps=1, scale=scale, dtype=dtype)
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        return count_ops(opt.step)[1].optimizer_kernels

    assert kernels(1) == kernels(13)
    if dtype == "fp32":  # the eager update took about fifteen ops a tensor
        assert opt.state[fused[0]]["exp_avg"].dtype == torch.float32 and kernels(1) <= 6 * len(WHOLE_SHAPES)


def test_stochastic_rounding_steps_run_the_static_chunks_with_the_eager_paths_draws():
    eager, eager_opt = _train("int8", False, steps=3, stochastic=True)
    fused, opt = _train("int8", True, steps=3, stochastic=True)
    fp32, _ = _train("fp32", False, steps=3)
    assert opt.fused.chunks == 3 * 10 and opt.fused.draw_calls == 3 * 10  # each chunk's draws in a call of their own
    assert _distance(fused, eager) <= 0.02 * _distance(eager, fp32)
    _assert_few_codes_moved("int8", fused, opt, eager, eager_opt)


@pytest.mark.parametrize("dtype", ["int8", "int4", "bf16"])
def test_a_chunks_draws_made_apart_update_bit_for_bit_as_the_hash_inside_the_kernel(dtype):
    fmt = make_format(dtype)
    out = []
    keys, offset = noise_keys(7), torch.tensor(3 * CHUNK)
    drawn = draw_chunk(keys, offset, CHUNK, fmt.draw_bits)
    for apart in (None, drawn, torch.zeros_like(drawn)):  # zeros: the kernel reads what it is given
        torch.manual_seed(0)
        p, g = torch.randn(CHUNK), torch.randn(CHUNK)
        bufs = {k: v for m in ("exp_avg", "exp_avg_sq") for k, v in fmt.zeros(m, CHUNK, p.device).items()}
        scalars = hyper_tensor(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True), 1, p.device)
        draws = Draws(keys, offset, apart)
        kernel = torch.compile(fused_module._variant(chunk_step, f"test_{apart is None}"), dynamic=False, fullgraph=True)
        for _ in range(2):
            kernel(fmt, p, g, fmt.window("exp_avg", bufs, 0, CHUNK), fmt.window("exp_avg_sq", bufs, 0, CHUNK),
                   scalars, draws)
        out.append((p, bufs))
    (p, bufs), (q, apart_bufs), (_, zero_bufs) = out
    assert torch.equal(p, q) and all(torch.equal(bufs[k], apart_bufs[k]) for k in bufs), dtype
    assert not all(torch.equal(bufs[k], zero_bufs[k]) for k in bufs), dtype


def test_a_whole_tensor_kernel_that_fails_to_compile_leaves_that_format_in_chunks(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no dynamic shapes here")

    monkeypatch.setattr(fused_module, "whole_tensor", lambda device_type: True)
    monkeypatch.setattr(fused_module, "_WHOLE_KERNEL", broken)
    eager, _ = _train("int8", False, steps=2)
    fused, opt = _train("int8", True, steps=2)  # true: the static chunks must compile; a whole tensor may not
    assert opt.fused.chunks == 2 * 10 and opt.fused.wholes == 0
    assert "no dynamic shapes here" in opt.fused.chunked[("cpu", "int8")] and "chunks on cpu" in opt.fused.describe()
    assert _distance(fused, eager) <= 0.02 * _distance(eager, _train("fp32", False, steps=2)[0])


class _CountOps(TorchDispatchMode):
    """ATen ops that launch work (views only make metadata)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def _ops_of_one_step(numel, fused, monkeypatch):
    """ATen ops of one int8 step of one tensor, the compiled kernel replaced by a counting stub (a
    dispatch mode other than the step counters would otherwise send the step down the eager path)."""
    calls = []
    monkeypatch.setattr(fused_module, "only_counters_active", lambda: True)
    monkeypatch.setattr(fused_module, "_KERNEL", lambda *args: calls.append(args[1].numel()))
    p = torch.nn.Parameter(torch.zeros(numel))
    opt = DynamicAdamW([p], lr=1e-3, states={"schedule": [{"dtype": "int8"}], "min_numel": 0,
                                             "chunk_numel": CHUNK, "fused": fused})
    opt.fused._compiled.add(("cpu", "int8"))
    p.grad = torch.ones(numel)
    opt.step()  # states created
    calls.clear()
    with _CountOps() as counter:
        opt.step()
    return counter.ops, len(calls)


def test_ops_per_step_are_constant_per_tensor_and_one_kernel_per_chunk(monkeypatch):
    small, small_calls = _ops_of_one_step(2 * CHUNK, True, monkeypatch)
    large, large_calls = _ops_of_one_step(16 * CHUNK, True, monkeypatch)
    assert (small_calls, large_calls) == (2, 16)  # one kernel call per chunk
    assert small == large <= 8  # the step counter, the scalars' tensor: none per chunk
    eager_small, _ = _ops_of_one_step(2 * CHUNK, False, monkeypatch)
    eager_large, _ = _ops_of_one_step(16 * CHUNK, False, monkeypatch)
    assert (eager_large - eager_small) / 14 >= 40  # eager: 44 ops per int8 chunk besides views


def test_inductor_emits_one_kernel_per_bf16_and_int8_chunk_and_three_per_int4_chunk():
    from torch._inductor.utils import run_and_get_code

    for dtype, kernels in (("bf16", 1), ("int8", 1), ("int4", 3)):
        fmt = make_format(dtype)
        p, g = torch.randn(CHUNK), torch.randn(CHUNK)
        bufs = {m: fmt.zeros(m, CHUNK, p.device) for m in ("exp_avg", "exp_avg_sq")}
        scalars = hyper_tensor(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True), 1, p.device)
        kernel = torch.compile(chunk_step, dynamic=False, fullgraph=True)
        _, codes = run_and_get_code(kernel, fmt, p, g, bufs["exp_avg"], bufs["exp_avg_sq"], scalars)
        body = codes[-1].split("def call(", 1)[1].split("return ", 1)[0]
        assert body.count("cpp_fused_") == kernels, (dtype, body)  # int4: two of them unpack the nibbles


def test_eager_under_a_dispatch_mode_and_auto_eager_on_the_cpu():
    eager, _ = _train("int8", False, steps=2)
    with _CountOps():  # what the memory tracker is: Dynamo does not trace under it
        traced, opt = _train("int8", True, steps=2)
    assert opt.fused.chunks == 0 and all(torch.equal(a, b) for a, b in zip(traced, eager))
    auto = FusedStep("auto")
    assert not auto.enabled("cpu") and "CPU" in auto.describe()


def test_the_memory_tracker_steps_aside_for_a_counted_steps_compiled_calls():
    """The bench tracks memory through every step and counts one more (`bench.bench_rank`): tracked alone a
    step is eager (Dynamo does not trace under the tracker's mode); counted, its compiled calls run, the
    tracker lifted for them, and count one kernel each: the counts are those of a run without the tracker."""
    from xirang_ds.memory.tracker import MemoryTracker
    from xirang_ds.step_counts import count_ops

    _, opt = _train("int8", True, steps=1)
    untracked = count_ops(opt.step)[1].optimizer_kernels
    with MemoryTracker("cpu"):
        chunks = opt.fused.chunks
        opt.step()
        assert opt.fused.chunks == chunks  # tracked: eager
        assert count_ops(opt.step)[1].optimizer_kernels == untracked
    assert opt.fused.chunks == chunks + sum(a * b // CHUNK for a, b in SHAPES)  # the counted step's full chunks


def test_unavailable_compile_is_an_error_with_true_and_eager_with_auto(monkeypatch):
    monkeypatch.setattr(fused_module, "compile_unavailable", lambda device: "Triton is not installed")
    with pytest.raises(FusedUnavailable, match=r"optimizer_states.fused: true .*Triton is not installed.*Fix"):
        FusedStep(True).enabled("cuda")
    auto = FusedStep("auto")
    assert not auto.enabled("cuda") and "Triton is not installed" in auto.describe()


def test_a_failed_compile_leaves_auto_on_the_eager_path_and_true_raises(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(fused_module, "_KERNEL", broken)
    monkeypatch.setattr(FusedStep, "enabled", lambda self, device_type: self.setting is not False)
    eager, _ = _train("int8", False, steps=2)
    fallen, opt = _train("int8", "auto", steps=2)
    assert all(torch.equal(a, b) for a, b in zip(fallen, eager))
    assert opt.fused.chunks == 0 and "no compiler" in opt.fused.eager["cpu"]
    with pytest.raises(FusedUnavailable, match="failed to compile the int8 update on cpu: RuntimeError: no compiler"):
        _train("int8", True, steps=1)


def test_a_bad_fused_value_is_a_config_error():
    import xirang_ds

    with pytest.raises(xirang_ds.XirangConfigError, match=r"optimizer_states\.fused"):
        DynamicAdamW([torch.nn.Parameter(torch.zeros(4))], states={"fused": "yes"})


def _engine_runs(rank, world, save_dir):
    import xirang_ds
    from tests.harness.engine_runs import data_iter, ds_config
    from xirang_ds.bench import optimizer_step
    from xirang_ds.models import BUILTIN_SPECS, build_model

    def engine(fused):
        block = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}], "chunk_numel": CHUNK,
                                      "fused": fused}}
        model = build_model(BUILTIN_SPECS["gpt-tiny"])
        return xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                    config=ds_config(stage=2, dtype="bf16", gas=2, xirang=block))[0]

    def steps(e, data, n):
        return [optimizer_step(e, data) for _ in range(n)]

    eager = steps(engine(False), data_iter(4, 64, rank, world), 4)
    full = engine(True)
    fused = steps(full, data_iter(4, 64, rank, world), 4)
    first = engine(True)
    data = data_iter(4, 64, rank, world)
    saved = steps(first, data, 2)
    first.save_checkpoint(save_dir)
    resumed = engine(True)
    resumed.load_checkpoint(save_dir)
    return {"eager": eager, "fused": fused, "saved": saved, "resumed": steps(resumed, data, 2),
            "chunks": full.basic_optimizer.fused.chunks, "summary": full.xirang.plugin("optimizer_states").describe()}


def _rounded_master_runs(rank, world):
    """grad_release's rounded masters under fp32 states, whose update is eager in both runs: only the rounding
    differs, eager chunks against compiled calls (``remainders_8bit``: one per bucket after its update; ``none``,
    in place: one per chunk the eager update writes back). With ``fused`` on, an fp32 master's update would take
    torch's fused Adam kernel (`FusedStep.adam_`), whose bits are ``AdamW(fused=True)``'s, not the eager
    AdamW's on every CPU (they differ on AVX-512 hosts): the compiled run keeps it off, so the weights compare
    the roundings alone."""
    from unittest import mock

    import xirang_ds
    from tests.harness.engine_runs import data_iter, ds_config
    from xirang_ds.bench import optimizer_step
    from xirang_ds.models import BUILTIN_SPECS, build_model
    from xirang_ds.plugins.optimizer_states.fused import FusedStep
    from xirang_ds.step_counts import count_ops

    def run(masters, fused):
        block = {"grad_release": {"enabled": True, "bucket_size_numel": 20_000, "masters": masters},
                 "optimizer_states": {"enabled": True, "schedule": [{"dtype": "fp32"}], "min_numel": 0,
                                      "fused": fused}}
        model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
        engine = xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage=2, dtype="bf16", gas=2, clip=0.05, xirang=block))[0]
        data = data_iter(4, 64, rank, world)
        losses = [optimizer_step(engine, data) for _ in range(2)]
        counter = count_ops(lambda: optimizer_step(engine, data))[1]
        buckets = engine.xirang.plugin("grad_release").buckets
        return {"losses": losses, "kernels": counter.kernels, "buckets": len(buckets),
                "in_place": any(b.in_place for b in buckets),
                "rounds": sum(b.optimizer.fused.rounds for b in buckets if b.optimizer is not None),
                "params": torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])}

    def compiled_rounding_only(masters):
        with mock.patch.object(FusedStep, "adam_", lambda *args, **kwargs: False):  # the eager update, as compared
            return run(masters, True)

    return {masters: (run(masters, False), compiled_rounding_only(masters)) for masters in ("remainders_8bit", "none")}


def _two_rank_scenarios(rank, world, save_dir):
    """Both engine comparisons in one process pair: a process start, and its first compilations, cost more
    than a run."""
    return {"zero2": _engine_runs(rank, world, save_dir), "no_master": _no_master_engine_runs(rank, world),
            "rounded_masters": _rounded_master_runs(rank, world)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from xirang_ds.launch import run_ranks

    return run_ranks(_two_rank_scenarios, 2, str(tmp_path_factory.mktemp("fused")), threads=1)


@pytest.mark.distributed
def test_fused_inside_deepspeed_zero2_with_accumulation_on_2_ranks_and_resume(two_ranks):
    for out in (r["zero2"] for r in two_ranks):
        assert out["chunks"] > 0 and "compiled call(s)" in out["summary"]
        # the compiled kernel ran (``chunks``); whether its rounding differs from eager's in these four
        # losses depends on the CPU's vector kernels (equal on some AMD EPYC hosts), so only closeness is asserted
        assert max(abs(a - b) / abs(b) for a, b in zip(out["fused"], out["eager"])) < 1e-3
        assert out["saved"] + out["resumed"] == out["fused"]  # the checkpoint resumes bit for bit


def _no_master_engine_runs(rank, world):
    import xirang_ds
    from tests.harness.engine_runs import data_iter, ds_config
    from xirang_ds.bench import optimizer_step
    from xirang_ds.models import BUILTIN_SPECS, build_model

    def run(fused):
        block = {"grad_release": {"enabled": True, "bucket_size_numel": 20_000, "masters": "none"},
                 "optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}], "min_numel": 0,
                                      "chunk_numel": CHUNK, "fused": fused, "stochastic_rounding": True}}
        model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
        engine = xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage=2, dtype="bf16", gas=2, clip=0.05, xirang=block))[0]
        data = data_iter(4, 64, rank, world)
        losses = [optimizer_step(engine, data) for _ in range(3)]
        buckets = engine.xirang.plugin("grad_release").buckets
        return {"losses": losses, "in_place": all(b.in_place for b in buckets),
                "chunks": sum(b.optimizer.fused.chunks for b in buckets if b.optimizer is not None),
                "params": torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])}

    return run(False), run(True)


@pytest.mark.distributed
def test_grad_release_no_master_update_is_fused_inside_deepspeed_on_2_ranks(two_ranks):
    """The aggressive preset's update (grad_release ``masters: none`` in place, int8 states rounded
    stochastically; ZeRO-2, accumulation 2, clipping that bites): with ``fused: true`` the compiled
    kernel updates the bf16 weights (``xirang_weight_noise`` and the clip coefficients read from the
    views), drawing the eager path's noise: the losses equal, the weights but a few elements (measured
    0.0007% here, Adam's lerp) bit for bit."""
    for eager, fused in (r["no_master"] for r in two_ranks):
        assert eager["in_place"] and fused["in_place"] and eager["chunks"] == 0 and fused["chunks"] > 0
        assert max(abs(a - b) / abs(b) for a, b in zip(fused["losses"], eager["losses"])) < 1e-3
        assert (fused["params"] == eager["params"]).double().mean().item() > 0.999


@pytest.mark.distributed
def test_grad_release_rounds_its_masters_in_compiled_calls_with_the_eager_bits_on_2_ranks(two_ranks):
    """``remainders_8bit`` (the balanced preset's) and in-place ``none`` under fp32 states (the eager
    update): with ``fused: true`` each bucket's rounding is one compiled call, each written-back chunk's
    one, drawing the eager chunks' noise: the weights bit for bit, fewer kernels a step."""
    for runs in (r["rounded_masters"] for r in two_ranks):
        (eight_eager, eight), (none_eager, none) = runs["remainders_8bit"], runs["none"]
        assert not eight["in_place"] and none["in_place"] and eight_eager["rounds"] == none_eager["rounds"] == 0
        assert eight["rounds"] == 3 * eight["buckets"]  # every bucket, every step (the counted one too)
        assert none["rounds"] >= 3 * none["buckets"]
        for eager, fused in ((eight_eager, eight), (none_eager, none)):
            assert fused["losses"] == eager["losses"] and torch.equal(fused["params"], eager["params"])
            assert fused["kernels"] < eager["kernels"]


def test_remainders_8bit_rounding_is_one_compiled_call_with_the_eager_bits():
    """`remainders.round8_` (``masters: remainders_8bit``) as one compiled call of any length and offset, bit for
    bit the eager chunks, NaN, infinities and the largest finite numbers included."""
    from xirang_ds.plugins.grad_release.remainders import round8_
    from xirang_ds.plugins.grad_release.stochastic import round_
    from xirang_ds.step_counts import count_ops

    step = FusedStep(True)
    for numel in (300_001, 3 * 300_001):
        master = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e-2
        master[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), torch.finfo(torch.float32).max])
        for low_bits, eager_round in ((8, round8_), (16, round_)):
            eager, fused = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16)
            eager_round(master.clone(), eager, 7)
            kernels = count_ops(lambda: step.round_(master.clone(), fused, 7, low_bits=low_bits))[1].kernels
            assert kernels == 3  # the clone, the offset (a fill on the device) and the one compiled call, at any length
            assert torch.equal(fused.view(torch.int16), eager.view(torch.int16)), (numel, low_bits)
    assert step.rounds == 4


def test_zero3_no_master_rounding_is_one_compiled_call_with_the_eager_bits():
    """ZeRO-3's ``masters: none`` (`masters.Parking`): DeepSpeed updates the master, parking rounds it into
    the bf16 partition; with the basic optimizer's `FusedStep` enabled that pass is one compiled call of
    any length, bit for bit the eager `stochastic.round_`."""
    import contextlib

    from xirang_ds.plugins.optimizer_states.masters import Parking
    from xirang_ds.step_counts import count_ops

    def parked(fused, numel):
        master = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-2
        weight = master.to(torch.bfloat16)
        parking = Parking([weight], [master], lambda category: contextlib.nullcontext(), stochastic=True)
        parking.updates = lambda i: 3
        parking.fused = fused
        kernels = count_ops(lambda: parking.park(0))[1].kernels
        return weight, kernels

    step = FusedStep(True)
    eager, eager_kernels = parked(None, 300_001)
    fused, kernels = parked(step, 300_001)
    assert step.rounds == 1 and torch.equal(fused.view(torch.int16), eager.view(torch.int16))
    assert kernels == parked(step, 13 * 300_001)[1] < eager_kernels and step.rounds == 2
    assert "2 compiled rounding pass(es)" in step.describe()


def test_a_rounding_pass_that_fails_to_compile_stays_eager_with_auto_and_raises_with_true(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setitem(fused_module._ROUND_KERNELS, 16, broken)
    monkeypatch.setattr(FusedStep, "enabled", lambda self, device_type: self.setting is not False)
    master, out = torch.randn(64), torch.zeros(64, dtype=torch.bfloat16)
    auto = FusedStep("auto")
    assert not auto.round_(master, out, seed=1) and not auto.round_(master, out, seed=1)
    assert "eager rounding on cpu (round): compiling failed (RuntimeError: no compiler)" in auto.describe()
    assert bool((out == 0).all())  # nothing written: the caller's eager rounding does it
    with pytest.raises(FusedUnavailable, match="failed to compile the stochastic rounding on cpu"):
        FusedStep(True).round_(master, out, seed=1)
