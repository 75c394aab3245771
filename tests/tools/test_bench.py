"""xirang-ds bench: the JSON scripts rely on, and bad input."""
import json

from tests.harness.engine_runs import ds_config
from xirang_ds.cli import main


def test_bench_json_interface(tmp_path, corpus_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(ds_config(stage=2, micro=2, xirang={"monitor": {"enabled": True}})))
    out = tmp_path / "b.json"
    args = ["bench", "--model", "gpt-tiny", "--ds-config", str(cfg), "--steps", "3", "--json", str(out)]
    if corpus_path:
        args += ["--data", corpus_path]
    assert main(args) == 0
    result = json.loads(out.read_text())
    for side in ("baseline", "xirang"):
        assert {"peak_bytes", "peak_by_category", "peak_phase", "step_time_median_s", "final_loss"} <= set(result[side])
        assert set(result[side]["peak_by_category"]) == {"parameters", "gradients", "optimizer_states", "activations",
                                                         "comm_buffers", "memory_pool", "temporaries", "host"}
    assert {"peak_ratio", "step_time_ratio", "loss_delta"} <= set(result)
    # the monitor only observes: same memory, same loss
    assert result["peak_ratio"] == 1.0 and result["loss_delta"] == 0.0


def test_bench_compiles_both_sides(tmp_path, corpus_path):
    """``--compile blocks``: each block compiled in place on both sides; offloading compiled blocks (planned at
    their compiled call) lowers the activations and leaves the loss exact."""
    xirang = {"activations": {"enabled": True, "options": ["keep", "offload"], "budget_fraction": 0.6}}
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(ds_config(stage=2, dtype="fp32", micro=2, xirang=xirang)))
    out = tmp_path / "b.json"
    args = ["bench", "--model", "gpt-tiny", "--ds-config", str(cfg), "--steps", "4", "--compile", "blocks",
            "--json", str(out)]
    assert main(args + (["--data", corpus_path] if corpus_path else [])) == 0
    result = json.loads(out.read_text())
    assert result["compile"] == "blocks" and result["loss_delta"] == 0.0
    assert result["activations_peak_ratio"] < 1.0 and "offload" in result["xirang"]["summary"]


def test_bench_bad_input(tmp_path, capsys):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(ds_config()))
    assert main(["bench", "--model", "gpt-tiny", "--ds-config", str(plain)]) == 2
    assert "no \"xirang\" block" in capsys.readouterr().err
    assert main(["bench", "--model", "gpt:layers=1", "--ds-config", str(plain)]) == 2
    assert "missing" in capsys.readouterr().err


def test_report_renders_and_rejects(tmp_path, capsys):
    import torch

    from xirang_ds.memory.timeline import Timeline
    from xirang_ds.memory.tracker import MemoryTracker

    with MemoryTracker("cpu") as t:
        a = torch.empty(100)
        del a
    path = str(tmp_path / "t.json")
    Timeline.from_tracker(t, meta={"step": 1}).save_json(path)
    assert main(["report", path]) == 0
    assert (tmp_path / "t.html").exists() and (tmp_path / "t.png").exists()
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert main(["report", str(bad)]) == 2
    assert "not a xirang timeline" in capsys.readouterr().err
