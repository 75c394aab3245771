"""torch.compile'd modules under the activations plugin (`plugins/activations/compiled.py`): blocks compiled one
by one, a model compiled before ``initialize`` and ``engine.compile()`` after it train bit-identically to the
compiled plain run, with one graph per compiled module (no graph break), on 2 ranks with accumulation, and
so do compiled blocks under the tracker alone (the monitor), which counts what they save;
recompute and offload apply to compiled blocks from outside their compiled code, and a checkpoint resumes
their plan identically; what cannot apply is an
error naming the module and the fix; removal restores torch.compile's own forward."""
import pytest

from tests.harness.checks import assert_resumed
from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks


def _model(compile_as=None):
    import torch
    import torch.nn as nn

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(32, 64)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                        for _ in range(3))
            self.out = nn.Linear(64, 10)

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = h + block(h)
            return self.out(h)

    torch.manual_seed(0)
    model = Residual()
    if compile_as == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    elif compile_as == "model":
        model = torch.compile(model)
    return model


def _act(options, fraction):
    budget = {} if fraction is None else {"budget_fraction": fraction}
    return {"activations": {"enabled": True, "options": options, "min_tensor_bytes": 0, **budget},
            "monitor": {"enabled": True}}  # the monitor runs the live-storage tracker (a dispatch mode)


def _train(rank, compile_as, xirang, engine_compile=False, steps=3, save_at=None, load=False, skip=0, ckpt=None):
    import deepspeed
    import torch
    import torch._dynamo.utils

    import xirang_ds

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model(compile_as)
    own = [(m, vars(m).get("forward"), vars(m).get("_compiled_call_impl")) for m in model.modules()]
    cfg = ds_config(stage=2, dtype="fp32", micro=4, gas=2, xirang=xirang)
    init = xirang_ds.initialize if xirang is not None else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
    if engine_compile:
        engine.compile()
    g = torch.Generator().manual_seed(rank)
    for _ in range(skip * 2):
        torch.randn(4, 32, generator=g)
    losses = []
    session = getattr(engine, "xirang", None)
    if load:
        engine.load_checkpoint(ckpt)
    state_after_load = session.plugin("activations").state if session is not None and load else None
    tracker = session.started_tracker if session is not None else None
    acts = None
    for i in range(steps * 2):
        if save_at is not None and i == save_at * 2:
            engine.save_checkpoint(ckpt)
        loss = engine(torch.randn(4, 32, generator=g)).float().square().mean()
        if tracker is not None and tracker.active:  # saved for backward now: the compiled calls' too
            acts = tracker.by_category(tracker.live_records()).get("activations", 0)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    out = {"losses": losses, "params": [p.detach().clone() for p in engine.module.parameters()],
           "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
           "breaks": sum(torch._dynamo.utils.counters["graph_break"].values()), "activations": acts,
           "state_after_load": state_after_load}
    if session is not None:
        plugin = session.plugin("activations")
        if plugin is not None:
            out["plan"], out["region"] = dict(plugin.plan), plugin.region
        session.remove()
        out["restored"] = all(vars(m).get("forward") is f and "__xirang_method_chains__" not in vars(m)
                              and (engine_compile or vars(m).get("_compiled_call_impl") is c) for m, f, c in own)
    return out


RUNS = {
    "blocks": ("blocks", None, False),
    "blocks monitor": ("blocks", {"monitor": {"enabled": True}}, False),
    "blocks keep": ("blocks", _act(["keep"], None), False),
    "blocks recompute": ("blocks", _act(["keep", "recompute"], 0.5), False),
    "blocks offload": ("blocks", _act(["keep", "offload"], 0.6), False),
    "model": ("model", None, False),
    "model conservative": ("model", {"preset": "conservative"}, False),
    "engine.compile() conservative": (None, {"preset": "conservative"}, True),
}


def compiled_runs(rank, world, ckpt):
    # each compile style in a fresh Dynamo state; blocks first (a whole-model trace after them changes nothing)
    out = {name: _train(rank, *spec, **({"save_at": 2, "ckpt": ckpt} if name == "blocks offload" else {}))
           for name, spec in RUNS.items()}
    spec = RUNS["blocks offload"]
    out["blocks offload resumed"] = _train(rank, *spec, steps=1, load=True, skip=2, ckpt=ckpt)
    from xirang_ds.config.validate import XirangConfigError

    try:  # last: the engine is left mid-forward (the plan is made after two profiling passes)
        _train(rank, "model", {"preset": "balanced", "activations": {"budget_fraction": 0.05}}, steps=2)
        out["model under too small a budget"] = None
    except XirangConfigError as e:
        out["model under too small a budget"] = str(e)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(compiled_runs, 2, str(tmp_path_factory.mktemp("compiled_ckpt")))


def _same(a, b):
    import torch

    return a["losses"] == b["losses"] and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.parametrize("name", ["blocks recompute", "blocks offload"])
def test_compiled_blocks_are_planned_at_their_boundary_and_train_bit_identically(runs, name):
    option = name.split()[-1]
    for rank in runs:
        run, plain = rank[name], rank["blocks"]
        assert option in run["plan"].values()  # the planner chose it for compiled blocks
        assert set(run["plan"]) <= {"inp", "blocks.0", "blocks.1", "blocks.2"}  # nothing inside compiled code
        assert run["region"] is None
        assert _same(run, plain)  # the compiled kernels ran, under the tracker's dispatch mode too
        assert run["breaks"] == 0 and run["graphs"] == plain["graphs"]  # no graph break, no other graph
        assert run["restored"]  # removal put torch.compile's forward back


def test_a_checkpoint_resumes_the_compiled_blocks_plan_identically(runs):
    for rank in runs:
        full, resumed = rank["blocks offload"], rank["blocks offload resumed"]
        assert resumed["state_after_load"] == "planned" and resumed["plan"] == full["plan"]  # no profiling again
        assert_resumed(full, resumed, at=4)


def test_under_the_tracker_alone_compiled_blocks_run_compiled_and_their_saved_tensors_count(runs):
    for rank in runs:
        run = rank["blocks monitor"]
        assert _same(run, rank["blocks"]) and run["breaks"] == 0 and run["restored"]
        # what the compiled blocks save is counted as the activations plugin's wrappers count it
        assert run["activations"] == rank["blocks keep"]["activations"] > 0
        assert _same(rank["blocks keep"], rank["blocks"])


@pytest.mark.parametrize("name", ["model conservative", "engine.compile() conservative"])
def test_a_compiled_model_is_one_unit_and_trains_like_the_compiled_plain_run(runs, name):
    for rank in runs:
        run = rank[name]
        assert run["plan"] == {"<compiled model>": "keep"}
        assert run["region"] in ("the model was compiled before initialize",
                                 "the model runs compiled (engine.compile() or model.compile())")
        assert _same(run, rank["model"]) and run["breaks"] == 0
        assert run["restored"]


def test_a_budget_a_compiled_model_cannot_meet_names_the_compiled_unit_and_the_fix(runs):
    """A model compiled whole is one unit: its saved tensors all come back in its one backward, so no plan
    keeps them under 5%; the error says why and to compile the blocks instead."""
    for r in runs:
        message = r["model under too small a budget"]
        assert message is not None and "xirang.activations.budget" in message
        assert "the model was compiled before initialize, so the model is one unit" in message
        assert "compile its repeated blocks instead of the whole model" in message


def test_a_model_compiled_before_initialize_at_zero3_is_refused_with_the_fix():
    """DeepSpeed's ZeRO-3 engine fails at the first forward of a compiled wrapper (plain DeepSpeed too); with
    the block it is refused at initialize, beside the block's own problems, naming engine.compile()."""
    import torch

    import xirang_ds
    from xirang_ds.config.validate import XirangConfigError

    model = torch.compile(_model())
    cfg = ds_config(stage=3, dtype="fp32", micro=4, xirang={"preset": "balanced", "monitor": {"warn_at": 1.5}})
    with pytest.raises(XirangConfigError) as e:
        xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    paths = [path for path, _ in e.value.problems]
    assert paths == ["xirang.monitor.warn_at", "zero_optimization.stage"]
    assert "call engine.compile() after initialize" in str(e.value)


def test_what_cannot_apply_inside_compiled_code_is_an_error():
    from xirang_ds.plugins.activations.compiled import compiled_units, fixed_problems

    model = _model("blocks")
    units, compiled = compiled_units(model, ["blocks.0", "blocks.0._orig_mod.0", "blocks.1._orig_mod", "inp"])
    assert units == ["blocks.0", "blocks.1", "inp"] and compiled == {"blocks.0", "blocks.1"}
    problems = dict(fixed_problems({"blocks.0._orig_mod.0": "recompute", "blocks.1": "selective_recompute",
                                    "blocks.2": "offload"}, {"blocks.0", "blocks.1", "blocks.2"}, None))
    assert problems == {
        "xirang.activations.recompute": "'blocks.0._orig_mod.0' runs inside the compiled module 'blocks.0', where no "
                                        "per-module option applies; remove it, or name the compiled module",
        "xirang.activations.selective_recompute": "'blocks.1' runs compiled, and selective_recompute needs hooks "
                                                  "inside its compiled code; use recompute"}
    whole = fixed_problems({"blocks.0": "recompute"}, {"<compiled model>"}, "the model was compiled before initialize")
    assert whole[0][1].startswith("'blocks.0' runs inside the compiled model (the model was compiled before "
                                  "initialize)")


def test_wrapping_over_an_instance_attribute_puts_it_back():
    from xirang_ds.hooks import wrap_method

    class Holder:
        pass

    h = Holder()
    h.forward = lambda x: x + 1
    original = h.forward
    with pytest.raises(RuntimeError, match="already replaced"):
        wrap_method(h, "forward", lambda f, x: f(x) * 10)
    first = wrap_method(h, "forward", lambda f, x: f(x) * 10, over_instance=True)
    second = wrap_method(h, "forward", lambda f, x: f(x) - 1, over_instance=True)
    assert h.forward(1) == 19  # first registered is innermost: (1 + 1) * 10 - 1
    first.remove()
    second.remove()
    assert h.forward is original
