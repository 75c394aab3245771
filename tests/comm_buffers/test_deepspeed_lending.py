"""comm_buffers.lend_to_activations: saved activations held in the idle reduction arena.

The safety claim is that no gradient copy ever overwrites a live activation. The runs below turn on
the lender's verification: every payload in lent memory is checksummed when stored and checked when
decoded, and every region a lease gives back is poisoned (0xFF), so a bucket write over a live
payload, or a read of a returned one, fails the run or changes the loss. The negative control shows
the check catches an overwrite when the write guard is switched off.
"""
import functools

import pytest

from tests.harness.checks import assert_resumed, resume_in_fresh_processes
from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.bench import optimizer_step
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.launch import run_ranks


PLAN = {"enabled": True, "planner": False, "compress": ["blocks.*"]}

QUANTIZED = {"enabled": True, "planner": False, "quantize": ["blocks.*"], "tolerant": ["blocks.*"]}


def _block(lend: bool, bucket="auto", plan=None, pool=False) -> dict:
    block = {"comm_buffers": {"enabled": True, "adapt": False, "lend_to_activations": lend,
                              "reduce_bucket_size": bucket},
             "activations": dict(plan or PLAN)}
    if pool:
        block["memory_pool"] = {"enabled": True}
    return block


def _naive_layout(lender):
    """Every request packed from offset 0, ignoring when gradients arrive: bucket writes hit them."""
    def layout():
        lender._planned_size = [r[0] for r in lender._observed]
        plan, cursor = [], 0
        for size in lender._planned_size:
            fits = cursor + size <= lender.bytes.numel()
            plan.append(cursor if fits else None)
            cursor += size if fits else 0
        return plan
    return layout


def _run(rank, world, stage, overlap, lend, gas=2, steps=3, bucket="auto", guard=True, naive=False,
         save_dir=None, load_dir=None, plan=None, pool=False):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-tiny"]
    model = build_model(spec)
    config = ds_config(stage=stage, dtype="bf16", micro=4, gas=gas, xirang=_block(lend, bucket, plan, pool))
    config["zero_optimization"].update(overlap_comm=overlap)
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        config["zero_optimization"].pop(key)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    session = engine.xirang
    lender = session.plugin("comm_buffers").lender
    if lender is not None:
        lender.verify = True
        session.plugin("activations").runtime.storage.verify = True
        if naive:
            lender._layout = _naive_layout(lender)
        if not guard:
            lender.evict = lambda *args, **kwargs: 0
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    data = data_iter(4, spec.seq, rank, world)
    for _ in range(engine.global_steps * gas):
        next(data)
    losses = [optimizer_step(engine, data) for _ in range(steps)]
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    params = [p.detach().float().clone() for p in engine.module.parameters()]
    out = {"losses": losses, "params": params, "summary": session.summary()}
    if session.pool() is not None:
        out["pool"] = session.pool().stats()
    if lender is not None:
        out["stats"] = lender.stats.as_dict()
        out["arena_bytes"] = lender.arena.nbytes
    session.remove()
    return out


def _two_rank_scenarios(rank, world):
    """The runs the comparisons below read, in one process pair (a process start costs more than a run);
    each run removes its session before the next."""
    return {"lent": {(stage, overlap): _run(rank, world, stage, overlap, True) for stage, overlap in LENT},
            "plain": {(stage, overlap): _run(rank, world, stage, overlap, False)
                      for stage, overlap in sorted(set(LENT) | {(2, o) for o in GUARDED})},
            "naive": {overlap: _run(rank, world, 2, overlap, True, naive=True) for overlap in GUARDED},
            "pool": _run(rank, world, 2, True, True, plan=QUANTIZED, pool=True),
            "pool_plain": _run(rank, world, 2, True, False, plan=QUANTIZED)}


LENT = [(1, True), (2, False)]
"""Each stage and each overlap setting once (stage 2 with overlap lends under the guard test too)."""
GUARDED = [False, True]


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_scenarios, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("stage, overlap", LENT)
def test_lent_activations_are_never_overwritten(stage, overlap, two_ranks):
    """2 ranks, 2 micro-batches per step: identical losses and parameters with and without lending,
    every payload verified at decode, bytes lent every step; where the arena is smaller than the
    activations, leases in a bucket's way move to host memory."""
    for o, p in ((r["lent"][stage, overlap], r["plain"][stage, overlap]) for r in two_ranks):
        assert o["losses"] == p["losses"]
        assert all(a.equal(b) for a, b in zip(o["params"], p["params"]))
        st = o["stats"]
        # every step lends; after the observed first pass, the layout needs no eviction
        assert all(s["lent_bytes"] > 0 for s in st["steps"]), st
        assert all(s["evicted_bytes"] == 0 for s in st["steps"][1:]), st
        assert 0 < st["high_water"] <= o["arena_bytes"]
        assert "lent to activations" in o["summary"]


@pytest.mark.distributed
@pytest.mark.parametrize("overlap", GUARDED)
def test_the_guard_evicts_what_a_bad_layout_puts_in_the_way(overlap, two_ranks):
    """A layout that ignores when gradients arrive: the write guard moves the leases in the way to
    host memory and results stay identical."""
    for o, p in ((r["naive"][overlap], r["plain"][2, overlap]) for r in two_ranks):
        assert o["losses"] == p["losses"]
        assert all(a.equal(b) for a, b in zip(o["params"], p["params"]))
        assert sum(s["evicted_bytes"] for s in o["stats"]["steps"][1:]) > 0


@pytest.mark.distributed
def test_the_check_catches_an_overwrite_without_the_guard():
    """Negative control: the bad layout without the write guard lets the bucket overwrite lent
    payloads, and the verification stops the run (so the tests above can fail)."""
    with pytest.raises(Exception, match="changed between store and decode|overwritten"):
        run_ranks(functools.partial(_run, guard=False, naive=True, steps=2), 2, 2, False, True)


@pytest.mark.distributed
def test_lending_beside_the_memory_pool(two_ranks):
    """int8 payloads: the arena lends what fits, the pool serves the rest; results identical to the
    same plan with neither."""
    for o, p in ((r["pool"], r["pool_plain"]) for r in two_ranks):
        assert o["losses"] == p["losses"]
        assert all(a.equal(b) for a, b in zip(o["params"], p["params"]))
        assert all(s["lent_bytes"] > 0 for s in o["stats"]["steps"])
        assert o["pool"]["pooled_allocations"] > 0, o["pool"]


@pytest.mark.distributed
def test_checkpoint_round_trip_with_lending(tmp_path):
    for f, r in resume_in_fresh_processes(_run, 2, str(tmp_path), 2, True, True):  # _run skips what it loaded
        assert_resumed(f, r, at=2, params=True)


def test_lending_needs_the_arena_and_a_packing_option():
    from xirang_ds.config import load_config

    with pytest.raises(XirangConfigError, match="lend_to_activations.*arena is false"):
        load_config({"xirang": {"comm_buffers": {"enabled": True, "arena": False, "lend_to_activations": True},
                                "activations": PLAN}})
    with pytest.raises(XirangConfigError, match="activations plugin, which is off"):
        load_config({"xirang": {"comm_buffers": {"enabled": True, "lend_to_activations": True}}})
    with pytest.raises(XirangConfigError, match="nothing to hold.*compress"):
        load_config({"xirang": {"comm_buffers": {"enabled": True, "lend_to_activations": True},
                                "activations": {"enabled": True, "planner": False, "recompute": ["blocks.*"]}}})
    with pytest.raises(XirangConfigError, match="grad_release is on"):
        load_config({"xirang": {**_block(True), "grad_release": {"enabled": True}}})
    load_config({"xirang": _block(True)})


def _stage(rank, world, stage):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    try:
        xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                             config=ds_config(stage=stage, xirang=_block(True)))
    except XirangConfigError as e:
        return str(e)
    return None


@pytest.mark.distributed
def test_lending_at_zero_0_and_3_is_refused():
    assert "zero_optimization.stage is 0 (no reduction buckets)" in run_ranks(_stage, 1, 0)[0]
    assert "ZeRO 3 keeps its own buckets" in run_ranks(_stage, 1, 3)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_lending_on_cuda(overlap):
    """On CUDA (1 rank): the reduction stream of overlap_comm, device-to-host evictions of a bad
    layout, verified payloads, identical results."""
    for naive in (False, True):
        ours = run_ranks(functools.partial(_run, naive=naive), 1, 2, overlap, True)
        plain = run_ranks(_run, 1, 2, overlap, False)
        assert ours[0]["losses"] == plain[0]["losses"]
        assert all(a.equal(b) for a, b in zip(ours[0]["params"], plain[0]["params"]))
        assert (sum(s["evicted_bytes"] for s in ours[0]["stats"]["steps"][1:]) > 0) == naive
