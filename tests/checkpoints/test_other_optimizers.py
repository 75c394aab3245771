"""Checkpoints of runs whose optimizer is not Adam (torch's SGD with momentum) and of grad_release in fp32.

The neutral form carries whatever per-element state the optimizer keeps, so a grad_release run with SGD
writes plain DeepSpeed's ZeRO-2 files (its momentum buffers over DeepSpeed's flat partitions), plain
DeepSpeed resumes them, and the block takes a plain SGD checkpoint over: each resumed run holds exactly
the state the writer saved (it saves again at once and both checkpoints read the same, element for
element) and trains on from it; a state of another kind of optimizer is refused before anything is
loaded. In fp32, where grad_release keeps no master (the weights are the masters), the plain files take
the weights. Real DeepSpeed ZeRO-2 engines on 2 CPU ranks.
"""
import os

import pytest
import torch

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.bench import optimizer_step
from xirang_ds.launch import run_ranks

CONSERVATIVE = {"preset": "conservative"}


def _engine(block, kind: str, dtype: str = "bf16", stage: int = 2):
    import deepspeed

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    config = ds_config(stage=stage, dtype=dtype, micro=2, xirang=block)
    del config["optimizer"]
    config["zero_allow_untested_optimizer"] = True  # ZeRO lists the optimizers it tested; SGD is not one
    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    if kind == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    elif kind == "adagrad":
        optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init = xirang_ds.initialize if block is not None else deepspeed.initialize
    engine, *_ = init(model=model, optimizer=optimizer, config=config)
    return engine


def _train(engine, rank, world, skip, count):
    data = data_iter(2, 64, rank, world)
    for _ in range(skip):
        next(data)
    return {"losses": [optimizer_step(engine, data) for _ in range(count)],
            "weights": [p.detach().float().clone() for p in engine.module.parameters()]}


def _same_states(first: str, second: str, engine) -> bool:
    """Whether two checkpoints hold the same optimizer state for every trainable parameter: masters
    where both hold them, per-element states (the same keys) and step counts."""
    from xirang_ds.checkpoints.tags import read_marker, read_states

    shapes = {n: p.shape for n, p in engine.module.named_parameters() if p.requires_grad}
    a, b = (read_states(d, read_marker(d), list(shapes), shapes) for d in (first, second))
    for name in shapes:
        x, y = a.params[name], b.params[name]
        if x.step != y.step or set(x.moments) != set(y.moments) or not x.moments:
            return False
        if not all(torch.equal(x.moments[k].reshape(-1), y.moments[k].reshape(-1)) for k in x.moments):
            return False
        # in fp32 grad_release's own files hold no master (the weights are; the first loss checks them)
        if x.master is not None and y.master is not None and not torch.equal(x.master.reshape(-1),
                                                                              y.master.reshape(-1)):
            return False
    return True


def _runs(rank, world, tmp):
    out = {}
    for name, block, kind, dtype in (("plain", None, "sgd", "bf16"), ("ours", CONSERVATIVE, "sgd", "bf16"),
                                     ("ours_fp32_adamw", CONSERVATIVE, "adamw", "fp32")):
        engine = _engine(block, kind, dtype)
        first = _train(engine, rank, world, 0, 2)
        engine.save_checkpoint(os.path.join(tmp, name), tag="s2")
        out[name] = {"saved": sorted(os.listdir(os.path.join(tmp, name, "s2"))),
                     "losses": first["losses"] + _train(engine, rank, world, 2, 2)["losses"],
                     "weights": [p.detach().float().clone() for p in engine.module.parameters()]}
    for name, block, kind, dtype, source in (("plain_from_ours", None, "sgd", "bf16", "ours"),
                                             ("ours_from_plain", CONSERVATIVE, "sgd", "bf16", "plain"),
                                             ("plain_from_fp32", None, "adamw", "fp32", "ours_fp32_adamw")):
        engine = _engine(block, kind, dtype)
        engine.load_checkpoint(os.path.join(tmp, source), tag="s2")
        engine.save_checkpoint(os.path.join(tmp, name), tag="s2")  # what it loaded, written by its own owner
        session = getattr(engine, "xirang", None)
        out[name] = {**_train(engine, rank, world, 2, 2), "steps": engine.global_steps,
                     "same_state": _same_states(os.path.join(tmp, source, "s2"), os.path.join(tmp, name, "s2"),
                                                engine),
                     "events": [e["kind"] for e in session.events] if session is not None else []}
    # stage 0: the model-states file's plain optimizer entry, SGD keeping no step count
    zero0 = _engine(CONSERVATIVE, "sgd", stage=0)
    out["zero0"] = _train(zero0, rank, world, 0, 2)["losses"]
    zero0.save_checkpoint(os.path.join(tmp, "zero0"), tag="s2")
    out["zero0"] += _train(zero0, rank, world, 2, 1)["losses"]
    plain0 = _engine(None, "sgd", stage=0)
    plain0.load_checkpoint(os.path.join(tmp, "zero0"), tag="s2")
    out["plain_from_zero0"] = _train(plain0, rank, world, 2, 1)["losses"]
    adamw = _engine(CONSERVATIVE, "adamw")
    before = [p.detach().clone() for p in adamw.module.parameters()]
    try:
        adamw.load_checkpoint(os.path.join(tmp, "plain"), tag="s2")
    except Exception as e:  # the refusal, before anything is loaded
        out["refused"] = f"{type(e).__name__}: {e}"
    out["untouched"] = (adamw.global_steps == 0
                        and all(torch.equal(a, b) for a, b in zip(before, adamw.module.parameters())))
    return out


@pytest.mark.distributed
def test_an_sgd_checkpoint_crosses_between_grad_release_and_plain_deepspeed_exactly(tmp_path):
    for r in run_ranks(_runs, 2, str(tmp_path), threads=1):
        for name in ("ours", "ours_fp32_adamw"):  # saved, with plain DeepSpeed's ZeRO-2 files beside xirang's
            assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                    "xirang_grad_release"} <= {n.replace("bf16_", "") for n in r[name]["saved"]}, name
        # each holds exactly the state the writer saved (momentum buffers or Adam's moments, masters, step)
        # and its weights (the first loss), then trains on with its own arithmetic
        for resumed, writer in (("plain_from_ours", "ours"), ("ours_from_plain", "plain"),
                                ("plain_from_fp32", "ours_fp32_adamw")):
            assert r[resumed]["same_state"], resumed
            assert r[resumed]["losses"][0] == r[writer]["losses"][2], resumed
            assert r[resumed]["losses"][1] == pytest.approx(r[writer]["losses"][3], rel=1e-4), resumed
            assert r[resumed]["steps"] == 4
        assert r["ours_from_plain"]["events"] == ["optimizer_state_taken_over"]
        assert r["plain_from_zero0"] == r["zero0"][2:]
        assert ("the checkpoint's optimizer keeps ['momentum_buffer'] per parameter (DeepSpeed ZeRO-2 (bf16)) and "
                "this run's AdamW keeps ['exp_avg', 'exp_avg_sq', 'step']: another kind of optimizer") in r["refused"]
        assert "load_optimizer_states=False" in r["refused"] and r["untouched"]


def _adagrad_zero3(rank, world, tmp):
    engine = _engine(CONSERVATIVE, "adagrad", "fp32", stage=3)
    _train(engine, rank, world, 0, 2)
    engine.save_checkpoint(tmp, tag="s2")
    continued = _train(engine, rank, world, 2, 1)["losses"]
    resumed = _engine(CONSERVATIVE, "adagrad", "fp32", stage=3)
    resumed.load_checkpoint(tmp, tag="s2")
    return {"continued": continued, "resumed": _train(resumed, rank, world, 2, 1)["losses"],
            "steps": resumed.global_steps}


@pytest.mark.distributed
def test_a_zero3_adagrad_checkpoint_resumes_under_the_block(tmp_path):
    """DeepSpeed's ZeRO-3 rebuilds a torch Adagrad over its partitions and leaves them in its param groups, so
    a fresh engine cannot load its checkpoint (plain DeepSpeed fails: "loaded state dict contains a parameter
    group that doesn't match the size"); with the block the groups are emptied as a step leaves them
    (`compat.deepspeed.settle_zero3_adagrad`) and the resumed step equals the continued one."""
    for r in run_ranks(_adagrad_zero3, 2, str(tmp_path), threads=1):
        assert r["resumed"] == r["continued"] and r["steps"] == 3


def test_the_kind_of_a_state_is_read_from_the_optimizer():
    from xirang_ds.checkpoints.param_states import StateKindError, elementwise_keys, expected_keys

    p = torch.nn.Parameter(torch.ones(3))
    assert expected_keys(torch.optim.AdamW([p])) == {"step", "exp_avg", "exp_avg_sq"}
    assert expected_keys(torch.optim.Adam([p], amsgrad=True)) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert expected_keys(torch.optim.SGD([p], lr=0.1, momentum=0.9)) == {"momentum_buffer"}
    assert expected_keys(torch.optim.SGD([p], lr=0.1)) == set()  # no momentum: no state per element
    assert expected_keys(torch.optim.Adagrad([p])) == {"step", "sum"}
    assert elementwise_keys({"step": torch.tensor(3.0), "momentum_buffer": None, "m": torch.zeros(4)}, 4) == ("m",)
    with pytest.raises(StateKindError, match=r"holds \['row'\], which are not one value per element of the 4"):
        elementwise_keys({"m": torch.zeros(4), "row": torch.zeros(2)}, 4)
