"""benchmarks/presets_matrix.py: one configuration end to end (every side trains, saves and resumes bit for bit),
and how its summary tells xirang's failures from plain DeepSpeed's own."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "presets_matrix.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import presets_matrix  # noqa: E402


def test_one_configuration_trains_saves_and_resumes_every_side(tmp_path):
    """ZeRO-3 with the optimizer offloaded: each preset leaves grad_release and optimizer_states out with its
    line, and every side's resumed step equals its continued one."""
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--only", "zero3 bf16 offload_optimizer gas1 clip", "--json",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["sides"]) == {"plain", "conservative", "balanced", "aggressive"}
    for side, result in row["sides"].items():
        assert "error" not in result, (side, result)
        assert result["resumes_identically"] and len(result["losses"]) == 3
    for preset in presets_matrix.PRESETS:
        said = row["sides"][preset]["said"]
        assert {"grad_release"} <= set(row["sides"][preset]["left_out"])
        assert any(line.startswith("grad_release: left out") for line in said)
    assert row["sides"]["conservative"]["losses"] == row["sides"]["plain"]["losses"]
    assert "0 failed" in proc.stdout


def _row(name, plain, **presets):
    sides = {"plain": plain, **{p: presets.get(p, {"losses": [1.0], "resumes_identically": True, "left_out": []})
                                for p in presets_matrix.PRESETS}}
    return {"name": name, "stage": 3, "offload": "none", "dtype": "bf16", "gas": 1, "clip": 1.0, "sides": sides}


def test_the_summary_counts_only_failures_plain_deepspeed_does_not_share():
    ok = {"losses": [1.0], "resumes_identically": True, "left_out": []}
    rows = [
        _row("zero3 bf16 a", {"error": "boom"}, conservative={"error": "boom"}),  # DeepSpeed's own
        _row("zero3 bf16 b", {"error": "boom"}, balanced={"error": "invalid block", "refused": True}),
        _row("zero3 bf16 c", ok, aggressive={"error": "ours"}),  # a failure of ours
    ]
    table = presets_matrix.render({"rows": rows})
    line = next(line for line in table.splitlines() if line.startswith("| 3 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4].startswith("1 (1 refused at initialize, where plain DeepSpeed fails; 3 failing as plain")
    assert "- zero3 bf16 c, aggressive: ours" in table and "(plain DeepSpeed fails the same way)" in table
    assert presets_matrix.compare({"rows": rows}, {"rows": rows}).startswith("conservative: 2 of 2 runs equal")
