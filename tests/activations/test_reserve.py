"""Lossy options' lossless reserves (issue 57 item 3): the planner gives every lossy choice the cheapest
lossless option that holds no more bytes at any point of the step (and offers no lossy option without
one); a tensor that breaks its bound (inf/NaN) is stored by the reserve, never left unencoded; on real
DeepSpeed engines (2 gloo ranks) a module whose activations hold an inf switches to its reserve, stays
within the planned peak and trains exactly as the run that used the reserve from the start; the
reserves travel in the checkpoint (and old checkpoints without them still load)."""
import random

import pytest
import torch

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.bench import optimizer_step
from xirang_ds.launch import run_ranks
from xirang_ds.plugins.activations.codecs import BoundExceeded
from xirang_ds.plugins.activations.handlers import CodecHandler, OffloadHandler
from xirang_ds.plugins.activations.offload import Offloader
from xirang_ds.plugins.activations.planner import (
    Choice,
    Node,
    estimate_peak,
    format_plan,
    least_budget,
    option_costs,
    plan,
)
from xirang_ds.plugins.activations.profile import ModuleProfile
from xirang_ds.plugins.activations.reserve import Reserve
from xirang_ds.plugins.activations import saved
from xirang_ds.plugins.activations.saved import Eligibility, PackContext
from xirang_ds.plugins.activations.storage import PayloadStorage
from xirang_ds.plugins.activations.trace_plan import TracePlan

LOSSY = ("quantize", "sparsify")
ALL = ("keep", "recompute", "selective_recompute", "recompute_offload", "compress", "offload", "quantize", "sparsify")


def _profile(rng: random.Random, name: str = "m") -> ModuleProfile:
    saved = rng.randint(4, 64) * 4096
    return ModuleProfile(name, calls=1, saved_bytes=saved, largest_bytes=saved // rng.randint(1, 4),
                         small_bytes=rng.randint(0, 2048), input_bytes=rng.randint(1, saved // 4096) * 1024,
                         time_s=rng.uniform(1e-5, 1e-2), selective_bytes=saved // 2,
                         selective_time_s=rng.uniform(1e-5, 1e-3), compress_bytes=saved, compress_time_s=1e-4,
                         quantize_bytes=saved // 2 + 64, quantize_time_s=rng.uniform(1e-6, 1e-3),
                         sparsify_bytes=saved, sparsify_time_s=1e-4)


def test_every_lossy_choice_carries_the_cheapest_lossless_reserve_that_holds_its_bytes():
    rng = random.Random(0)
    for _ in range(200):
        p = _profile(rng)
        streams = rng.random() < 0.5
        options = tuple(o for o in ALL if rng.random() < 0.6) or ("quantize",)
        choices = option_costs(p, options, True, rng.uniform(1e8, 1e11), streams)
        lossless = [c for c in choices if c.option not in LOSSY]
        for c in choices:
            if c.option not in LOSSY:
                assert c.reserve is None
                continue
            r = c.reserve
            assert r is not None and r.option not in LOSSY and r in lossless  # from the same priced options
            assert r.device_bytes <= c.device_bytes
            assert r.device_bytes + r.transient_bytes <= c.device_bytes + c.transient_bytes
            fitting = [x for x in lossless if x.device_bytes <= c.device_bytes
                       and x.device_bytes + x.transient_bytes <= c.device_bytes + c.transient_bytes]
            assert r.added_s == min(x.added_s for x in fitting)
        # a lossy option no lossless one can stand in for is not offered at all
        offered = {c.option for c in choices}
        for kind in LOSSY:
            if kind in options and kind not in offered:
                alone = option_costs(p, (kind,), True, 1e10, streams, reserves_from=options)
                assert alone[0].reserve is None  # fixed by hand it stays, without a reserve


def test_a_lossy_plan_holds_its_peaks_whichever_modules_take_their_reserves():
    rng = random.Random(1)
    for _ in range(20):
        profiles = [_profile(rng, f"b{i}") for i in range(4)]
        roots = [Node(p.name, option_costs(p, ALL, True, 1e10, False), p.keep_bytes, order=i)
                 for i, p in enumerate(profiles)]
        keep_all = sum(r.keep_bytes for r in roots)
        least = least_budget(roots, 0, 0)
        chosen = plan(roots, int(least + (keep_all - least) * rng.uniform(0.0, 0.5)), 0, 0)
        lossy = [n for n, c in chosen.items() if c.option in LOSSY]
        peaks = estimate_peak(roots, chosen, 0, 0)
        for n in lossy:
            switched = {**chosen, n: chosen[n].reserve}
            assert all(a <= b for a, b in zip(estimate_peak(roots, switched, 0, 0), peaks))
        every = {n: c.reserve or c for n, c in chosen.items()}
        assert all(a <= b for a, b in zip(estimate_peak(roots, every, 0, 0), peaks))
    # the printout names each reserve
    p = _profile(random.Random(2), "blocks.0.mlp")
    q = next(c for c in option_costs(p, ("keep", "offload", "quantize"), True, 1e10, False) if c.option == "quantize")
    text = format_plan({"blocks.0.mlp": q}, {"blocks.0.mlp": p}, 10**6, 0)
    assert f"quantize, reserve {q.reserve.option}" in text and "with every reserve taken" in text
    # the estimate's plan carries them
    est = TracePlan(plan={"blocks.0.mlp": "quantize"}, choices={"blocks.0.mlp": q}).as_dict()
    assert est["reserves"] == {"blocks.0.mlp": q.reserve.option} and est["reserve_added_s"] == q.reserve.added_s


def test_choice_state_round_trip_and_old_checkpoints():
    q = Choice("quantize", 100, 1e-3, 50, 0, Choice("offload", 10, 2e-3, 50))
    assert Choice.from_state(q.state()) == q
    assert Choice.from_state(q.state()[:5]) == Choice("quantize", 100, 1e-3, 50)  # before reserves: none


def _pack_unpack(x: torch.Tensor, reserve):
    """Save ``x`` (and a second tensor after it) under quantize with ``reserve``; the gradient and what was held."""
    offload = OffloadHandler(Offloader(torch.device("cpu")))
    codec = CodecHandler("quantize", PayloadStorage())
    ctx = PackContext(codec, Eligibility("cpu", 1024), reserve and reserve(offload))
    a = x.clone().requires_grad_(True)
    with ctx:
        y = a.clamp(min=-30.0)  # saves its input, inf and all; its output is finite
        z = (y * y).sum()  # saves y twice (one storage)
        held = list(ctx._seen.values())
    z.backward()
    return a.grad, held, ctx.reserve


def test_a_tensor_that_breaks_its_bound_goes_to_the_reserve_and_so_does_the_rest_of_the_call():
    x = torch.randn(4096)
    x[7] = -float("inf")
    plain = x.clone().requires_grad_(True)
    (plain.clamp(min=-30.0) ** 2).sum().backward()
    grad, held, r = _pack_unpack(x, lambda off: Reserve("m", Choice("offload", 0, 1e-3, 0), off))
    assert torch.equal(grad, plain.grad)  # bit-exact: stored losslessly, not quantized
    assert r.taken and r.reason == 0 and r.stored_bytes == 2 * x.numel() * 4  # both storages, the finite one too
    assert len(held) == 2 and all(isinstance(h.handler, OffloadHandler) for h in held)
    # without a reserve it stays as it is (a module fixed by hand with none that fits)
    grad, held, _ = _pack_unpack(x, None)
    assert held[0] is saved._KEEP  # kept as it is, unencoded (the finite one after it quantized)
    with pytest.raises(BoundExceeded):
        CodecHandler("sparsify", PayloadStorage()).store(x, None)


# ------------------------------------------------------------------------------------------------
# real engines


def _inject_inf(model, module: str = "blocks.0.mlp.fc_in"):
    """Every call of ``module`` (inside the tolerant MLP) takes its input through ``clamp``, which saves that
    input with -inf in a few places: a saved tensor no 8-bit scale can hold; the output stays finite."""
    def pre(mod, args):
        x = args[0]
        offset = torch.zeros_like(x)
        offset.view(-1)[::97] = -float("inf")
        return ((x + offset).clamp(min=-30.0),)

    return dict(model.named_modules())[module].register_forward_pre_hook(pre)


def _run(rank, world, block, steps, inject=True, save_dir=None, load_dir=None, skip=0, old_state=False):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    net = build_model(BUILTIN_SPECS["gpt-tiny"])
    if inject:
        _inject_inf(net)
    config = ds_config(stage=2, gas=2, xirang=block)
    engine, *_ = xirang_ds.initialize(model=net, model_parameters=net.parameters(), config=config)
    session = engine.xirang
    tracker = session.track_memory()
    window = tracker.open_window()
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    plugin = session.plugin("activations")
    loaded = {n: c.reserve.option for n, c in plugin.choices.items() if c.reserve is not None}
    data = data_iter(engine.train_micro_batch_size_per_gpu(), 64, rank, world)
    for _ in range(skip):
        next(data)
    losses, plans = [], []
    for _ in range(steps):
        losses.append(optimizer_step(engine, data))
        plans.append(dict(plugin.plan))
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    out = {"losses": losses, "plans": plans, "params": [p.detach().float().clone() for p in engine.module.parameters()],
           "reserves": {n: c.reserve.option for n, c in plugin.choices.items() if c.reserve is not None},
           "taken": dict(plugin.reserves_taken), "planned": max(plugin.planned_peaks),
           "activations_peak": window.category_peaks()["activations"], "loaded": loaded, "text": plugin.plan_text,
           "events": [e for e in session.events if e["kind"] == "activations_reserve"]}
    if old_state:  # a checkpoint from before reserves: the choices as five fields
        state = plugin.state_dict()
        state["choices"] = {n: c[:5] for n, c in state["choices"].items()}
        plugin.load_state_dict(state)
        out["old_restored"] = {n: c.reserve.option for n, c in plugin.choices.items() if c.reserve is not None}
    window.close()
    session.remove()
    return out


def _block(fixed: dict) -> dict:
    return {"activations": {"enabled": True, "budget_fraction": 1.0, "profile_steps": 1, "tolerant": ["blocks.*.mlp"],
                            "options": ["keep", "recompute", "offload"], **fixed}}


def _engines(rank, world, tmp):
    lossy = _block({"quantize": ["blocks.*.mlp"]})
    switched = _run(rank, world, lossy, 3, save_dir=tmp)
    reserve = switched["reserves"].get("blocks.1.mlp")  # still lossy: its data are finite
    from_start = _run(rank, world, _block({reserve: ["blocks.0.mlp"], "quantize": ["blocks.1.mlp"]}), 3)
    resumed = _run(rank, world, lossy, 1, load_dir=tmp, skip=6, old_state=True)
    one_rank = _run(rank, world, lossy, 2, inject=rank == 0)  # the bound breaks on rank 0 only
    return {"switched": switched, "from_start": from_start, "resumed": resumed, "one_rank": one_rank}


@pytest.mark.distributed
def test_an_inf_in_a_tolerant_module_switches_it_to_its_reserve_within_the_plan(tmp_path):
    for out in run_ranks(_engines, 2, str(tmp_path), threads=1):
        s, f, r = out["switched"], out["from_start"], out["resumed"]
        reserve = s["plans"][-1]["blocks.0.mlp"]
        assert s["taken"] == {"blocks.0.mlp": "non-finite values"}
        assert s["events"] == [{"kind": "activations_reserve", "module": "blocks.0.mlp", "option": reserve,
                                "lossy": "quantize", "reason": "non-finite values"}]  # once, though every step has it
        assert reserve in ("keep", "recompute", "offload") and s["plans"][-1]["blocks.1.mlp"] == "quantize"
        assert "reserve" in s["text"]  # the plan's printout names the reserves
        # it trained exactly as the run where that module used its reserve from the start
        assert s["losses"] == f["losses"] and all(torch.equal(a, b) for a, b in zip(s["params"], f["params"]))
        # within the planned peak (as the lossless plans' test measures it)
        assert s["activations_peak"] <= s["planned"] + 8192, (s["activations_peak"], s["planned"])
        assert s["activations_peak"] <= f["activations_peak"] + 8192  # no more than with the reserve from the start
        # the checkpoint carries the switch and the remaining reserves; one without them still loads
        assert r["plans"][0]["blocks.0.mlp"] == reserve and r["loaded"] == s["reserves"]
        assert r["old_restored"] == s["reserves"]
        # where one rank alone met the inf, every rank switched together at the next forward (one plan)
        o = out["one_rank"]
        assert o["plans"][0]["blocks.0.mlp"] == "quantize" and o["plans"][1]["blocks.0.mlp"] == reserve
        assert o["taken"] == s["taken"]
