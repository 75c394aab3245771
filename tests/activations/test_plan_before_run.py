"""The plan is made before the run (`plugins/activations/run_plan.py`, `trace_plan.py`): ``xirang-ds estimate``
and the run hold one plan, profiled on the estimator's fake trace with every size at its bound; a budget no
plan meets is refused at the first forward, before any step, naming the least budget."""
import dataclasses
import json

import torch

from tests.activations.test_deepspeed import _train
from tests.harness.engine_runs import ds_config
from xirang_ds.cli import main
from xirang_ds.config.types import format_bytes
from xirang_ds.launch import run_ranks
from xirang_ds.plugins.activations.codecs import encode_int8
from xirang_ds.plugins.activations.profile import planned_bytes
from xirang_ds.plugins.activations.storage import PayloadStorage
from xirang_ds.planning.spec import estimate_spec

OPTIONS = ["keep", "compress", "offload", "recompute"]


def _config(budget="auto"):
    """gpt-tiny's block with an activation budget in bytes: a plan that does not depend on what the rank
    needs besides saved activations, which the test harness's corpus (alive on the CPU "device") swells."""
    return ds_config(stage=2, xirang={"activations": {"enabled": True, "budget": budget, "options": OPTIONS}})


def test_every_encoding_is_planned_at_the_size_it_has_whatever_the_values():
    n = 1000
    assert planned_bytes("compress", torch.zeros(n, dtype=torch.bool), False, 64) == 125
    assert planned_bytes("compress", torch.zeros(n), True, 64) == 2 * n  # a cast from bf16: stored in bf16
    assert planned_bytes("compress", torch.zeros(n), False, 64) == 4 * n  # zeros the data may hold: not planned
    assert planned_bytes("sparsify", torch.zeros(n), False, 64) == 4 * n
    x = torch.randn(n, dtype=torch.bfloat16)
    assert planned_bytes("quantize", x, False, 64) == encode_int8(x, PayloadStorage(), 64).nbytes
    assert planned_bytes("quantize", torch.arange(n), False, 64) == 8 * n  # integers are not quantized


def _runs(rank, world, budget):
    import xirang_ds.plugins.activations as activations

    planned = _train(rank, world, _config(budget), 2, track=True)
    original = activations.twin_for
    activations.twin_for = lambda plugin, model: None  # the profiled passes of before, for comparison
    try:
        profiled = _train(rank, world, _config(budget), 3, track=True)  # two passes, then the plan
    finally:
        activations.twin_for = original
    return planned, profiled


def _budget():
    """About half of what saved activations take kept."""
    return estimate_spec("gpt-tiny", _config(), 2).plans["activations"].keep_bytes // 2


def test_the_estimate_and_the_run_hold_one_plan_made_before_the_run():
    budget = _budget()
    est = estimate_spec("gpt-tiny", _config(budget), 2)
    plan = est.plans["activations"]
    assert plan.fits and est.fits and set(plan.plan.values()) - {"keep"}  # the budget made it act
    assert est.as_dict()["least_budget_bytes"] == plan.other_bytes + plan.least_bytes
    assert plan.budget_bytes == budget and max(plan.planned_peaks) <= budget
    for planned, profiled in run_ranks(_runs, 2, budget):
        assert planned["plan"] == plan.plan and planned["budget"] == plan.budget_bytes
        assert planned["planned"] == max(plan.planned_peaks)
        assert planned["profiles"] == {n: p.as_dict() for n, p in plan.profiles.items()}
        # the fake pass and the real passes profile the same figures (times are counted, sizes bounded)
        assert profiled["profiles"] == planned["profiles"]
        assert planned["peaks"]["activations"] <= budget


def _refused(rank, world, budget):
    from xirang_ds.config.validate import XirangConfigError

    try:
        _train(rank, world, _config(budget), 1)
    except XirangConfigError as e:
        return str(e)
    return None


def test_a_budget_no_plan_meets_is_refused_before_the_first_step_with_the_least_budget(tmp_path, capsys):
    least = estimate_spec("gpt-tiny", _config(_budget()), 2).plans["activations"].least_bytes
    est = estimate_spec("gpt-tiny", _config(least // 2), 2)
    plan = est.plans["activations"]
    assert est.fits is False and plan.fits is False and est.least_budget_bytes == plan.other_bytes + least
    assert any("no activation plan fits" in n and format_bytes(est.least_budget_bytes) in n for n in est.notes)
    said = f"the least budget that fits is {format_bytes(est.least_budget_bytes)}"
    for message in run_ranks(_refused, 2, least // 2):
        assert message is not None and "planned before the run" in message and said in message
    # validate --model refuses it too, with the same figures
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_config(least // 2)))
    assert main(["validate", str(path), "--model", "gpt-tiny", "--world-size", "2"]) == 2
    assert said in capsys.readouterr().err


def _held_config(budget):
    return ds_config(stage=2, micro=16, xirang={"memory_budget": budget, "activations": {"enabled": True,
                                                                                        "options": OPTIONS}})


def _holding(rank, world, budget, held):
    """Two steps under ``budget`` with ``held`` bytes the script keeps on the device from before the first forward."""
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-tiny"]
    net = build_model(spec, seed=0)
    engine, *_ = xirang_ds.initialize(model=net, model_parameters=net.parameters(), config=_held_config(budget))
    window = engine.xirang.track_memory().open_window()
    kept = torch.ones(held, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randint(0, spec.vocab, (16, spec.seq), generator=generator)
        engine.backward(engine(x, x))
        engine.step()
    plugin = engine.xirang.plugin("activations")
    out = {"plan": dict(plugin.plan), "source": plugin.plan_source, "peak": window.peak_bytes, "kept": int(kept.sum())}
    engine.xirang.remove()
    return out


def test_the_run_takes_the_estimates_plan_where_what_the_script_holds_fits_beside_it():
    unbudgeted = estimate_spec("gpt-tiny", _held_config("auto"), 2).plans["activations"]
    budget = unbudgeted.other_bytes + unbudgeted.keep_bytes * 3 // 5
    est = estimate_spec("gpt-tiny", _held_config(budget), 2)
    plan = est.plans["activations"]
    slack = budget - est.predicted_peak_bytes  # what the plan leaves free
    room = budget - plan.other_bytes - plan.least_bytes  # the most a plan can leave the script
    assert plan.fits and set(plan.plan.values()) - {"keep"} and 0 < slack < room
    # a few bytes held beside the run: the run takes the plan `xirang-ds estimate` made, which has room for them
    for run in run_ranks(_holding, 2, budget, slack // 2):
        assert run["plan"] == plan.plan and "the plan of the whole budget fits beside it" in run["source"]
        assert run["peak"] <= budget and run["kept"] == slack // 2
    # more than the plan leaves free: planned again with them taken off the budget, and the run stays within it
    held = (slack + room) // 2
    for run in run_ranks(_holding, 2, budget, held):
        assert f"{format_bytes(held)} of it held on the device besides the run: taken off the budget" in run["source"]
        assert run["plan"] == estimate_spec("gpt-tiny", _held_config(budget - held), 2).plans["activations"].plan
        assert run["peak"] <= budget


def _bench(rank, world, model, config):
    from xirang_ds.bench import bench_rank

    return bench_rank(rank, world, model, config, 3, None, 0, True)["peak_bytes"]


def test_the_estimate_counts_the_gradients_held_while_a_final_norm_runs_backward():
    """A Llama whose plan chunks its head under conservative: backward peaks in the final norm's backward (outside
    every candidate), every saved activation alive and the head's gradients held by grad_release's buckets."""
    from unittest import mock

    from xirang_ds.plugins.activations import layer_temporaries

    model = "llama:layers=2,hidden=64,heads=4,seq=128,vocab=256"
    config = ds_config(stage=2, clip=1.0, bucket=5e5, xirang={"preset": "conservative", "memory_budget": 2_520_490})
    est = estimate_spec(model, config, 2)
    assert est.fits and est.plans["activations"].plan["lm_head"] == "chunk"
    measured = max(run_ranks(_bench, 2, model, config))
    assert abs(est.predicted_peak_bytes - measured) <= 0.001 * measured, (est.predicted_peak_bytes, measured)
    timeline = layer_temporaries.timeline
    without = mock.patch.object(layer_temporaries, "timeline",
                                lambda *a, **k: dataclasses.replace(timeline(*a, **k), lead=None))
    with without:  # that point left out: the gradients held there are not counted
        assert estimate_spec(model, config, 2).predicted_peak_bytes < measured - 100_000


def test_a_chunked_head_whose_weight_gives_its_gradient_by_rows_is_priced_in_forward_and_by_rounds():
    """A vocabulary large beside the model under conservative: the plan chunks the head, grad_release takes its
    weight's gradient by rows (ZeRO-2, 2 ranks), so backward holds a round of rows (`head_rows.round_bytes`), less
    than a token slice's, and the run peaks in forward, at the head's slice beside every saved activation and the
    temporaries alive as the head starts (the batch, the residual stream)."""
    from unittest import mock

    from xirang_ds.plugins.activations import estimate

    model = "gpt:layers=2,hidden=96,heads=4,seq=128,vocab=4096"
    config = ds_config(stage=2, clip=1.0, bucket=5e5, xirang={"preset": "conservative", "memory_budget": 12_855_133})
    est = estimate_spec(model, config, 2)
    assert est.fits and est.plans["activations"].plan["lm_head"] == "chunk" and est.peak_phase == "forward"
    measured = max(run_ranks(_bench, 2, model, config))
    assert abs(est.predicted_peak_bytes - measured) <= 1e-4 * measured, (est.predicted_peak_bytes, measured)
    with mock.patch.object(estimate, "head_rounds", lambda plugin, shape: {}):  # a token slice's backward instead
        assert estimate_spec(model, config, 2).predicted_peak_bytes > 1.05 * measured
