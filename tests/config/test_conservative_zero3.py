"""The conservative preset at ZeRO-3: grad_release cannot run there, so optimizer_states with fp32 states
keeps DeepSpeed's masters as bf16 remainders in its place (grad_release's registered `TakeOver`).

Real DeepSpeed ZeRO-3 engines in bf16 on 2 CPU ranks, gradient accumulation 2, clipping that bites; the
reference is plain DeepSpeed with the same ds_config.
"""
import os

import pytest
import torch

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.bench import optimizer_step
from xirang_ds.planning.fit import fit_block
from xirang_ds.launch import run_ranks
from xirang_ds.registry import OptimizerSpec

CONSERVATIVE = {"preset": "conservative"}


def _config(xirang=None) -> dict:
    return ds_config(stage=3, dtype="bf16", gas=2, clip=0.05, xirang=xirang)


def _engine(config: dict):
    import deepspeed

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    init = xirang_ds.initialize if "xirang" in config else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _whole(engine) -> list[torch.Tensor]:
    """Every parameter gathered (bf16) and its fp32 master, in ``named_parameters`` order."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for _, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out.append(p.detach().clone())
        out.append(safe_get_full_fp32_param(p))
    return out


def _resumed(config: dict, folder: str, rank: int, world: int) -> dict:
    engine = _engine(config)
    engine.load_checkpoint(folder, tag="s2")
    data = data_iter(4, 64, rank, world)
    for _ in range(4):  # the two steps' micro-batches already trained
        next(data)
    session = getattr(engine, "xirang", None)
    return {"losses": [optimizer_step(engine, data) for _ in range(2)], "whole": _whole(engine),
            "events": [e["kind"] for e in session.events] if session is not None else []}


def _runs(rank, world, tmp):
    out = {}
    for name, config in (("plain", _config()), ("conservative", _config(CONSERVATIVE))):
        engine = _engine(config)
        data = data_iter(4, 64, rank, world)
        out[name] = [optimizer_step(engine, data) for _ in range(2)]
        engine.save_checkpoint(os.path.join(tmp, name), tag="s2")
        out[name] += [optimizer_step(engine, data) for _ in range(2)]
        out[f"{name}_whole"] = _whole(engine)
        out[f"{name}_sub_groups"] = [int(w.numel()) for w in engine.optimizer.fp16_partitioned_groups_flat]
        if name == "conservative":
            plugin = engine.xirang.plugin("optimizer_states")
            out["summary"] = engine.xirang.summary()
            out["formats"] = engine.basic_optimizer.format_numel()
            out["masters_between_steps"] = [m.numel() for m in engine.optimizer.fp32_partitioned_groups_flat]
            out["held"] = plugin.parked[0].held_bytes()
            engine.xirang.remove()  # DeepSpeed's own fp32 masters again; training goes on as plain's
            out["removed_masters"] = [m.numel() for m in engine.optimizer.fp32_partitioned_groups_flat]
            out["after_removal"] = [optimizer_step(engine, data) for _ in range(2)]
    plain_more = _engine(_config())
    data = data_iter(4, 64, rank, world)
    out["plain_6"] = [optimizer_step(plain_more, data) for _ in range(6)]
    # each resumes the other's checkpoint: plain DeepSpeed reads the plain files written beside the codes;
    # conservative takes plain's over (DeepSpeed's one sub-group, cut into conservative's)
    out["plain_from_conservative"] = _resumed(_config(), os.path.join(tmp, "conservative"), rank, world)
    out["conservative_from_plain"] = _resumed(_config(CONSERVATIVE), os.path.join(tmp, "plain"), rank, world)
    out["conservative_from_own"] = _resumed(_config(CONSERVATIVE), os.path.join(tmp, "conservative"), rank, world)
    return out


@pytest.mark.distributed
def test_conservative_at_zero3_keeps_the_masters_as_remainders_bit_for_bit(tmp_path):
    for r in run_ranks(_runs, 2, str(tmp_path), threads=1):
        # every loss, every gathered bf16 weight and every fp32 master are plain DeepSpeed's
        assert r["conservative"] == r["plain"]
        assert all(torch.equal(a, b) for a, b in zip(r["conservative_whole"], r["plain_whole"]))
        assert set(r["formats"]) == {"fp32"}
        assert "optimizer_states keeps DeepSpeed's ZeRO-3 masters as remainders in its place" in r["summary"]
        # no fp32 master between steps: 2 bytes of remainder and 1/8 byte of tie bits per element in place of 4
        sizes = r["conservative_sub_groups"]
        assert len(sizes) > 1 and sum(sizes) == sum(r["plain_sub_groups"])
        assert r["masters_between_steps"] == [0] * len(sizes)
        assert r["held"] == sum(2 * n + -(-n // 8) for n in sizes)
        # removal: DeepSpeed's fp32 masters whole again, and training goes on as plain's
        assert r["removed_masters"] == sizes
        assert r["after_removal"] == r["plain_6"][4:]
        for name in ("plain_from_conservative", "conservative_from_plain", "conservative_from_own"):
            resumed = r[name]
            assert resumed["losses"] == r["plain"][2:], name
            assert all(torch.equal(a, b) for a, b in zip(resumed["whole"], r["plain_whole"])), name
        assert r["conservative_from_plain"]["events"] == ["optimizer_state_taken_over"]
        assert r["conservative_from_own"]["events"] == []


def test_conservative_takes_over_the_masters_only_where_it_pays_and_can_run():
    """Only at ZeRO-3 in bf16, on the device, with an Adam-type optimizer, and where the user wrote no
    optimizer_states section; balanced and aggressive run optimizer_states anyway."""
    def fitted(client=OptimizerSpec("AdamW", {}), block=CONSERVATIVE, **edits):
        """conservative fitted to the ZeRO-3 bf16 ds_config with ``edits`` (``None``: key removed) and the
        optimizer ``initialize`` would step (``client``)."""
        config = _config()
        for key, value in edits.items():
            if value is None:
                config.pop(key)
            elif key == "zero":
                config["zero_optimization"].update(value)
            else:
                config[key] = value
        return fit_block(block, config, client)

    taken = fitted()
    assert taken.config.optimizer_states.enabled and taken.config.optimizer_states.masters == "auto"
    assert [(e.dtype, e.until_step) for e in taken.config.optimizer_states.schedule] == [("fp32", None)]
    assert taken.lines()[0].endswith("; optimizer_states keeps DeepSpeed's ZeRO-3 masters as remainders in its "
                                     "place, with fp32 states (exact)")
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    assert fitted(adamw, optimizer=None).config.optimizer_states.enabled
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    for label, run in {"fp16": fitted(bf16=None, fp16={"enabled": True}),
                       "fp32": fitted(bf16=None),
                       "ZeRO-2": fitted(zero={"stage": 2}),
                       "offload_optimizer": fitted(zero={"offload_optimizer": {"device": "cpu"}}),
                       "Lamb": fitted(OptimizerSpec("Lamb", {}), optimizer={"type": "Lamb", "params": {}}),
                       "client SGD": fitted(sgd, optimizer=None),
                       "no optimizer": fitted(None, optimizer=None),
                       "written off": fitted(block={**CONSERVATIVE, "optimizer_states": {"enabled": False}}),
                       }.items():
        assert not run.config.optimizer_states.enabled, label
        assert not any("optimizer_states" in line for line in run.lines()), label
