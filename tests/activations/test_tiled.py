"""``recompute_tiled`` and ``recompute_tiled_offload`` (plugins/activations/tiled.py): a token-wise module's
forward and its recomputation run a slice of tokens at a time. One process: the slices against the module
run slice by slice (outputs and input gradients bit for bit, dropout masks included, the generator's later
draws unmoved, each parameter's gradient hook once); real engines over 2 gloo ranks (ZeRO-2 bf16,
accumulation 2): losses against whole recompute within rounding, the recomputation holding one slice,
the planner choosing it where only it fits, and a module not marked token-wise refused."""
import contextlib
import copy

import pytest
import torch

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.bench import optimizer_step
from xirang_ds.launch import run_ranks
from xirang_ds.plugins.activations.tiled import DEFAULT_TILES, MAX_TILES, run_tiled, tile_count, tileable


class _MLP(torch.nn.Module):
    def __init__(self, hidden=32, p=0.1):
        super().__init__()
        self.fc = torch.nn.Linear(hidden, 4 * hidden)
        self.proj = torch.nn.Linear(4 * hidden, hidden)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.proj(torch.nn.functional.gelu(self.fc(x))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_match_the_module_run_slice_by_slice(dtype):
    torch.manual_seed(0)
    tiled, reference = _MLP().to(dtype), None
    reference = copy.deepcopy(tiled)
    fired = []
    for p in tiled.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    x = torch.randn(4, 16, 32, dtype=dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(1)
    y = run_tiled(tiled.forward, a, {}, 4, tiled, contextlib.nullcontext)
    after_tiled = torch.rand(3)
    torch.manual_seed(1)
    z = torch.cat([reference(b[i:i + 1]) for i in range(4)])  # one batch row per slice, in order
    after_reference = torch.rand(3)
    assert torch.equal(y, z) and torch.equal(after_tiled, after_reference)  # the same masks, the same later draws
    assert (y == 0).any()  # dropout did drop
    grad = torch.randn_like(y)
    y.backward(grad)
    z.backward(grad)
    assert torch.equal(a.grad, b.grad)
    # the slices' weight gradients summed in fp32, the reference's by autograd in the parameter's dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for p, q in zip(tiled.parameters(), reference.parameters()):
        assert (p.grad.float() - q.grad.float()).norm() <= tolerance * q.grad.float().norm()
    assert len(fired) == len(list(tiled.parameters()))  # each parameter's hook once, not once per slice


def test_the_slice_count_and_what_can_be_sliced():
    assert tile_count(8 * 1024, 1024) == 8  # a 4x-wide feed-forward block: fc and activation outputs, 8 inputs
    assert tile_count(100, 1024) == 2 and tile_count(10 ** 9, 1) == MAX_TILES and tile_count(5, 0) == DEFAULT_TILES
    x = torch.zeros(2, 3)
    assert tileable((x,), {}) and tileable((x,), {"scale": 2.0})
    assert not tileable((x, x), {}) and not tileable((x,), {"mask": x}) and not tileable((torch.zeros(3),), {})
    # fewer rows than slices along the first dimension: the second is sliced
    m = torch.nn.Linear(3, 3)
    y = run_tiled(m.forward, torch.randn(2, 8, 3, requires_grad=True), {}, 4, m, contextlib.nullcontext)
    assert y.shape == (2, 8, 3)


def _train(rank, world, block, steps=3):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-small"]
    net = build_model(spec, seed=0)
    config = ds_config(stage=2, dtype="bf16", micro=4, gas=2, clip=1.0, xirang={"activations": block})
    try:  # a fixed plan's problems at initialize, the planner's at the first forward after profiling
        engine, *_ = xirang_ds.initialize(model=net, model_parameters=net.parameters(), config=config)
        tracker = engine.xirang.track_memory()
        window = tracker.open_window()
        data = data_iter(4, spec.seq, rank, world)
        losses = [optimizer_step(engine, data) for _ in range(steps)]
    except xirang_ds.XirangConfigError as e:
        return {"error": str(e)}
    plugin = engine.xirang.plugin("activations")
    out = {"losses": losses, "activations_peak": window.category_peaks()["activations"], "plan": dict(plugin.plan),
           "tiles": {n: w.tiles for n, w in plugin.wrappers.items() if w.option and "tiled" in w.option}}
    window.close()
    return out


MLPS = ["blocks.*.mlp"]


def _runs(rank, world):
    fixed = {"enabled": True, "planner": False}
    return {"recompute": _train(rank, world, {**fixed, "recompute": MLPS}),
            "tiled": _train(rank, world, {**fixed, "recompute_tiled": MLPS}),
            "tiled_offload": _train(rank, world, {**fixed, "recompute_tiled_offload": MLPS}),
            "not_token_wise": _train(rank, world, {**fixed, "recompute_tiled": ["blocks.*.attn"]}),
            # the planner with only whole recompute, then with the tiled options too, under a budget below
            # what whole recompute of every feed-forward block needs
            "planned": _train(rank, world, {"enabled": True, "budget_fraction": 0.08, "profile_steps": 1,
                                            "options": ["keep", "recompute_offload", "recompute_tiled_offload"]}),
            "untiled": _train(rank, world, {"enabled": True, "budget_fraction": 0.08, "profile_steps": 1,
                                            "options": ["keep", "recompute_offload"]})}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_runs, 2)


@pytest.mark.distributed
def test_tiled_recompute_trains_as_recompute_to_rounding_holding_one_slice(runs):
    for r in runs:
        whole = r["recompute"]
        for kind in ("tiled", "tiled_offload"):
            tiled = r[kind]
            assert set(tiled["tiles"]) == {f"blocks.{i}.mlp" for i in range(4)}
            assert all(t == DEFAULT_TILES for t in tiled["tiles"].values())  # no profile: the default
            for a, b in zip(tiled["losses"], whole["losses"]):
                assert abs(a - b) <= 2e-3 * abs(b), (kind, tiled["losses"], whole["losses"])
        # the recomputed feed-forward intermediates come back a quarter at a time
        assert r["tiled"]["activations_peak"] < whole["activations_peak"]
        assert r["tiled_offload"]["activations_peak"] < r["tiled"]["activations_peak"]


@pytest.mark.distributed
def test_a_module_not_marked_token_wise_is_refused(runs):
    error = runs[0]["not_token_wise"]["error"]
    assert "xirang.activations.recompute_tiled" in error and "'blocks.0.attn' is not marked token-wise" in error
    assert "xirang.activations.token_wise" in error and "or use recompute" in error


@pytest.mark.distributed
def test_the_planner_slices_where_only_slices_fit(runs):
    for r in runs:
        assert "error" in r["untiled"] and "below the least any plan needs" in r["untiled"]["error"]
        planned = r["planned"]
        assert "recompute_tiled_offload" in planned["plan"].values(), planned["plan"]
        assert all(t >= 2 for t in planned["tiles"].values())  # the profile's count


def test_a_module_returning_more_than_a_tensor_is_named():
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x), None  # Megatron's layers return (output, bias)

    m = Pair()
    with pytest.raises(TypeError, match="leave it out of xirang.activations.token_wise"):
        run_tiled(m.forward, torch.randn(4, 4, requires_grad=True), {}, 2, m, contextlib.nullcontext)
