"""optimizer_states' ``masters``: ZeRO-3's fp32 masters kept as bf16 remainders between updates.

Real DeepSpeed ZeRO-3 engines in bf16 on 2 CPU ranks, gradient accumulation 2, clipping that bites,
several sub-groups; the reference is the same run with ``masters: "fp32"`` (DeepSpeed's own masters).
"""
import os

import pytest
import torch

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.bench import optimizer_step
from xirang_ds.launch import run_ranks

SUB_GROUP = 20_000  # gpt-tiny's partition at 2 ranks is ~68k elements: several sub-groups


def _config(masters: str, schedule: str = "int8") -> dict:
    block = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": schedule}], "masters": masters}}
    cfg = ds_config(stage=3, dtype="bf16", gas=2, clip=0.05, xirang=block)
    cfg["zero_optimization"]["sub_group_size"] = SUB_GROUP
    return cfg


def _engine(config: dict):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _weights(engine) -> list[torch.Tensor]:
    return [w.detach().clone() for w in engine.optimizer.fp16_partitioned_groups_flat]


def _zero_file(folder: str, tag: str, rank: int) -> dict:
    path = os.path.join(folder, tag, f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]


def _runs(rank, world, tmp):
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    from xirang_ds.memory.categories import PARAMETERS

    out = {}
    # fp32 masters (DeepSpeed's own): the reference, saved at step 2
    ref = _engine(_config("fp32"))
    ref_tracker = ref.xirang.track_memory()
    data = data_iter(4, 64, rank, world)
    out["ref"] = [optimizer_step(ref, data) for _ in range(2)]
    ref.save_checkpoint(os.path.join(tmp, "fp32"), tag="s2")
    out["ref"] += [optimizer_step(ref, data) for _ in range(2)]
    out["ref_weights"] = _weights(ref)
    probe = dict(ref.module.named_parameters())["blocks.0.attn.qkv.weight"]
    out["ref_get"] = safe_get_full_fp32_param(probe)
    safe_set_full_fp32_param(probe, out["ref_get"] * 1.001)  # the master alone moves (DeepSpeed's semantics)
    out["ref_after_set"] = [optimizer_step(ref, data), _weights(ref)]
    out["ref_params_bytes"] = ref_tracker.by_category(ref_tracker.live_records())[PARAMETERS]
    out["sizes"] = [m.numel() for m in ref.optimizer.fp32_partitioned_groups_flat]

    # remainders: the most whole masters at once during an update, and what is parked between steps
    ours = _engine(_config("remainders"))
    tracker = ours.xirang.track_memory()
    parked = ours.xirang.plugin("optimizer_states").parked[0]
    whole = []
    for name in ("unpark", "park"):
        method = getattr(parked, name)

        def counted(i, method=method):
            method(i)
            whole.append(sum(m.numel() > 0 for m in parked.masters))

        setattr(parked, name, counted)
    from xirang_ds.compat.deepspeed import around_zero3_update

    for handle in parked._handles[:2]:  # rebind DeepSpeed's seam to the counting methods
        handle.remove()
    parked._handles[:2] = around_zero3_update(ours.optimizer, parked.unpark, parked.park)
    data = data_iter(4, 64, rank, world)
    out["ours"] = [optimizer_step(ours, data) for _ in range(2)]
    ours.save_checkpoint(os.path.join(tmp, "remainders"), tag="s2")
    probe = dict(ours.module.named_parameters())["blocks.0.attn.qkv.weight"]
    out["get_s2"] = safe_get_full_fp32_param(probe)
    out["ours"] += [optimizer_step(ours, data) for _ in range(2)]
    out["ours_weights"] = _weights(ours)
    out["whole"] = list(whole)  # before the set below leaves a sub-group whole
    out["between"] = [m.numel() for m in ours.optimizer.fp32_partitioned_groups_flat]
    out["held"] = parked.held_bytes()
    out["params_bytes"] = tracker.by_category(tracker.live_records())[PARAMETERS]
    out["get"] = safe_get_full_fp32_param(probe)
    out["parked_after_get"] = sorted(parked.parked) == list(range(len(parked.masters)))
    safe_set_full_fp32_param(probe, out["get"] * 1.001)  # its sub-group whole until its next update parks it
    out["whole_after_set"] = len(parked.parked) == len(parked.masters) - 1
    out["after_set"] = [optimizer_step(ours, data), _weights(ours)]
    out["parked_after_step"] = len(parked.parked) == len(parked.masters)
    out["describe"] = ours.xirang.plugin("optimizer_states").describe()

    # the checkpoint holds DeepSpeed's fp32 partitions, bit for bit; it resumes under either setting
    saved = [_zero_file(os.path.join(tmp, kind), "s2", rank)["fp32_flat_groups"] for kind in ("fp32", "remainders")]
    out["same_file"] = all(torch.equal(a, b) for a, b in zip(*saved)) and len(saved[0]) == len(saved[1])
    for kind in ("remainders", "fp32"):
        engine = _engine(_config(kind))
        engine.load_checkpoint(os.path.join(tmp, "remainders"), tag="s2")
        data = data_iter(4, 64, rank, world)
        for _ in range(4):  # the two steps' micro-batches already trained
            next(data)
        out[f"resumed_{kind}"] = [optimizer_step(engine, data) for _ in range(2)]
        out[f"resumed_{kind}_weights"] = _weights(engine)

    # other sub-groups (DeepSpeed's default sub_group_size): DeepSpeed's own load cannot take the codes, so
    # xirang takes them over (the int8 codes decoded and encoded again over the new cut)
    other = _config("fp32")
    del other["zero_optimization"]["sub_group_size"]
    engine = _engine(other)
    engine.load_checkpoint(os.path.join(tmp, "remainders"), tag="s2")
    data = data_iter(4, 64, rank, world)
    for _ in range(4):
        next(data)
    out["recut"] = {"losses": [optimizer_step(engine, data) for _ in range(2)],
                    "events": [e["kind"] for e in engine.xirang.events],
                    "sub_groups": len(engine.optimizer.fp32_partitioned_groups_flat)}

    # removal: DeepSpeed's own masters again, training goes on as with fp32 masters
    plain = _engine(_config("fp32", "fp32"))
    data = data_iter(4, 64, rank, world)
    out["plain"] = [optimizer_step(plain, data) for _ in range(4)]
    removed = _engine(_config("auto", "fp32"))
    data = data_iter(4, 64, rank, world)
    out["removed"] = [optimizer_step(removed, data) for _ in range(2)]
    removed.xirang.remove()
    out["whole_after_removal"] = [m.numel() for m in removed.optimizer.fp32_partitioned_groups_flat]
    out["removed"] += [optimizer_step(removed, data) for _ in range(2)]
    return out


def _taken_over(rank, world, tmp):
    """The 2-rank checkpoint at 1 rank: xirang takes the states over and writes the masters whole."""
    from deepspeed.utils import safe_get_full_fp32_param

    engine = _engine(_config("remainders"))
    engine.load_checkpoint(os.path.join(tmp, "remainders"), tag="s2")
    parked = engine.xirang.plugin("optimizer_states").parked[0]
    probe = dict(engine.module.named_parameters())["blocks.0.attn.qkv.weight"]
    return {"events": [e["kind"] for e in engine.xirang.events], "get": safe_get_full_fp32_param(probe),
            "parked": len(parked.parked) == len(parked.masters)}


@pytest.mark.distributed
def test_zero3_masters_as_remainders_are_exact_and_hold_2_125_bytes(tmp_path):
    runs = run_ranks(_runs, 2, str(tmp_path), threads=1)
    elsewhere = run_ranks(_taken_over, 1, str(tmp_path), threads=1)[0]
    assert elsewhere["events"] == ["optimizer_state_taken_over"] and elsewhere["parked"]
    assert torch.equal(elsewhere["get"], runs[0]["get_s2"])
    for r in runs:
        sizes = r["sizes"]
        assert len(sizes) >= 3  # several sub-groups
        assert r["ours"] == r["ref"]
        assert all(torch.equal(a, b) for a, b in zip(r["ours_weights"], r["ref_weights"]))
        assert torch.equal(r["get"], r["ref_get"]) and r["parked_after_get"]
        assert r["whole_after_set"] and r["parked_after_step"] and r["after_set"][0] == r["ref_after_set"][0]
        assert all(torch.equal(a, b) for a, b in zip(r["after_set"][1], r["ref_after_set"][1]))
        # at most one sub-group's master whole at a time; none between steps
        assert max(r["whole"]) == 1 and r["between"] == [0] * len(sizes)
        # 2 bytes of remainder and 1/8 byte of tie bits per element, in place of 4, counted as parameters
        assert r["held"] == sum(2 * n + -(-n // 8) for n in sizes)
        assert r["ref_params_bytes"] - r["params_bytes"] == sum(4 * n for n in sizes) - r["held"]
        assert "masters as remainders" in r["describe"]
        assert r["same_file"]
        for kind in ("remainders", "fp32"):
            assert r[f"resumed_{kind}"] == r["ours"][2:]
            assert all(torch.equal(a, b) for a, b in zip(r[f"resumed_{kind}_weights"], r["ours_weights"]))
        recut = r["recut"]
        assert recut["events"] == ["optimizer_state_taken_over"] and recut["sub_groups"] < len(sizes)
        assert max(abs(a / b - 1) for a, b in zip(recut["losses"], r["ours"][2:])) < 1e-3
        assert r["removed"] == r["plain"] and r["whole_after_removal"] == sizes


@pytest.mark.parametrize("masters", ["remainders", "none"])  # none: test_masters_none.py
def test_remainders_elsewhere_is_refused_with_every_problem(masters):
    from xirang_ds.planning.fit import fit_block
    from xirang_ds.config.validate import XirangConfigError

    block = {"optimizer_states": {"enabled": True, "masters": masters}}
    with pytest.raises(XirangConfigError) as e:
        fit_block(block, ds_config(stage=2, dtype="fp16"))
    text = str(e.value)
    assert f"is '{masters}' but zero_optimization.stage is 2" in text and "bf16.enabled is not true" in text
    assert "grad_release.masters" in text and "Fix:" in text
    fit_block(block, ds_config(stage=3, dtype="bf16"))  # where it applies
    fit_block({"optimizer_states": {"enabled": True}}, ds_config(stage=2, dtype="fp16"))  # auto: fp32 there
