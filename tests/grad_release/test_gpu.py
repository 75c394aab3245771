"""grad_release on CUDA (skipped without one; `tools/gpu_check/run.sh` runs them on a lent GPU): the host
stash against keeping the shards on the device, and bf16 remainders against fp32 masters."""
import pytest
import torch

from xirang_ds.launch import run_ranks

pytestmark = pytest.mark.gpu


def _grad_release(rank, world, method, masters="auto", states="auto", ahead="auto", clip=0.05):
    import xirang_ds
    from tests.harness.engine_runs import data_iter, ds_config
    from xirang_ds.bench import optimizer_step
    from xirang_ds.models import BUILTIN_SPECS, build_model

    cfg = ds_config(stage=2, dtype="bf16", micro=4, clip=clip,
                    xirang={"grad_release": {"enabled": True, "bucket_size_numel": 20000, "exact_method": method,
                                             "masters": masters, "states": states, "prefetch_states": ahead}})
    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = data_iter(4, 64, rank, world)
    losses = [optimizer_step(engine, data) for _ in range(3)]
    plugin = engine.xirang.plugin("grad_release")
    pinned = [b._host.is_pinned() for b in plugin.buckets if b._host is not None]
    params = torch.cat([p.detach().float().reshape(-1).cpu() for p in engine.module.parameters()])
    streams = sorted({type(b.copies.stream).__name__ if b.copies is not None else "none" for b in plugin.buckets})
    stash = sorted({type(b.stash_copies.stream).__name__ if b.stash_copies is not None else "none"
                    for b in plugin.buckets})
    return {"losses": losses, "params": params, "pinned": pinned, "streams": streams, "stash_streams": stash,
            "grad_ahead": [b.grad_fetched_ahead for b in plugin.buckets]}


def test_states_fetched_ahead_on_a_side_stream_train_as_on_the_device():
    """``prefetch_states`` on CUDA (its default there): each bucket's states copied in on a side stream while the
    bucket before it updates and back after its own update, the allocator told of both streams; no clipping, so
    each bucket updates in backward as it is reduced. Bit for bit the run with the states on the device."""
    ahead, = run_ranks(_grad_release, 1, "hold", "auto", "host", "auto", 0.0)
    device, = run_ranks(_grad_release, 1, "hold", "auto", "device", "auto", 0.0)
    assert ahead["streams"] == ["Stream"] and device["streams"] == ["none"]
    assert ahead["losses"] == device["losses"]
    assert torch.equal(ahead["params"], device["params"])


def test_grad_release_host_stash_equals_hold_on_cuda():
    """Exact clipping's stash on CUDA: each reduced shard copied to pinned host memory on a side stream in
    backward, and back on it while the bucket before it updates (every update's but each step's first)."""
    host, = run_ranks(_grad_release, 1, "host")
    hold, = run_ranks(_grad_release, 1, "hold")
    assert host["pinned"] and all(host["pinned"]) and not hold["pinned"]
    assert host["stash_streams"] == ["Stream"] and hold["stash_streams"] == ["none"]
    assert sum(host["grad_ahead"]) == 3 * (len(host["grad_ahead"]) - 1) and host["grad_ahead"][0] == 0
    assert host["losses"] == hold["losses"]
    assert torch.equal(host["params"], hold["params"])


def test_remainders_rebuild_every_master_on_cuda():
    """CUDA's bf16 rounding and int64 products: the masters come back bit for bit, ties included."""
    from xirang_ds.plugins.grad_release.remainders import join, split, tie_bytes

    numel = (1 << 20) + 3
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (numel,), dtype=torch.int32, device="cuda")
    bits[::7] = (bits[::7] & ~0xFFFF) | 0x8000
    master = bits.view(torch.float32).clone()
    master[master.isnan()] = 1.0
    weight = master.to(torch.bfloat16)
    remainder = torch.empty(numel, dtype=torch.int16, device="cuda")
    ties = torch.empty(tie_bytes(numel), dtype=torch.uint8, device="cuda")
    split(master, weight, remainder, ties)
    rebuilt = torch.empty_like(master)
    join(weight, remainder, ties, rebuilt)
    assert torch.equal(rebuilt.view(torch.int32), master.view(torch.int32))


def test_grad_release_remainders_equal_fp32_masters_on_cuda():
    remainders, = run_ranks(_grad_release, 1, "host", "remainders")
    fp32, = run_ranks(_grad_release, 1, "host", "fp32")
    assert remainders["losses"] == fp32["losses"]
    assert torch.equal(remainders["params"], fp32["params"])
