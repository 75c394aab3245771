"""grad_release without engines: shard layout, bucket planning, optimizer rules, ds_config checks, and
the fused step itself against torch.optim.AdamW on one process (gradient accumulation included)."""
import copy
import math

import pytest
import torch

from xirang_ds.config import XirangConfigError, load_config
from xirang_ds.links import LINKS, efficient_numel
from xirang_ds.plugins.grad_release.config import GradReleaseConfig
from xirang_ds.plugins.grad_release.layout import BucketLayout, auto_bucket_numel, plan_buckets
from xirang_ds.plugins.grad_release.optimizers import (
    clone_optimizer,
    is_elementwise,
    optimizer_problems,
    sync_hyperparameters,
)
from xirang_ds.plugins.grad_release.policy import clip_divisor
from xirang_ds.step_counts import count_ops


# layout ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_reduce_scatter_gives_each_rank_its_slice_of_every_parameter(world):
    """Summing every rank's buffer and cutting it in rows equals slicing the summed gradients."""
    numels = [7, 1, 12, 5]
    layout = BucketLayout.build(numels, world)
    grads = [[torch.randn(n) for n in numels] for _ in range(world)]
    buffers = []
    for rank_grads in grads:
        buf = torch.full((layout.numel,), float("nan"))  # garbage: write() must zero the padding
        for i, g in enumerate(rank_grads):
            layout.write(buf, i, g)
        buffers.append(buf)
    summed = torch.stack(buffers).sum(0)
    assert not summed.isnan().any()
    for rank in range(world):
        row = summed.view(world, layout.shard_numel)[rank]
        for piece in layout.pieces(rank):
            truth = sum(g[piece.index] for g in grads).reshape(-1)[piece.start:piece.start + piece.numel]
            torch.testing.assert_close(row[piece.offset:piece.offset + piece.numel], truth)
    out = torch.empty(max(numels))
    for i, n in enumerate(numels):  # all-gather direction: read back every parameter whole
        layout.read(summed, i, out[:n])
        torch.testing.assert_close(out[:n], sum(g[i] for g in grads))
    together = [torch.full((n,), float("nan")) for n in numels]  # every parameter in one multi-tensor copy
    kernels = count_ops(lambda: layout.read_all(summed, together))[1].kernels
    assert kernels == 1 and all(torch.equal(t, sum(g[i] for g in grads)) for i, t in enumerate(together))


def test_layout_pieces_cover_each_parameter_once():
    layout = BucketLayout.build([10, 3, 1], 4)
    for i, n in enumerate(layout.numels):
        covered = sorted((p.start, p.numel) for r in range(4) for p in layout.pieces(r) if p.index == i and p.numel)
        assert sum(c for _, c in covered) == n
        assert [s for s, _ in covered] == sorted({s for s, _ in covered})
    assert layout.padded and not BucketLayout.build([8, 4], 4).padded


def test_plan_buckets_in_order_and_large_parameters_alone():
    assert plan_buckets([4, 4, 4, 20, 1], 8) == [[0, 1], [2], [3], [4]]
    assert plan_buckets([], 8) == []
    with pytest.raises(ValueError, match="bucket_numel must be >= 1"):
        plan_buckets([1], 0)
    assert auto_bucket_numel(10) == 2**16 and auto_bucket_numel(10**12) == 2**25
    assert auto_bucket_numel(16 * 10**6) == 10**6
    # at least the size at which a collective runs at >= 90% of the link's bandwidth, within the cap
    gloo_fp32_two_ranks = efficient_numel(4, 2, *LINKS["gloo"])
    assert gloo_fp32_two_ranks == 450_000
    assert auto_bucket_numel(8_000_000, gloo_fp32_two_ranks) == 500_000  # 1/16 is above it already
    assert auto_bucket_numel(4_000_000, gloo_fp32_two_ranks) == 450_000  # raised from 250,000
    assert auto_bucket_numel(3_323_392, gloo_fp32_two_ranks) == 415_424  # gpt-small: no more than 1/8
    assert auto_bucket_numel(10**9, efficient_numel(2, 8, *LINKS["nccl"])) == 2**25  # 108M elements, capped


# optimizers -----------------------------------------------------------------------------------------
def test_optimizer_rules():
    p = torch.nn.Parameter(torch.zeros(4))
    assert is_elementwise(torch.optim.AdamW([p])) and not is_elementwise(torch.optim.Adafactor([p]))
    lbfgs = optimizer_problems(torch.optim.LBFGS([p]), sharded=False, zero_stage=0)
    assert "LBFGS needs a closure" in lbfgs[0] and "cannot step per parameter" in lbfgs[0]
    ada = optimizer_problems(torch.optim.Adafactor([p]), sharded=True, zero_stage=2)
    assert "Adafactor is not known to update each element independently" in ada[0]
    assert "zero_optimization.stage 2" in ada[0] and "xirang_elementwise = True" in ada[0]
    assert optimizer_problems(torch.optim.Adafactor([p]), sharded=False, zero_stage=0) == []

    class Declared(torch.optim.Adafactor):
        xirang_elementwise = True

    assert optimizer_problems(Declared([p]), sharded=True, zero_stage=1) == []


def test_clone_optimizer_steps_like_the_original_and_follows_the_scheduler():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(6))
    basic = torch.optim.AdamW([a], lr=0.1, weight_decay=0.3, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(basic, lambda s: 0.5 ** s)
    b = a.detach().clone()
    clone = clone_optimizer(basic, [{"params": [b], **{k: v for k, v in basic.param_groups[0].items() if k != "params"}}])
    assert type(clone) is torch.optim.AdamW and clone.param_groups[0]["decoupled_weight_decay"] is True
    for _ in range(3):
        g = torch.randn(6)
        a.grad, b.grad = g.clone(), g.clone()
        sync_hyperparameters(basic.param_groups, clone, [0])
        basic.step()
        clone.step()
        sched.step()
    torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
    assert clone.param_groups[0]["lr"] == 0.1 * 0.25  # the lr of the last step, copied from the basic optimizer


@pytest.mark.parametrize("foreach", [None, False])
def test_bucket_optimizers_step_slices_multi_tensor_with_the_flat_steps_bits(foreach):
    """A bucket steps views of slices where DeepSpeed steps one flat partition: with ``foreach``
    unset the clone takes torch's multi-tensor path (CPU too) and keeps it through the hyperparameter
    sync; the bits equal the single-tensor step of the whole. An explicit choice is kept."""
    torch.manual_seed(0)
    flat = torch.nn.Parameter(torch.randn(40))
    basic = torch.optim.AdamW([flat], lr=0.1, weight_decay=0.3, foreach=foreach)
    master = flat.detach().clone()
    views = [master[0:7], master[7:30], master[30:40]]
    group = {k: v for k, v in basic.param_groups[0].items() if k != "params"}
    clone = clone_optimizer(basic, [{"params": views, **group}])
    for _ in range(3):
        g = torch.randn(40)
        flat.grad = g.clone()
        for v, (start, end) in zip(views, ((0, 7), (7, 30), (30, 40))):
            v.grad = g[start:end].clone()
        sync_hyperparameters(basic.param_groups, clone, [0])
        basic.step()
        clone.step()
    assert clone.param_groups[0]["foreach"] is (True if foreach is None else False)
    assert torch.equal(flat.detach(), master)


def test_clip_divisor_is_deepspeeds_rule():
    assert clip_divisor(0.5, 1.0) == 1.0
    assert clip_divisor(3.0, 1.0) == pytest.approx(3.0 + 1e-6)
    assert clip_divisor(3.0, 0.0) == 1.0


# config ------------------------------------------------------------------------------------------------
def test_schema_keys_and_values():
    cfg = load_config({"xirang": {"grad_release": {"enabled": True, "clipping": "per_layer",
                                                   "exact_method": "two_pass", "bucket_size_numel": 1e6}}})
    assert cfg.grad_release == GradReleaseConfig(enabled=True, clipping="per_layer", exact_method="two_pass",
                                                 bucket_size_numel=10**6)
    with pytest.raises(XirangConfigError) as e:
        load_config({"xirang": {"grad_release": {"clipping": "global", "exact_metod": "hold"}}})
    text = str(e.value)
    assert "xirang.grad_release.clipping" in text and "'global'" in text
    assert "did you mean 'exact_method'" in text


def _setup(ds_config, **keys):
    from xirang_ds.plugins.grad_release.ds_config import read_setup

    return read_setup(ds_config, GradReleaseConfig(enabled=True, **keys))


def test_read_setup_lists_every_key_it_cannot_work_with():
    bad = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
           "fp16": {"enabled": True, "auto_cast": True}, "sparse_gradients": True,
           "managed_gradient_accumulation": False, "data_types": {"grad_accum_dtype": "bf16"}}
    with pytest.raises(XirangConfigError) as e:
        _setup(bad, nonfinite="raise", masters="remainders")
    text = str(e.value)
    assert text.startswith("cannot use this ds_config:")
    for needle in ("zero_optimization.stage = 3", "allowed: stage 0, 1 or 2", "Fix: set zero_optimization.stage to 2",
                   "zero_optimization.offload_optimizer.device = 'cpu'", "fp16.auto_cast = true",
                   "sparse_gradients = true", "managed_gradient_accumulation = false",
                   "data_types.grad_accum_dtype = 'bf16'", "nonfinite = 'raise' cannot run with fp16.enabled",
                   "masters = 'remainders' needs bf16 parameters and this ds_config trains in float16"):
        assert needle in text, needle
    assert len(e.value.problems) == 8


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_no_masters_are_refused_without_bf16_parameters(dtype):
    config = {"fp16": {"enabled": True}} if dtype == "fp16" else {}
    with pytest.raises(XirangConfigError, match="masters = 'none' needs bf16 parameters and this ds_config trains "
                                                 f"in float{16 if dtype == 'fp16' else 32}.*allowed here: \"auto\""):
        _setup(config, masters="none")
    assert _setup({"bf16": {"enabled": True}}, masters="none").param_dtype == torch.bfloat16


def test_read_setup_and_hand_over():
    from xirang_ds.plugins.grad_release.ds_config import hand_over

    user = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5}, "bf16": {"enabled": True},
            "communication_data_type": "fp32", "data_types": {"param_dtype": "bf16"}}
    setup = _setup(user)
    assert (setup.zero_stage, setup.param_dtype, setup.comm_dtype) == (2, torch.bfloat16, torch.float32)
    assert setup.gradient_clipping == 1.0 and not setup.skip_nonfinite  # DeepSpeed's default clipping is 1.0
    copy_ = copy.deepcopy(user)
    hand_over(copy_)
    assert copy_ == {"zero_optimization": {"stage": 0, "reduce_bucket_size": 5}, "gradient_clipping": 0.0}
    assert _setup({"fp16": {"enabled": True}, "gradient_clipping": 0}).skip_nonfinite
    assert _setup({"fp16": {"enabled": True}}).comm_dtype == torch.float16


def test_remainders_rebuild_every_fp32_master_bit_for_bit():
    """Random bit patterns (ties forced on every 7th element), signed zeros, infinities, subnormals and
    the largest finite numbers: the bf16 rounding, the low 16 bits and the tie bits give the master back."""
    from xirang_ds.plugins.grad_release.remainders import join, split, tie_bytes

    g = torch.Generator().manual_seed(0)
    numel = 100_003  # not a multiple of 8: the last tie byte is partial
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (numel,), dtype=torch.int32, generator=g)
    bits[::7] = (bits[::7] & ~0xFFFF) | 0x8000
    master = bits.view(torch.float32).clone()
    master[master.isnan()] = 1.0
    master[:10] = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0, -1.0])
    weight = master.to(torch.bfloat16)
    remainder = torch.empty(numel, dtype=torch.int16)
    ties = torch.empty(tie_bytes(numel), dtype=torch.uint8)
    split(master, weight, remainder, ties)
    rebuilt = torch.empty(numel)
    join(weight, remainder, ties, rebuilt)
    assert torch.equal(rebuilt.view(torch.int32), master.view(torch.int32))
    tied = (master.view(torch.int32) & 0xFFFF) == 0x8000
    assert int(tied.sum()) > numel // 8  # both directions of a tie occur and are told apart
    rebuilt_without_bits = torch.empty(numel)
    join(weight, remainder, torch.zeros_like(ties), rebuilt_without_bits)  # every tie read as rounded up
    wrong = rebuilt_without_bits.view(torch.int32) != master.view(torch.int32)
    assert bool(wrong.any()) and bool((wrong <= tied).all())


def test_stochastic_rounding_lands_on_a_neighbour_with_the_fraction_as_probability():
    """Every result is one of the two bf16 neighbours of the fp32 value, rounded up (away from zero)
    about as often as the fraction of a bf16 step the value is past the lower one, so the mean is the
    value; the same seed gives the same rounding; infinities, NaN, zeros and bf16 values stay."""
    from xirang_ds.plugins.grad_release.stochastic import CHUNK_NUMEL, round_

    g = torch.Generator().manual_seed(0)
    value = torch.randn(64, generator=g) * 10 ** torch.randint(-6, 6, (64,), generator=g)
    samples = CHUNK_NUMEL + 4097  # two chunks, the second partial
    master = value.repeat_interleave(samples // 64 + 1)[:samples]
    out = torch.empty(samples, dtype=torch.bfloat16)
    round_(master.clone(), out, seed=7)
    low = master.view(torch.int32) & -(1 << 16)
    down, up = low.view(torch.float32), (low + (1 << 16)).view(torch.float32)
    assert bool(((out.float() == down) | (out.float() == up)).all())
    fraction = (master.view(torch.int32) & 0xFFFF).double() / 65536
    went_up = (out.float() == up).double()
    per_value = samples // 64
    for i in range(0, samples - per_value, per_value * 8):  # a binomial mean: within 5 sigma
        f, hits = fraction[i:i + per_value].mean(), went_up[i:i + per_value].mean()
        assert abs(float(hits - f)) <= 5 * math.sqrt(float(f * (1 - f)) / per_value) + 1e-12
    again = torch.empty_like(out)
    round_(master.clone(), again, seed=7)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    other = torch.empty_like(out)
    round_(master.clone(), other, seed=8)
    assert not torch.equal(out.view(torch.int16), other.view(torch.int16))
    special = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1.0, -2.5, 2 ** -133])
    special[2:3].view(torch.int32)[0] = 0x7F800001  # a NaN whose payload is in the low half only
    out = torch.empty(special.numel(), dtype=torch.bfloat16)
    round_(special.clone(), out, seed=1)
    assert out[:2].tolist() == [math.inf, -math.inf] and out[2].isnan()
    assert torch.equal(out[3:].view(torch.int16), special[3:].to(torch.bfloat16).view(torch.int16))


def test_stochastic_rounding_carries_updates_that_round_to_nearest_loses():
    """bf16 weights at 1.0 take 4,000 updates of 1e-4 each (1/78 of a bf16 step there): rounded to
    nearest every time they never move; rounded stochastically they track the fp32 sum."""
    from xirang_ds.plugins.grad_release.stochastic import round_

    nearest = torch.ones(10_000, dtype=torch.bfloat16)
    stochastic = nearest.clone()
    for step in range(4000):
        nearest = (nearest.float() + 1e-4).to(torch.bfloat16)
        master = stochastic.float() + 1e-4
        round_(master, stochastic, seed=step)
    assert bool((nearest == 1.0).all())
    assert abs(stochastic.float().mean().item() - 1.4) < 0.01


def test_deepspeed_protocol_still_holds():
    """Fails when a DeepSpeed release moves what grad_release relies on (compat.py)."""
    from xirang_ds.compat.deepspeed import protocol_holds

    assert protocol_holds() == []


# the fused step on one process, against torch.optim.AdamW --------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 3)
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


@pytest.mark.parametrize("gas", [1, 3])
@pytest.mark.parametrize("clip,method", [(0.0, "hold"), (0.05, "hold"), (0.05, "two_pass")])
def test_fused_step_equals_adamw_with_accumulation_and_clipping(gas, clip, method):
    """The pipeline, driven the way engine.backward drives it, gives torch.optim.AdamW's parameters.

    The unused layer gets zero gradients, as DeepSpeed gives parameters without a gradient."""
    from xirang_ds.plugins.grad_release.bucket import Bucket
    from xirang_ds.plugins.grad_release.comm import DataParallelComm
    from xirang_ds.plugins.grad_release.pipeline import Pass, ReleasePipeline
    from xirang_ds.plugins.grad_release.policy import ReleasePolicy

    torch.manual_seed(0)
    ref = _Net()
    ours = copy.deepcopy(ref)

    def groups(model):  # two groups, as trainers make them: no weight decay on biases, another lr
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        return [{"params": decay, "weight_decay": 0.1},
                {"params": [p for p in model.parameters() if all(p is not q for q in decay)],
                 "weight_decay": 0.0, "lr": 0.02}]

    ref_opt = torch.optim.AdamW(groups(ref), lr=0.05)
    basic = torch.optim.AdamW(groups(ours), lr=0.05)
    group_of = {p: gi for gi, g in enumerate(basic.param_groups) for p in g["params"]}
    comm = DataParallelComm(None)
    params = list(reversed(list(ours.parameters())))
    buckets = [Bucket(i, [params[j] for j in idx], [str(j) for j in idx], [group_of[params[j]] for j in idx],
                      BucketLayout.build([params[j].numel() for j in idx], 1), comm, basic, torch.float32)
               for i, idx in enumerate(plan_buckets([p.numel() for p in params], 100))]
    assert len(buckets) > 1
    pipeline = ReleasePipeline(buckets)
    for p in params:
        p.register_post_accumulate_grad_hook(pipeline.on_grad)
    policy = ReleasePolicy(comm, False, clip, "exact", method, False)
    for step in range(4):
        xs = [torch.randn(5, 8) for _ in range(gas)]
        for x in xs:
            (ref(x) / gas).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        for micro, x in enumerate(xs):
            passes = policy.passes(boundary=micro == gas - 1)
            loss = ours(x) / gas
            for n, kind in enumerate(passes):
                pipeline.begin(kind, policy.rule() if kind in (Pass.FUSED, Pass.UPDATE) else None)
                loss.backward(retain_graph=n < len(passes) - 1)
                assert all(p.grad is None for p in ours.parameters())  # released as soon as taken
                sumsq = pipeline.finish()
                if kind in (Pass.HOLD, Pass.NORM):
                    policy.known_norm = math.sqrt(float(sumsq))
                if kind is Pass.HOLD:
                    pipeline.apply_all(policy.rule())
        for a, b in zip(ref.parameters(), ours.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert {g["lr"] for b in buckets for g in b.optimizer.param_groups} == {0.05, 0.02}
    for bucket in buckets:  # every stepped tensor says which parameter it is (whole ones here)
        stepped = [t.xirang_slice_of for g in bucket.optimizer.param_groups for t in g["params"]]
        assert sorted(s.name for s in stepped) == sorted(bucket.names)
        assert all(s.start == 0 and s.numel == math.prod(s.shape) for s in stepped)


def test_window_most_at_once_sees_a_category_at_its_own_maximum():
    """The tracker helper the memory claims use: gradients peak before the window's overall peak."""
    from xirang_ds.memory.tracker import MemoryTracker

    tracker = MemoryTracker("cpu")
    with tracker:
        window = tracker.open_window()
        with tracker.scope("gradients"):
            a = torch.empty(100)  # 400 B
            b = torch.empty(50)  # 200 B
        del a
        with tracker.scope("gradients"):
            c = torch.empty(10)  # 40 B
        big = torch.empty(1000)  # 4000 B of temporaries: the peak, with 240 B of gradients
        del b, c, big
    assert window.most_at_once()["gradients"] == 600
    assert window.report().by_category["gradients"] == 240
    assert window.most_at_once()["temporaries"] == 4000


def test_measurement_configs_are_valid():
    """The ds_configs docs/grad_release.md measures with: blocks valid, grad_release accepts them."""
    import glob
    import json
    import os

    from xirang_ds.plugins.grad_release.ds_config import read_setup

    files = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "grad_release", "*.json")))
    assert len(files) >= 10
    for path in files:
        with open(path, encoding="utf-8") as f:
            ds_config = json.load(f)
        if "xirang" not in ds_config:
            assert path.endswith("_plain_default_buckets.json"), path  # baselines only
            continue
        block = load_config(ds_config).grad_release
        assert block.enabled, path
        read_setup(ds_config, block)


def test_a_parameter_alone_in_its_bucket_is_reduced_from_its_own_gradient():
    """No copy of the gradient where it already has the communication buffer's layout: one parameter, no
    padding, the communication dtype; otherwise the gradient is copied into a buffer of its own."""
    from xirang_ds.plugins.grad_release.bucket import Bucket
    from xirang_ds.plugins.grad_release.comm import DataParallelComm

    comm = DataParallelComm(None)
    params = [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(5))]
    basic = torch.optim.AdamW(params, lr=0.1)

    def target_of(indices: list[int], world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        bucket = Bucket(0, [params[i] for i in indices], [str(i) for i in indices], [0] * len(indices),
                        BucketLayout.build([params[i].numel() for i in indices], world), comm, basic, dtype)
        bucket.begin_backward()
        grad = torch.randn(params[indices[0]].shape)
        bucket.add(0, grad)
        return grad, bucket.target

    grad, target = target_of([0], 2, torch.float32)  # 24 elements in 2 chunks of 12
    assert target.data_ptr() == grad.data_ptr() and torch.equal(target, grad.view(-1))
    for indices, world, dtype in (([1], 2, torch.float32), ([0, 1], 1, torch.float32), ([0], 1, torch.bfloat16)):
        grad, target = target_of(indices, world, dtype)  # padded; two parameters; another dtype
        assert target.data_ptr() != grad.data_ptr()
        assert torch.equal(target[:grad.numel()], grad.view(-1).to(dtype))
