"""The chunked head's weight gradient handed to grad_release by rows, on real DeepSpeed engines over 2
gloo ranks (ZeRO-2, accumulation 2, exact clipping): the same training as the head's token slices
within rounding, the whole weight gradient never made, and the ways it falls back to the whole
gradient (a head called twice, a tied weight) still training as before."""
import copy

import pytest
import torch

from tests.harness import engine_runs
from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=64,vocab=2048"
"""The head's weight (2048 x 64) is larger than the buckets: alone in its bucket, so taken by rows."""
HEAD_NUMEL = 2048 * 64
CHUNK = {"enabled": True, "planner": False, "chunk": ["*lm_head"], "chunk_tokens": 16}


class ReadsEmbedding(torch.nn.Module):
    """A model that also reads the embedding's weight outside its module (an output bias from it):
    that use's gradient arrives after the embedding's rows, and is added before the update."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return self.inner(x, y) + 1e-3 * self.inner.embed.weight.float().square().sum()


class Twice(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return self.inner(x, y) + 0.5 * self.inner(x, y)


def _config(dtype, rows=True, method="host", stage=2, gas=2):
    release = {"enabled": True, "bucket_size_numel": 20_000, "exact_method": method}
    return ds_config(stage=stage, dtype=dtype, micro=2, gas=gas, clip=0.5,
                     xirang={"grad_release": release, "activations": CHUNK}), rows


def _train(rank, world, setup, steps=3, tie=False, twice=False, reads=False, save_dir=None, load_dir=None, skip=0):
    import xirang_ds
    from xirang_ds.models import build_model, parse_model_spec
    from xirang_ds.plugins.grad_release.rows import RowSink

    config, rows = setup
    spec = parse_model_spec(MODEL)
    model = build_model(spec, seed=0)
    if tie:
        model.lm_head.weight = model.embed.weight
    if twice:  # the head called twice in one forward (a second loss through the same head)
        model = Twice(model)
    if reads:
        model = ReadsEmbedding(model)
    head = model.inner.lm_head if twice or reads else model.lm_head
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    plugin = engine.xirang.plugin("grad_release")
    if not rows:
        plugin.pipeline.by_rows = [False] * len(plugin.buckets)
    from xirang_ds.plugins.grad_release.bucket import Bucket

    closed, late, at_close = [], [], []
    close, add_late = RowSink.close, Bucket.add_late
    tracker = engine.xirang.track_memory()

    def closing(sink):
        closed.append(".".join(sink.bucket.names[0].split(".")[-2:]))
        at_close.append(tracker.by_category(tracker.live_records())["gradients"])
        close(sink)

    RowSink.close = closing
    Bucket.add_late = lambda self, *a: late.append(self.names[0]) or add_late(self, *a)
    window = tracker.open_window()
    data = engine_runs.data_iter(2, spec.seq, rank, world)
    for _ in range(skip * config["gradient_accumulation_steps"]):
        next(data)
    try:
        losses = [engine_runs.optimizer_step(engine, data) for _ in range(steps)]
    finally:
        RowSink.close, Bucket.add_late = close, add_late
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    params = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    gradients = window.category_peaks()["gradients"]
    window.close()
    engine.xirang.remove()
    return {"losses": losses, "params": params, "closed": closed, "gradients": gradients, "late": late,
            "at_close": at_close,
            "by_rows": plugin.pipeline.by_rows[plugin.pipeline.slots[head.weight][0]],
            "attr": hasattr(head.weight, "xirang_rows")}


def _scenarios(rank, world, tmp):
    out = {}
    for dtype in ("fp32", "bf16"):
        out[dtype, "rows"] = _train(rank, world, _config(dtype))
        out[dtype, "tokens"] = _train(rank, world, _config(dtype, rows=False))
    for name, setup in (("stage1", dict(dtype="fp32", stage=1)), ("fp16", dict(dtype="fp16"))):
        out[name] = _train(rank, world, _config(**setup))
        out[name + "_tokens"] = _train(rank, world, _config(rows=False, **setup))
    for method in ("host", "hold"):
        out["gas1", method] = _train(rank, world, _config("bf16", method=method, gas=1))
    out["gas1", "tokens"] = _train(rank, world, _config("bf16", rows=False, gas=1))
    out["two_pass"] = _train(rank, world, _config("fp32", method="two_pass"))
    out["two_pass_tokens"] = _train(rank, world, _config("fp32", rows=False, method="two_pass"))
    out["tied"] = _train(rank, world, _config("fp32"), tie=True)
    out["twice"] = _train(rank, world, _config("fp32"), twice=True)
    out["twice_tokens"] = _train(rank, world, _config("fp32", rows=False), twice=True)
    out["reads"] = _train(rank, world, _config("fp32"), reads=True)
    out["reads_tokens"] = _train(rank, world, _config("fp32", rows=False), reads=True)
    out["saved"] = _train(rank, world, _config("bf16"), steps=2, save_dir=tmp)
    out["resumed"] = _train(rank, world, _config("bf16"), steps=1, load_dir=tmp, skip=2)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_scenarios, 2, str(tmp_path_factory.mktemp("rows")), threads=1)


@pytest.mark.distributed
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_rows_train_as_the_token_slices_within_rounding(runs, dtype, tol):
    """Losses within ``tol``; parameters within a tenth of the learning rate in fp32 (Adam's update of
    an element whose gradient is near zero moves by up to lr on a rounding of that gradient)."""
    ptol = max(tol, 1e-4)
    for out in runs:
        rows, tokens = out[dtype, "rows"], out[dtype, "tokens"]
        # 3 steps x 2 micro-steps: the head's, the position and the token embeddings' gradients by rows
        assert rows["closed"] == ["lm_head.weight", "pos.weight", "embed.weight"] * 6 and tokens["closed"] == []
        torch.testing.assert_close(torch.tensor(rows["losses"]), torch.tensor(tokens["losses"]), rtol=tol, atol=tol)
        torch.testing.assert_close(rows["params"], tokens["params"], rtol=0, atol=ptol)
    assert torch.equal(runs[0][dtype, "rows"]["params"], runs[1][dtype, "rows"]["params"])  # ranks agree


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_whole_weight_gradient_is_never_made(runs, dtype):
    """The token slices make the head's gradient whole before its hook; by rows the device holds this
    rank's shard of it and one round's buffer, so the gradients' highest falls by at least half the
    head's gradient (2 ranks)."""
    itemsize = 4 if dtype == "fp32" else 2
    for out in runs:
        rows, tokens = out[dtype, "rows"], out[dtype, "tokens"]
        assert tokens["gradients"] >= HEAD_NUMEL * itemsize
        assert rows["gradients"] <= tokens["gradients"] - HEAD_NUMEL * itemsize // 2


@pytest.mark.distributed
def test_rounds_go_to_the_host_or_the_accumulator_as_they_come(runs):
    """Under exact clipping's ``host`` at accumulation 1 each reduced round goes to the host buffer as
    it comes, so the device never holds the head's shard: when the head's rows close, ``hold`` has its
    bf16 shard (half the head) live and ``host`` not even that. Both train the same, bit for bit (the
    rounds' norms are summed alike); the accumulator's rounds are the tests above (accumulation 2)."""
    shard = HEAD_NUMEL // 2 * 2
    for out in runs:
        host, hold, tokens = out["gas1", "host"], out["gas1", "hold"], out["gas1", "tokens"]
        assert host["closed"][0] == hold["closed"][0] == "lm_head.weight"
        heads = range(0, len(host["closed"]), 3)
        assert all(hold["at_close"][i] - host["at_close"][i] >= shard for i in heads), (host, hold)
        assert torch.equal(host["params"], hold["params"]) and host["losses"] == hold["losses"]
        torch.testing.assert_close(host["params"], tokens["params"], rtol=0, atol=2e-2)


@pytest.mark.distributed
@pytest.mark.parametrize("name,tol", [("stage1", 1e-4), ("fp16", 4e-3)])
def test_rows_at_zero1_and_under_fp16_loss_scaling(runs, name, tol):
    """ZeRO-1 shards the same way; fp16 scales the loss, so the rows carry the scaled gradient and the
    weights differ from the token path by fp16 rounding (its ulp at 1 is 2**-10)."""
    for out in runs:
        assert out[name]["closed"] == ["lm_head.weight", "pos.weight", "embed.weight"] * 6
        torch.testing.assert_close(out[name]["params"], out[name + "_tokens"]["params"], rtol=0, atol=tol)


@pytest.mark.distributed
def test_two_pass_clipping_takes_the_rows_in_both_passes(runs):
    for out in runs:
        assert len(out["two_pass"]["closed"]) == 3 * 9  # a norm pass and an update pass at each boundary
        torch.testing.assert_close(out["two_pass"]["params"], out["two_pass_tokens"]["params"], rtol=0, atol=1e-4)


@pytest.mark.distributed
def test_a_tied_weight_or_a_head_called_twice_gives_its_gradient_whole(runs):
    for out in runs:
        assert "lm_head.weight" not in out["tied"]["closed"] and not out["tied"]["by_rows"]
        assert all(torch.isfinite(torch.tensor(out["tied"]["losses"])))
        # two uses of every weight in the graph: the rows of one use would not be the gradient
        assert out["twice"]["closed"] == []
        assert torch.equal(out["twice"]["params"], out["twice_tokens"]["params"])


@pytest.mark.distributed
def test_a_weight_also_read_outside_its_module_gets_that_gradient_too(runs):
    for out in runs:
        assert "embed.weight" in out["reads"]["closed"]  # by rows, and the other use's gradient added after
        assert out["reads"]["late"] == ["inner.embed.weight"] * 6 and out["reads_tokens"]["late"] == []
        torch.testing.assert_close(out["reads"]["params"], out["reads_tokens"]["params"], rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor(out["reads"]["losses"]), torch.tensor(out["reads_tokens"]["losses"]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_a_checkpoint_round_trip_resumes_bit_for_bit(runs):
    for out in runs:
        whole = out["bf16", "rows"]
        assert out["saved"]["losses"] + out["resumed"]["losses"] == whole["losses"]
        assert torch.equal(out["resumed"]["params"], whole["params"])
        assert out["resumed"]["closed"] == ["lm_head.weight", "pos.weight", "embed.weight"] * 2


@pytest.mark.distributed
def test_removal_takes_the_attribute_away(runs):
    for out in runs:
        assert out["fp32", "rows"]["by_rows"] and not out["fp32", "rows"]["attr"]
