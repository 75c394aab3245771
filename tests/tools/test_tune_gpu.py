"""``xirang-ds tune --gpu NAME``: the search for a GPU run before launch, on the estimate alone
(`xirang_ds.tune.predicted`): the winner is the one the estimate prices fastest among those it says fit, with
the same figures ``xirang-ds estimate --gpu`` gives its ds_config."""
import json

from xirang_ds.config.loader import validate_block
from xirang_ds.memory.device_profile import profile_named
from xirang_ds.planning.spec import estimate_spec

DS = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
      "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
      "xirang": {"monitor": {"enabled": True}}}


def test_the_winner_is_the_fastest_the_estimate_says_fits_with_estimate_s_own_figures(tmp_path, capsys):
    from xirang_ds.cli import main

    path, out, report = tmp_path / "ds.json", tmp_path / "tuned.json", tmp_path / "tune.json"
    path.write_text(json.dumps(DS))
    budget = 23 * 2**20 // 10  # 2.3 MiB: plain ZeRO-1/2 (2.55 MiB predicted) does not fit, a plan or grad_release does
    code = main(["tune", "--model", "gpt-tiny", "--ds-config", str(path), "--budget", str(budget), "--gpu", "h100",
                 "--world-size", "8", "--lossless", "--out", str(out), "--json", str(report), "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "predicted for h100, nothing run" in printed and "winner (predicted)" in printed
    data = json.loads(report.read_text())
    assert data["device_profile"] == "h100" and data["profiles"] == {} and data["world_size"] == 8
    assert all(c["measured_peak_bytes"] is None for c in data["candidates"])  # nothing ran
    tuned = json.loads(out.read_text())
    validate_block(tuned["xirang"])
    assert tuned["xirang"]["monitor"] == {"enabled": True}  # the user's monitor comes back
    # one cost model: the winner's figures are estimate --gpu's for the ds_config written
    est = estimate_spec("gpt-tiny", tuned, 8, "cuda", device_profile=profile_named("h100"))
    winner = data["winner"]
    assert est.fits and est.predicted_peak_bytes == winner["predicted_peak_bytes"] <= budget
    assert est.step_time.seconds == winner["predicted_step_time_s"]
    # and no candidate the estimate says fits is predicted faster
    live = [c for c in data["candidates"] if c["rejected"] is None and c["predicted_peak_bytes"] <= budget]
    assert any(c["predicted_peak_bytes"] > budget for c in data["candidates"])
    assert len(live) > 1 and winner["predicted_step_time_s"] == min(c["predicted_step_time_s"] for c in live)
    assert not any(c["block"].get("optimizer_states") for c in data["candidates"])  # --lossless: no int8/int4


def test_flags_of_the_measured_search_with_gpu_are_refused_at_once(tmp_path, capsys):
    from xirang_ds.cli import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    code = main(["tune", "--model", "gpt-tiny", "--ds-config", str(path), "--budget", "6MiB", "--gpu", "h200",
                 "--measure-top", "2", "--profile-steps", "3", "--data", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err
    assert code == 2
    assert "--measure-top, --profile-steps, --data: only the measured search runs steps" in err
    assert "--data file not found" in err
    assert main(["tune", "--model", "gpt-tiny", "--ds-config", str(path), "--budget", "6MiB", "--world-size", "8"]) == 2
    assert "use --gpu NAME to search for more ranks" in capsys.readouterr().err
