"""`xirang-ds tune`: the search space, the cost model's arithmetic, the choice of the winner (with a
scripted runner whose measurements are known), and one real search end to end."""
import json
from types import SimpleNamespace

import pytest

from xirang_ds.config.loader import validate_block
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.planning.spec import estimate_spec
from xirang_ds.tune import Progress, format_result, search_space, tune, winning_ds_config

DS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "xirang": {"monitor": {"enabled": True, "warn_at": 0.9}},
}
STAGE_TIME = {0: 1.2, 1: 1.0, 2: 1.0}
OPTION_TIME = {"int8": 1.1, "int4": 1.3, "grad_release": 1.05, "precision": 1.2, "activations": 1.25}


def labels(cfg: dict) -> set[str]:
    block = cfg["xirang"]
    out = set()
    if block.get("optimizer_states", {}).get("enabled"):
        out.add(block["optimizer_states"]["schedule"][0]["dtype"])
    for name in ("grad_release", "precision", "activations"):
        if block.get(name, {}).get("enabled"):
            out.add(name)
    return out


class ScriptedRunner:
    """Measures a candidate as the estimator predicts it times ``peak_factor`` of each option; time from the
    tables above. Records what it ran."""

    def __init__(self, world: int, peak_factor=None):
        self.world, self.peak_factor, self.runs = world, peak_factor or {}, []

    def __call__(self, cfg: dict, steps: int):
        self.runs.append(cfg)
        assert "monitor" not in cfg["xirang"], "trials run without the monitor"
        stage = cfg["zero_optimization"]["stage"]
        t = STAGE_TIME[stage] * cfg["train_micro_batch_size_per_gpu"] / 4
        for name in labels(cfg):
            t *= OPTION_TIME[name]
        peak = estimate_spec("gpt-tiny", cfg, self.world).predicted_peak_bytes
        for name in labels(cfg):
            peak = int(peak * self.peak_factor.get(name, 1.0))
        return SimpleNamespace(peak_bytes=peak, step_time_median_s=t, final_loss=1.0)


def test_search_space_follows_ranks_and_lossless():
    names = [[o.label for o in d] for d in search_space(DS, 2)]
    assert names[0] == ["zero0", "zero1", "zero2"]
    assert ["", "int8_states", "int4_states"] in names
    assert ["", "grad_release", "grad_release_masters_8bit", "grad_release_no_master"] in names
    lossless = [[o.label for o in d] for d in search_space(DS, 1, lossless_only=True)]
    assert lossless[0] == ["zero2"]  # one rank: the user's stage only
    assert all(not o.startswith("int") for d in lossless for o in d)


def test_cost_model_and_winner():
    base_peak = estimate_spec("gpt-tiny", {**DS, "xirang": {"comm_buffers": {"enabled": True}}}, 2).predicted_peak_bytes
    runner = ScriptedRunner(2)
    result = tune("gpt-tiny", DS, budget=int(base_peak * 0.95), world_size=2, measure_top=3, runner=runner)
    assert {"zero0", "zero1", "zero2", "int8_states", "int4_states", "grad_release"} <= set(result.profiles)
    assert all(abs(v - 1.0) < 1e-9 for v in result.calibration.values())  # the runner measures the estimate
    by_name = {c.name: c for c in result.candidates}
    # time = the stage's base time x each option's measured ratio
    assert by_name["zero0+int4_states+grad_release"].predicted_time_s == pytest.approx(1.2 * 1.3 * 1.05)
    assert by_name["zero1+int8_states"].predicted_time_s == pytest.approx(1.1)
    # nothing over the budget is measured; the winner is the fastest measured that fits
    measured = [c for c in result.candidates if c.measured_peak is not None]
    assert len(measured) == 3 and all(c.predicted_peak <= result.budget for c in measured)
    assert result.winner is min(measured, key=lambda c: c.measured_time_s)
    assert result.winner.measured_peak <= result.budget
    fitting = [c for c in result.candidates if c.predicted_peak is not None and c.predicted_peak <= result.budget]
    assert result.winner.predicted_time_s == pytest.approx(min(c.predicted_time_s for c in fitting))
    report = result.as_dict()
    assert report["model_error"] and all(abs(e["peak_error"]) < 1e-9 for e in report["model_error"])
    out = winning_ds_config(DS, result)
    assert out["xirang"]["monitor"] == DS["xirang"]["monitor"]  # the user's monitor comes back
    validate_block(out["xirang"])
    assert "winner:" in format_result(result)


def test_a_candidate_measured_over_budget_is_not_chosen():
    base_peak = estimate_spec("gpt-tiny", {**DS, "xirang": {"comm_buffers": {"enabled": True}}}, 2).predicted_peak_bytes
    # grad_release measures 50% over what the model predicts: its candidates fail for real (its three kinds
    # of masters tie for the fastest, so a fourth candidate is measured)
    runner = ScriptedRunner(2, {"grad_release": 1.5})
    result = tune("gpt-tiny", DS, budget=int(base_peak * 0.95), world_size=2, measure_top=4, runner=runner)
    over = [c for c in result.candidates if c.measured_peak and c.measured_peak > result.budget]
    assert over, "the scripted runner put a measured candidate over the budget"
    assert result.winner is not None and result.winner not in over
    assert result.winner.measured_peak <= result.budget


def test_no_fit_and_progress_lines(capsys):
    import io

    stream = io.StringIO()
    result = tune("gpt-tiny", DS, budget=1000, world_size=1, runner=ScriptedRunner(1), progress=Progress(stream))
    assert result.winner is None
    assert "no measured candidate fits" in format_result(result)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[") and "estimate" in lines[0] and any("profile" in x for x in lines)


def test_autotune_enabled_points_to_the_command():
    with pytest.raises(XirangConfigError) as e:
        validate_block({"autotune": {"enabled": True, "output": "tuned.json"}})
    assert "xirang.autotune.enabled" in str(e.value) and "xirang-ds tune" in str(e.value)
    assert "'tuned.json'" in str(e.value)


def test_cli_budget_errors(tmp_path, capsys):
    from xirang_ds.cli import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    assert main(["tune", "--model", "gpt-tiny", "--ds-config", str(path)]) == 2
    assert "no budget" in capsys.readouterr().err
    assert main(["tune", "--model", "gpt-tiny", "--ds-config", str(path), "--budget", "lots"]) == 2
    assert "40GB" in capsys.readouterr().err


@pytest.mark.distributed
def test_cli_tune_end_to_end(tmp_path, capsys):
    """A real search (one rank, lossless options, short runs): the written ds_config trains."""
    from xirang_ds.cli import main

    path, out, report = tmp_path / "ds.json", tmp_path / "tuned.json", tmp_path / "tune.json"
    path.write_text(json.dumps({**DS, "xirang": {"autotune": {"enabled": True, "measure_top": 1}}}))
    code = main(["tune", "--model", "gpt-tiny", "--ds-config", str(path), "--budget", "64MiB", "--lossless",
                 "--profile-steps", "2", "--measure-steps", "2", "--out", str(out), "--json", str(report),
                 "--quiet"])
    assert code == 0, capsys.readouterr()
    tuned = json.loads(out.read_text())
    validate_block(tuned["xirang"])
    assert "autotune" not in tuned["xirang"] and tuned["xirang"]["memory_budget"] == 64 * 2**20
    data = json.loads(report.read_text())
    assert data["winner"]["measured_peak_bytes"] <= 64 * 2**20
    assert {"zero2", "grad_release"} <= set(data["profiles"])
    assert len(data["model_error"]) == 1


def test_step_time_is_a_line_in_the_micro_batch():
    from xirang_ds.tune import micro_batch_scale

    profiles = {"zero2": {"step_time_s": 0.2}, "zero2@mb64": {"step_time_s": 0.83}}
    assert micro_batch_scale(profiles, 2, 4, 64, 4) == 1.0
    assert micro_batch_scale(profiles, 2, 4, 64, 64) == pytest.approx(0.83 / 0.2)
    assert micro_batch_scale(profiles, 2, 4, 64, 34) == pytest.approx((0.2 + 0.63 / 2) / 0.2)
    assert micro_batch_scale({"zero2": {"step_time_s": 0.2}}, 2, 4, 4, 8) == 2.0  # one point: proportional


def test_largest_micro_batch_grows_each_combination():
    base_peak = estimate_spec("gpt-tiny", {**DS, "xirang": {"comm_buffers": {"enabled": True}}}, 1).predicted_peak_bytes
    result = tune("gpt-tiny", DS, budget=4 * base_peak, world_size=1, objective="largest_micro_batch",
                  runner=ScriptedRunner(1), lossless_only=True)
    grown = [c for c in result.candidates if c.predicted_peak is not None and c.rejected is None]
    assert grown and all(c.micro_batch > DS["train_micro_batch_size_per_gpu"] for c in grown)
    assert all(c.predicted_peak <= result.budget for c in grown)
    assert result.winner.micro_batch == max(c.micro_batch for c in grown if c.measured_peak)


def test_planned_peak_keeps_activations_under_what_the_budget_leaves():
    from xirang_ds.tune import planned_peak, planner_line

    assert planned_peak(40, 60, 10, 200) == (100, 0.0)  # room: everything kept
    assert planned_peak(40, 60, 10, 70) == (70, pytest.approx(0.6))  # 30 of 60 kept
    assert planned_peak(40, 60, 10, 45) == (50, 1.0)  # even the least plan does not fit 45
    # two profiled points: a line in the micro-batch; one point: other fixed, activations proportional
    profiles = {"act": {"activation_figures": {"other_peak_bytes": 100, "keep_bytes": 40, "least_bytes": 4}},
                "act@mb16": {"activation_figures": {"other_peak_bytes": 220, "keep_bytes": 160, "least_bytes": 16}}}
    assert planner_line(profiles, "act", 4, 16)(28) == pytest.approx((340, 280, 28))
    assert planner_line({"act": profiles["act"]}, "act", 4, 16)(8) == pytest.approx((100, 80, 8))
    assert planner_line({"act": {"activation_figures": {"other_peak_bytes": None}}}, "act", 4, 16) is None


class PlannerRunner(ScriptedRunner):
    """As ScriptedRunner; the activations option's run reports what its planner can reach: the
    estimator's saved bytes kept, a tenth of them at least, and the rest of the estimate besides."""

    def __call__(self, cfg: dict, steps: int):
        out = super().__call__(cfg, steps)
        if "activations" in labels(cfg):
            est = estimate_spec("gpt-tiny", cfg, self.world)
            keep = est.phases[est.peak_phase]["activations"]
            other = max(p["total"] - p["activations"] for p in est.phases.values())
            out.plugin_figures = {"activations": {"keep_bytes": keep, "least_bytes": keep // 10,
                                                  "least_added_s": 0.01, "other_peak_bytes": other}}
            budget = cfg["xirang"]["memory_budget"]
            out.peak_bytes = min(out.peak_bytes, max(budget, other + keep // 10))
        return out


def test_largest_micro_batch_uses_the_planner_reach():
    """With the planner's figures, the activations option grows past the micro-batch where keeping
    every activation stops fitting, and its predicted time carries the planned added seconds."""
    base_peak = estimate_spec("gpt-tiny", {**DS, "xirang": {"comm_buffers": {"enabled": True}}}, 1).predicted_peak_bytes
    result = tune("gpt-tiny", DS, budget=3 * base_peak, world_size=1, objective="largest_micro_batch",
                  runner=PlannerRunner(1), lossless_only=True)
    live = [c for c in result.candidates if c.rejected is None and c.predicted_peak is not None]
    with_planner = [c for c in live if "act_lossless" in c.name]
    without = [c for c in live if "act_lossless" not in c.name]
    assert max(c.micro_batch for c in with_planner) > max(c.micro_batch for c in without)
    assert all(c.predicted_peak <= result.budget for c in live)
    assert "activation_figures" in result.profiles["act_lossless"]
    assert any(k.startswith("act_lossless@mb") for k in result.profiles)  # the second point
