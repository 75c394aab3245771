"""Presets in the configurations large runs use (ZeRO 0-3, optimizer and parameter offload, fp32 /
bf16 / fp16, clipping, accumulation): a plugin that cannot run there is left out of the preset with
one line saying why; a section the user wrote that clashes is an error, every problem at once."""
import math

import pytest

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.planning.fit import fit_block
from xirang_ds.config.presets import PRESETS
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.launch import run_ranks

CONFIGS = {
    "zero3 bf16, accumulation 4, clipping": dict(stage=3, dtype="bf16", gas=4, clip=1.0),
    "zero2 bf16, offload_optimizer": dict(stage=2, dtype="bf16", zero_extra={"offload_optimizer": {"device": "cpu"}}),
    "zero3 fp16, offload_param": dict(stage=3, dtype="fp16", zero_extra={"offload_param": {"device": "cpu"}}),
    "zero1 fp32, accumulation 4, clipping": dict(stage=1, dtype="fp32", gas=4, clip=1.0),
}
LEFT_OUT = {
    "zero3 bf16, accumulation 4, clipping": {"grad_release"},
    "zero2 bf16, offload_optimizer": {"grad_release", "optimizer_states"},
    "zero3 fp16, offload_param": {"grad_release"},
    "zero1 fp32, accumulation 4, clipping": set(),
}
"""What each preset leaves out there (conservative has no optimizer_states to leave out)."""
KEYS_LEFT_OUT = {"zero1 fp32, accumulation 4, clipping": {"aggressive": {"grad_release.masters"},
                                                            "balanced": {"grad_release.masters"}}}
"""Keys a preset set that fall back there: aggressive's ``masters: none`` and balanced's
``remainders_8bit`` need bf16 weights."""


def _config(name, xirang=None):
    spec = dict(CONFIGS[name])
    zero_extra = spec.pop("zero_extra", {})
    cfg = ds_config(micro=2, xirang=xirang, **spec)
    cfg["zero_optimization"].update(zero_extra)
    return cfg


def _train(rank, world, cfg, steps):
    import deepspeed

    import xirang_ds
    from xirang_ds.bench import optimizer_step
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    init = xirang_ds.initialize if "xirang" in cfg else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
    data = data_iter(engine.train_micro_batch_size_per_gpu(), 64, rank, world)
    losses = [optimizer_step(engine, data) for _ in range(steps)]
    session = getattr(engine, "xirang", None)
    out = {"losses": losses}
    if session is not None:
        out.update(plugins=[p.section for p in session.plugins], left_out=[i.section for i in session.left_out],
                   summary=session.summary(), engine_stage=engine.zero_optimization_stage(),
                   requested_stage=session.requested_ds_config["zero_optimization"]["stage"])
        session.remove()
    return out


def matrix(rank, world, steps):
    """Every configuration plain, then with each preset, in one process per rank (engines in turn)."""
    results = {}
    for name in CONFIGS:
        results[name, "plain"] = _train(rank, world, _config(name), steps)
        for preset in PRESETS:
            results[name, preset] = _train(rank, world, _config(name, {"preset": preset}), steps)
    return results


def _both_matrices(rank, world):
    """`matrix` and `models_matrix` in one process pair (a process start costs more than a run; every run
    removes its session before the next)."""
    return {"configs": matrix(rank, world, 2), "models": models_matrix(rank, world)}


@pytest.fixture(scope="module")
def both_matrices():
    return run_ranks(_both_matrices, 2)


@pytest.fixture(scope="module")
def runs(both_matrices):
    return [r["configs"] for r in both_matrices]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_runs_and_says_what_it_left_out(runs, name, preset):
    rank0 = runs[0][name, preset]
    expected = LEFT_OUT[name] & {k for k, v in PRESETS[preset].items() if v.get("enabled")}
    expected |= KEYS_LEFT_OUT.get(name, {}).get(preset, set())
    assert set(rank0["left_out"]) == expected
    assert not {item for item in expected if "." not in item} & set(rank0["plugins"])
    for section in expected:
        assert f"{section}: left out of preset {preset!r}: " in rank0["summary"]
    # conservative is lossless; the others quantize optimizer states, which moves two steps' loss little
    tolerance = 1e-3 if preset == "conservative" else 2e-2
    for rank in runs:  # each rank's own data against the plain run's same rank
        assert all(math.isfinite(x) for x in rank[name, preset]["losses"])
        assert rank[name, preset]["losses"] == pytest.approx(rank[name, "plain"]["losses"], rel=tolerance)


def test_the_session_keeps_the_requested_ds_config_under_grad_release(runs):
    run = runs[0]["zero1 fp32, accumulation 4, clipping", "conservative"]
    assert "grad_release" in run["plugins"]
    assert (run["engine_stage"], run["requested_stage"]) == (0, 1)  # DeepSpeed runs at 0; docs/grad_release.md


def test_a_section_the_user_wrote_clashes_with_every_problem_at_once():
    cfg = _config("zero2 bf16, offload_optimizer")
    cfg["zero_optimization"]["stage"] = 3
    block = {"preset": "balanced", "grad_release": {"clipping": "exact"}, "optimizer_states": {"enabled": True}}
    with pytest.raises(XirangConfigError) as e:
        fit_block(block, cfg)
    text = str(e.value)
    assert "3 problems" in text
    assert "xirang.optimizer_states.enabled: zero_optimization.offload_optimizer.device is 'cpu'" in text
    assert "xirang.grad_release cannot run with zero_optimization.stage = 3" in text
    assert "xirang.grad_release cannot run with zero_optimization.offload_optimizer.device = 'cpu'" in text


def test_a_preset_key_the_ds_config_cannot_take_falls_back_unless_the_user_wrote_it():
    """aggressive keeps no master for bf16 weights; in fp16 or fp32 its ``masters: none`` falls back
    to ``auto`` with a line (also when the user wrote other grad_release keys); written by the user,
    it is refused with the key, the dtype and the fix."""
    bf16, fp16 = {"bf16": {"enabled": True}}, {"fp16": {"enabled": True}}
    assert fit_block({"preset": "aggressive"}, bf16).config.grad_release.masters == "none"
    for block in ({"preset": "aggressive"}, {"preset": "aggressive", "grad_release": {"exact_method": "hold"}}):
        for ds, dtype in ((fp16, "float16"), ({}, "float32")):
            fitted = fit_block(block, ds)
            assert fitted.config.grad_release.enabled and fitted.config.grad_release.masters == "auto"
            assert fitted.lines() == [f"grad_release.masters: left out of preset 'aggressive': 'none' (no master, "
                                      f"bf16 weights rounded stochastically) needs bf16 parameters and this run "
                                      f"trains in {dtype}; masters stay \"auto\""]
    with pytest.raises(XirangConfigError, match="masters = 'none' needs bf16 parameters and this ds_config trains "
                                                 "in float16.*Fix: set xirang.grad_release.masters to \"auto\""):
        fit_block({"preset": "aggressive", "grad_release": {"masters": "none"}}, fp16)
    stage3 = fit_block({"preset": "aggressive"}, {**fp16, "zero_optimization": {"stage": 3}})
    assert [line.split(":")[0] for line in stage3.lines()] == ["grad_release"]  # left out whole: no key line


def test_a_preset_leaves_out_a_plugin_that_would_save_nothing_there():
    """fp32 at ZeRO-0 with accumulation: grad_release's accumulator is the whole model's fp32 gradients,
    as plain DeepSpeed's, so a preset leaves it out with the line; bf16, stage 1 and accumulation 1
    keep it, and a grad_release section the user wrote runs as written."""
    def fp32_zero0(**over):
        return {"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 0}, **over}

    for preset in PRESETS:
        fitted = fit_block({"preset": preset}, fp32_zero0())
        assert not fitted.config.grad_release.enabled
        assert [line.split(":")[0] for line in fitted.lines()] == ["grad_release"]
        assert ("fp32 at zero_optimization.stage 0 with gradient_accumulation_steps 4: the accumulator is the "
                "whole model's fp32 gradients") in fitted.lines()[0]
    for ds in (fp32_zero0(bf16={"enabled": True}), fp32_zero0(gradient_accumulation_steps=1),
               fp32_zero0(zero_optimization={"stage": 1}), {"zero_optimization": {"stage": 0}}):
        assert fit_block({"preset": "balanced"}, ds).config.grad_release.enabled, ds
    written = fit_block({"preset": "balanced", "grad_release": {"clipping": "exact"}}, fp32_zero0())
    assert written.config.grad_release.enabled  # the section runs; only the preset's bf16-only key falls back
    assert [line.split(":")[0] for line in written.lines()] == ["grad_release.masters"]


def _sgd_run(rank, world):
    import torch

    import xirang_ds
    from xirang_ds.bench import optimizer_step
    from xirang_ds.models import BUILTIN_SPECS, build_model

    cfg = ds_config(stage=2, micro=2, xirang={"preset": "balanced"})
    del cfg["optimizer"]
    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = xirang_ds.initialize(model=model, optimizer=sgd, config=cfg)
    data = data_iter(2, 64, rank, world)
    return {"losses": [optimizer_step(engine, data) for _ in range(2)], "summary": engine.xirang.summary(),
            "plugins": [p.section for p in engine.xirang.plugins]}


def test_a_preset_leaves_optimizer_states_out_for_an_optimizer_it_cannot_replace():
    """optimizer_states replaces Adam and AdamW only: with another ds_config optimizer type, a client
    optimizer of another kind, or none, a preset leaves it out with the line (a client SGD trains); a
    section the user wrote is refused, with the ds_config's other problems."""
    from xirang_ds.registry import OptimizerSpec

    cfg = ds_config(stage=2, micro=2)
    lamb = {**cfg, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    for client, ds in ((OptimizerSpec("Lamb", {}), lamb), (None, cfg)):
        fitted = fit_block({"preset": "balanced"}, ds, client)
        assert not fitted.config.optimizer_states.enabled and fitted.config.grad_release.enabled
        assert [line.split(":")[0] for line in fitted.lines()] == ["optimizer_states"]
    assert "the optimizer is 'Lamb' (ds_config optimizer.type)" in fit_block({"preset": "balanced"}, lamb).lines()[0]
    assert fit_block({"preset": "balanced"}, cfg).config.optimizer_states.enabled  # validate: a client may come
    with pytest.raises(XirangConfigError) as e:
        fit_block({"preset": "balanced", "optimizer_states": {"schedule": [{"dtype": "int8"}]}},
                  {**lamb, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert "optimizer.type: optimizer_states replaces Adam and AdamW only; the optimizer is 'Lamb'" in str(e.value)
    assert "xirang.optimizer_states.enabled: zero_optimization.offload_optimizer.device is 'cpu'" in str(e.value)
    run = run_ranks(_sgd_run, 1)[0]
    assert all(math.isfinite(x) for x in run["losses"]) and "optimizer_states" not in run["plugins"]
    assert ("optimizer_states: left out of preset 'balanced': optimizer_states replaces Adam and AdamW only; the "
            "optimizer is torch.optim.sgd.SGD (client optimizer)") in run["summary"]


def test_validate_show_resolved_prints_the_left_out_lines(tmp_path, capsys):
    import json

    from xirang_ds.cli import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config("zero3 bf16, accumulation 4, clipping", {"preset": "conservative"})))
    assert main(["validate", str(path), "--show-resolved"]) == 0
    out = capsys.readouterr().out
    assert ("grad_release: left out of preset 'conservative': cannot run with zero_optimization.stage = 3; "
            "ZeRO-3 partitions the parameters themselves") in out
    resolved = json.loads(out[out.index("{"):])
    assert resolved["xirang"]["grad_release"]["enabled"] is False
    assert resolved["xirang"]["activations"]["enabled"] is True


# models of any structure ------------------------------------------------------------------------
class SequentialCNN(__import__("torch").nn.Sequential):
    """What the deepspeed launcher's CIFAR example trains: a Sequential, no ModuleList."""

    def __init__(self):
        import torch.nn as nn

        super().__init__(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 8 * 8, 10))


def _encoder():
    import torch.nn as nn

    class TiedEncoder(nn.Module):
        """nn.TransformerEncoder between an embedding and a head tied to it."""

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(64, 100, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.enc(self.emb(x)))

    return TiedEncoder()


def _called_twice():
    import torch.nn as nn

    class CalledTwice(nn.Module):
        """One submodule applied twice per forward, under a wrapper attribute (no container at all)."""

        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(32, 64), nn.Linear(64, 10)
            self.shared = nn.Sequential(nn.Linear(64, 64), nn.GELU())

        def forward(self, x):
            return self.out(self.shared(self.shared(self.inp(x))))

    return CalledTwice()


def _model(kind):
    import torch

    torch.manual_seed(0)
    if kind == "sequential_cnn":
        return SequentialCNN(), lambda g: torch.randn(4, 3, 8, 8, generator=g)
    if kind == "tied_encoder":
        return _encoder(), lambda g: torch.randint(0, 100, (4, 16), generator=g)
    model = _called_twice()
    if kind == "compiled_before_initialize":
        model = torch.compile(model)
    return model, lambda g: torch.randn(4, 32, generator=g)


MODELS = ("sequential_cnn", "tied_encoder", "called_twice", "compiled_before_initialize",
          "engine_compile_after_initialize")


def _train_model(rank, kind, preset, steps=2):
    import deepspeed
    import torch

    import xirang_ds

    model, make = _model(kind)
    cfg = ds_config(stage=2, dtype="fp32", micro=4, xirang=None if preset is None else {"preset": preset})
    init = xirang_ds.initialize if preset is not None else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
    if kind == "engine_compile_after_initialize":
        engine.compile()
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        loss = engine(make(g)).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    session = getattr(engine, "xirang", None)
    plugins = [p.section for p in session.plugins] if session is not None else []
    if session is not None:
        session.remove()
    return {"losses": losses, "plugins": plugins}


def models_matrix(rank, world):
    return {(kind, preset): _train_model(rank, kind, preset) for kind in MODELS for preset in (None, *PRESETS)}


@pytest.fixture(scope="module")
def model_runs(both_matrices):
    return [r["models"] for r in both_matrices]


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_runs_on_models_of_any_structure(model_runs, kind, preset):
    for rank in model_runs:
        run = rank[kind, preset]
        assert "activations" in run["plugins"]  # candidates found by structure, not refused
        assert all(math.isfinite(x) for x in run["losses"])
        plain = rank[kind, None]["losses"]  # the compiled plain run for a compiled model
        if preset == "conservative" and "compile" in kind:
            assert run["losses"] == plain  # one unit at the compiled call, kept (tests/activations/test_compiled.py)
        assert run["losses"] == pytest.approx(plain, rel=1e-3 if preset == "conservative" else 2e-2)


def test_auto_candidates_follow_the_structure():
    import torch
    import torch.nn as nn

    from xirang_ds.plugins.activations.selection import repeated_blocks

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())

        def forward(self, x):
            return x + self.body(x)

    class ResNetLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.layer1 = nn.Sequential(Residual(), Residual())
            self.layer2 = nn.Sequential(Residual(), Residual())
            self.fc = nn.Linear(8, 10)

    assert repeated_blocks(SequentialCNN()) == ["0", "1", "2", "3", "4", "5"]
    assert repeated_blocks(ResNetLike()) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    assert repeated_blocks(_encoder()) == ["enc.layers.0", "enc.layers.1"]  # ModuleLists come first
    flat = nn.Module()
    flat.inner = nn.Module()  # a wrapper with one child is passed through
    flat.inner.a, flat.inner.b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert repeated_blocks(flat) == ["inner.a", "inner.b"]
    assert repeated_blocks(torch.compile(flat)) == ["_orig_mod.inner.a", "_orig_mod.inner.b"]


def test_the_estimate_fits_the_preset_as_initialize_does():
    from xirang_ds.planning.spec import estimate_spec

    est = estimate_spec("gpt-tiny", _config("zero3 bf16, accumulation 4, clipping", {"preset": "balanced"}))
    assert est.predicted_peak_bytes > 0
    assert any(note.startswith("grad_release: left out of preset 'balanced': cannot run with "
                               "zero_optimization.stage = 3") for note in est.notes)
