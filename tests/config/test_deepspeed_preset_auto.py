"""``"preset": "auto"`` (xirang_ds/planning/auto.py): the least aggressive preset the sensitivity allows
whose estimated model states fit memory_budget; no fit names the shortfall in bytes; the choice is
said in the session summary and by ``xirang-ds validate --model``; bad input is reported with the key
and the fix."""
import pytest
import torch

from tests.harness.engine_runs import ds_config
from xirang_ds.planning.auto import choose_preset
from xirang_ds.config.loader import validate_block
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.launch import run_ranks
from xirang_ds.planning.estimator import estimate_states
from xirang_ds.models import BUILTIN_SPECS, build_model

BASE = ds_config(stage=2, micro=2, clip=1.0)


def _meta_model():
    with torch.device("meta"):
        return build_model(BUILTIN_SPECS["gpt-small"])


def _needs(model, world=2, states="device", exact_method="auto"):
    """Each preset's estimate with grad_release's optimizer states on the device or in host memory (and exact
    clipping's held gradient shard on the device, ``auto`` unbudgeted, or in host memory, ``host``), with the
    measured embeddings' states at their bound, fp32, as auto takes it (`Estimate.bound_bytes`)."""
    block = {"states": states, "exact_method": exact_method}
    return {name: estimate_states(model, {**BASE, "xirang": {"preset": name, "grad_release": block}},
                                  world).bound_bytes
            for name in ("conservative", "balanced", "aggressive")}


def test_least_aggressive_preset_that_fits_within_the_sensitivity():
    model = _meta_model()
    need, host = _needs(model), _needs(model, states="host")
    stash = _needs(model, exact_method="host")
    assert need["conservative"] > need["balanced"] > need["aggressive"]  # int8, then int4 states
    # grad_release's exact_method auto takes the host for the held gradient shard where the estimate with it on
    # the device is over the budget, then states: auto the host for the states where that is still over it
    assert host["conservative"] < need["balanced"] and all(host[n] < stash[n] < need[n] for n in need)
    cases = [("normal", need["conservative"] + 1, "conservative", False),
             ("normal", need["conservative"] - 1, "conservative", False),  # the shard on the host, the states not
             ("normal", stash["conservative"] - 1, "conservative", True),
             ("normal", host["conservative"] - 1, "balanced", True),
             ("tolerant", host["balanced"] - 1, "aggressive", True),
             ("lossless", need["conservative"], "conservative", False)]
    for sensitivity, budget, taken, on_host in cases:
        block, line = choose_preset({"preset": "auto", "memory_budget": budget, "sensitivity": sensitivity,
                                     "monitor": {"warn_at": 0.8}}, BASE, model, world_size=2)
        assert block == {"preset": taken, "memory_budget": budget, "monitor": {"warn_at": 0.8}}, (sensitivity, budget)
        assert line.startswith(f"preset auto took {taken}: ") and f"sensitivity {sensitivity}" in line
        assert ("optimizer states in host memory (states auto)" in line) == on_host, line
        validate_block(block)  # an ordinary preset from here on
    # no fit: the shortfall of the least needy allowed preset, in bytes (its states in host memory)
    budget = host["balanced"] - 1000
    with pytest.raises(XirangConfigError) as e:
        choose_preset({"preset": "auto", "memory_budget": budget}, BASE, model, world_size=2)
    assert "the least, balanced, needs" in str(e.value) and f"{host['balanced'] - budget:,} bytes more" in str(e.value)
    assert "Fix: raise memory_budget" in str(e.value)
    with pytest.raises(XirangConfigError, match="the least, conservative"):
        choose_preset({"preset": "auto", "memory_budget": host["conservative"] - 1, "sensitivity": "lossless"}, BASE,
                      model, world_size=2)
    # memory_budget auto: the device's capacity
    block, _ = choose_preset({"preset": "auto"}, BASE, model, world_size=2, total_memory=host["conservative"] - 1)
    assert block["preset"] == "balanced"
    assert choose_preset({"preset": "balanced"}, BASE, model) == ({"preset": "balanced"}, None)


def test_no_fit_never_advises_what_the_config_already_does():
    model = _meta_model()
    offloaded = {**ds_config(stage=3, micro=2, clip=1.0)}
    offloaded["zero_optimization"] = {**offloaded["zero_optimization"], "offload_optimizer": {"device": "cpu"}}
    for config, advised in ((BASE, True), (offloaded, False)):
        with pytest.raises(XirangConfigError) as e:
            choose_preset({"preset": "auto", "memory_budget": 1 << 20}, config, model, world_size=2)
        assert ("offload the optimizer" in str(e.value)) == advised, str(e.value)
        assert "train on more ranks" in str(e.value)


def test_bad_input_names_the_key_and_the_fix():
    model = _meta_model()
    with pytest.raises(XirangConfigError, match=r"xirang.sensitivity: must be one of 'lossless', 'normal', 'tolerant'"):
        choose_preset({"preset": "auto", "sensitivity": "careful"}, BASE, model)
    with pytest.raises(XirangConfigError, match=r"xirang.monitor.warn_at"):  # the rest of the block is checked too
        choose_preset({"preset": "auto", "monitor": {"warn_at": 2}}, BASE, model)
    with pytest.raises(XirangConfigError) as e:
        validate_block({"preset": "balanced", "sensitivity": "lossless", "monitor": {"warn_at": 2}})
    assert "xirang.sensitivity: applies only with \"preset\": \"auto\"" in str(e.value)
    assert "xirang.monitor.warn_at" in str(e.value)  # every problem at once
    with pytest.raises(XirangConfigError, match=r"xirang.preset: \"auto\" is chosen from the model's parameters.*--model"):
        validate_block({"preset": "auto"})
    with pytest.raises(XirangConfigError, match=r"did you mean 'auto'"):
        validate_block({"preset": "autp"})


def test_validate_cli_resolves_auto_with_a_model(tmp_path, capsys):
    import json

    from xirang_ds.cli import main

    model = _meta_model()
    budget = _needs(model, states="host")["conservative"] - 1
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "xirang": {"preset": "auto", "memory_budget": budget}}))
    assert main(["validate", str(path), "--model", "gpt-small", "--world-size", "2", "--show-resolved"]) == 0
    out = capsys.readouterr().out
    assert "preset balanced" in out and "preset auto took balanced" in out
    assert json.loads(out[out.index("{"):])["xirang"]["optimizer_states"]["enabled"] is True
    assert main(["validate", str(path)]) == 2  # without a model: the error and its fix
    assert "pass --model" in capsys.readouterr().err


def _initialize(rank, world, budgets):
    import xirang_ds

    out = []
    for budget in budgets:
        net = build_model(BUILTIN_SPECS["gpt-small"])
        try:
            engine, *_ = xirang_ds.initialize(model=net, model_parameters=net.parameters(),
                                              config={**BASE, "xirang": {"preset": "auto", "memory_budget": budget}})
        except xirang_ds.XirangConfigError as e:
            out.append(str(e))
            continue
        session = engine.xirang
        out.append((session.config.preset, session.summary(), [p.section for p in session.plugins]))
        session.remove()
    return out


def test_initialize_takes_the_preset_and_says_so():
    stash, host = _needs(_meta_model(), world=1, exact_method="host"), _needs(_meta_model(), world=1, states="host")
    budgets = ["4GB", stash["conservative"] - 1, host["conservative"] - 1, host["balanced"] - 1]
    roomy, hosted, tight, short = run_ranks(_initialize, 1, budgets, threads=1)[0]
    for (preset, summary, sections), taken in ((roomy, "conservative"), (hosted, "conservative"), (tight, "balanced")):
        assert preset == taken and f"preset auto took {taken}" in summary
        assert ("optimizer_states" in sections) == (taken == "balanced")
    # where the preset's estimate took the host for grad_release's states, the run starts them there
    assert "in host memory between updates (states auto: the estimated" in hosted[1]
    assert "in host memory between" not in roomy[1]  # there: on the host only until the planner settles them
    assert "no preset that sensitivity 'normal' allows fits" in short
