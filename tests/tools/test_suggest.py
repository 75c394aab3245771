"""``xirang-ds estimate`` where the block does not fit: a change that does (`xirang_ds.planning.suggest`), and the
least budget an estimate at that budget confirms."""
import json
from types import SimpleNamespace

from xirang_ds.cli import main
from xirang_ds.config.types import format_bytes
from xirang_ds.planning.suggest import CHANGES, least_fitting_budget, suggest_fit

BASE = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
        "xirang": {"preset": "conservative", "memory_budget": 100}}


def _estimator(need, least=None):
    """An estimate that fits where ``need(ds_config)`` is within the budget; its least budget is ``least``
    (a function of the config) or the need itself."""
    calls = []

    def estimate(cfg):
        calls.append(cfg)
        n = need(cfg)
        return SimpleNamespace(fits=n <= cfg["xirang"]["memory_budget"], predicted_peak_bytes=n,
                               least_budget_bytes=least(cfg) if least else n)
    return estimate, calls


def _need(cfg, preset=None, stage=None, micro=None):
    """Bytes by the three settings: each preset, stage and halving lowers them by its own amount."""
    p = {"conservative": 0, "balanced": 10, "aggressive": 25}[cfg["xirang"]["preset"]]
    s = {0: 0, 1: 0, 2: 20, 3: 30}[cfg["zero_optimization"]["stage"]]
    m = {8: 0, 4: 15, 2: 22, 1: 25}[cfg["train_micro_batch_size_per_gpu"]]
    return 140 - (preset or {}).get(p, p) - s - m


def test_the_first_single_change_that_fits_in_the_order_a_user_gives_up_least():
    estimate, calls = _estimator(_need)  # 140: balanced 130, stage 2 120, micro 4 125 — none fits 100
    s = suggest_fit(BASE, estimate)
    # round 1 keeps stage 2 (lowest least budget); round 2: balanced on it is 110, stage 3 is 110, micro 4 105;
    # round 3 from micro 4 (105): balanced 95 fits first
    assert s.found and s.changes == ["zero_optimization.stage 1 -> 2",
                                     "train_micro_batch_size_per_gpu 8 -> 4 with gradient_accumulation_steps 1 -> 2 "
                                     "(the same global batch)",
                                     'xirang.preset "conservative" -> "balanced"']
    cfg = s.ds_config
    assert (cfg["xirang"]["preset"], cfg["zero_optimization"]["stage"], cfg["train_micro_batch_size_per_gpu"],
            cfg["gradient_accumulation_steps"]) == ("balanced", 2, 4, 2)
    # the optimizer offloaded is estimated each round too (it saves nothing in these figures)
    assert s.predicted_peak_bytes == 95 and s.estimates == len(calls) == 9
    assert BASE["zero_optimization"]["stage"] == 1 and BASE["xirang"]["preset"] == "conservative"  # not edited


def test_a_preset_change_is_preferred_when_it_fits_and_aggressive_says_it_is_lossy():
    estimate, _ = _estimator(lambda c: _need(c) - 35)  # 105: balanced 95 and stage 2 85 both fit: preset first
    s = suggest_fit(BASE, estimate)
    assert s.found and s.changes == ['xirang.preset "conservative" -> "balanced"'] and s.estimates == 1
    s = suggest_fit({**BASE, "xirang": {"preset": "balanced", "memory_budget": 100}},
                    _estimator(lambda c: _need(c) - 25)[0])  # balanced 105; aggressive 90
    assert s.changes[0].startswith('xirang.preset "balanced" -> "aggressive" (lossy')


def test_nothing_left_to_change_says_so_with_the_closest():
    top = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
           "xirang": {"preset": "aggressive", "memory_budget": 10}}
    # at ZeRO 3 with the optimizer offloaded, the parameters' partitions are what is left to offload
    offloaded = lambda c: _need(c) - (40 if "offload_param" in c["zero_optimization"] else 0)  # noqa: E731
    s = suggest_fit({**top, "xirang": {**top["xirang"], "memory_budget": 20}}, _estimator(offloaded)[0])
    assert s.found and s.estimates == 1 and s.changes[0].startswith('zero_optimization.offload_param {"device": "cpu"}')
    assert s.ds_config["zero_optimization"]["offload_param"] == {"device": "cpu"}
    top["zero_optimization"]["offload_param"] = {"device": "cpu"}
    s = suggest_fit(top, _estimator(_need)[0])
    assert not s.found and s.changes == [] and s.estimates == 0
    odd = {**BASE, "train_micro_batch_size_per_gpu": 3}  # an odd micro-batch is not halved (the global batch)
    s = suggest_fit(odd, _estimator(lambda c: 1000)[0])
    assert not s.found and all("micro" not in c for c in s.changes)


def test_the_least_budget_is_confirmed_by_an_estimate_at_it():
    # the least budget an estimate names depends on its budget: below 60 the settings need 80, from 60 on 55
    estimate, calls = _estimator(lambda c: 55 if c["xirang"]["memory_budget"] >= 60 else 80,
                                 lambda c: 55 if c["xirang"]["memory_budget"] >= 60 else 80)
    cfg = {**BASE, "xirang": {**BASE["xirang"], "memory_budget": 40}}
    # at 80 it fits and names 55; at 55 it needs 80 again: 80 is the least confirmed
    assert least_fitting_budget(cfg, estimate, 80) == (80, 2)
    estimate, calls = _estimator(lambda c: 55 if c["xirang"]["memory_budget"] >= 50 else 80,
                                 lambda c: 55 if c["xirang"]["memory_budget"] >= 50 else 80)
    assert least_fitting_budget(cfg, estimate, 80) == (55, 2)  # 80 fits and names 55, which fits at its own
    never, _ = _estimator(lambda c: 2 * c["xirang"]["memory_budget"], lambda c: 2 * c["xirang"]["memory_budget"])
    assert least_fitting_budget(cfg, never, 80) == (None, 4)  # each budget asks for twice itself: rounds run out


def test_estimate_names_a_change_that_fits_and_the_least_budget_it_confirmed(tmp_path, capsys):
    """gpt-tiny under a budget its conservative block does not meet on 2 ranks: the JSON carries the least budget
    an estimate at it confirms, and a suggestion whose ds_config the estimate then says fits."""
    cfg = dict(BASE, xirang={"preset": "conservative", "memory_budget": 1_000_000}, bf16={"enabled": True},
               zero_optimization={"stage": 2})
    path, out = tmp_path / "c.json", tmp_path / "e.json"
    path.write_text(json.dumps(cfg))
    assert main(["estimate", "--model", "gpt-tiny", "--ds-config", str(path), "--world-size", "2",
                 "--json", str(out)]) == 0
    est, printed = json.loads(out.read_text()), capsys.readouterr().out
    assert est["fits"] is False and "suggestion" in est
    # validate --model refuses it with the same least budget, confirmed the same way
    assert main(["validate", str(path), "--model", "gpt-tiny", "--world-size", "2"]) == 2
    least = est["least_budget_bytes"]
    assert f"the least budget that fits is {format_bytes(least)} ({least:,} bytes; an estimate at it fits)" in \
        capsys.readouterr().err
    confirmed = dict(cfg, xirang={**cfg["xirang"], "memory_budget": est["least_budget_bytes"]})
    path.write_text(json.dumps(confirmed))
    assert main(["estimate", "--model", "gpt-tiny", "--ds-config", str(path), "--world-size", "2", "--no-suggest",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["fits"] is True
    s = est["suggestion"]
    if s["found"]:
        path.write_text(json.dumps(s["ds_config"]))
        assert main(["estimate", "--model", "gpt-tiny", "--ds-config", str(path), "--world-size", "2",
                     "--json", str(out)]) == 0
        assert json.loads(out.read_text())["fits"] is True
    assert "fits with these changes" in printed or not s["found"]


def test_the_optimizer_offloaded_is_tried_after_the_micro_batch_and_not_at_zero_0():
    def need(cfg):
        offloaded = (cfg["zero_optimization"].get("offload_optimizer") or {}).get("device") == "cpu"
        return _need(cfg) - (60 if offloaded else 0)

    s = suggest_fit(BASE, _estimator(need)[0])  # 140: only the offload (80) fits in round 1
    assert s.found and s.changes == ['zero_optimization.offload_optimizer {"device": "cpu"} (the fp32 weights, '
                                     "gradients and optimizer states in host memory, the update on the CPU: slower "
                                     "steps)"]
    assert s.ds_config["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    s = suggest_fit(BASE, _estimator(lambda c: need(c) - 25)[0])  # 115: stage 2 (95) fits before the offload
    assert s.changes == ["zero_optimization.stage 1 -> 2"]
    offload = CHANGES[-2]  # DeepSpeed offloads the optimizer from ZeRO 1 on, the parameters at ZeRO 3 (the last)
    assert CHANGES[-1]({**BASE, "zero_optimization": {"stage": 2}}) is None
    assert offload({**BASE, "zero_optimization": {"stage": 0}}) is None
    assert offload({**BASE, "zero_optimization": {"stage": 3}})[0]["zero_optimization"]["offload_optimizer"] == \
        {"device": "cpu"}
    offloaded = {**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert not any("offload_optimizer" in c for c in suggest_fit(offloaded, _estimator(need)[0]).changes)
