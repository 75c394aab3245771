"""tools/gpu_check: ``run.sh --dry-run`` checks what prepare.sh wrote (every wheel the GPU machine
lacks, by name and sha256) and prints the plan, on any machine; ``run.sh --rehearse`` runs every step of
the GPU check on this CPU from the package built and installed as on the GPU machine, so the kit cannot
break unseen; summarize.py reads a run cut short and says what is missing."""
import hashlib
import json
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RUN = os.path.join(ROOT, "tools", "gpu_check", "run.sh")
WHEELS = ("deepspeed-0.19.8-py3-none-any.whl", "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
          "pydantic-2.14.4-py3-none-any.whl", "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl",
          "annotated_types-0.8.0-py3-none-any.whl", "typing_inspection-0.4.5-py3-none-any.whl",
          "hjson-3.1.0-py3-none-any.whl", "typing_extensions-4.16.0-py3-none-any.whl")


def _prepared(tmp_path, wheels=WHEELS):
    """A folder laid out as prepare.sh writes it (wheel contents stand in; the check is by name and sum)."""
    (tmp_path / "wheels").mkdir()
    lines = []
    for name in wheels:
        data = name.encode()
        (tmp_path / "wheels" / name).write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  ./wheels/{name}")
    (tmp_path / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


def _dry_run(gpu_dir):
    env = {**os.environ, "XIRANG_GPU_DIR": str(gpu_dir)}
    return subprocess.run(["bash", RUN, "--dry-run"], capture_output=True, text=True, env=env, timeout=60)


def test_dry_run_prints_the_plan_and_accepts_a_complete_preparation(tmp_path):
    r = _dry_run(_prepared(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    for part in ("pytest -m gpu", "bench_side.py", "pretrain_gpt.py", "optimizer_states_compare.py", "deadline 480 s"):
        assert part in r.stdout
    limits = [int(m) for m in re.findall(r"^  \w+ +(\d+) s ", r.stdout, flags=re.M)]
    assert len(limits) == 6 and sum(limits) <= 420, limits  # 60 s of the 480 s deadline left for the rest
    assert "tests/memory/test_gpu.py" in r.stdout  # the gpu test files are found by their marks
    assert "wheels: all 8 present and matching" in r.stdout
    assert "no .gpu/megatron-lm.tar.gz" in r.stdout  # said, not fatal: the Megatron-LM steps are skipped


def test_dry_run_names_a_missing_wheel_and_a_changed_one(tmp_path):
    gpu = _prepared(tmp_path, [w for w in WHEELS if not w.startswith("hjson")])
    (gpu / "wheels" / WHEELS[0]).write_bytes(b"changed after prepare.sh")
    r = _dry_run(gpu)
    assert r.returncode == 1
    assert "missing wheel: hjson (run tools/gpu_check/prepare.sh)" in r.stdout
    assert "does not match .gpu/MANIFEST.txt" in r.stdout


def test_dry_run_without_a_preparation_says_what_to_run(tmp_path):
    r = _dry_run(tmp_path / "absent")
    assert r.returncode == 1
    assert "run tools/gpu_check/prepare.sh where the registries are reachable" in r.stdout


KIT = os.path.join(ROOT, "tools", "gpu_check")


def _kit_env(tmp_path):
    return {**os.environ, "PYTHON": sys.executable, "XIRANG_GPU_WORK": str(tmp_path / "work")}


def _records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_rehearsal_runs_every_step_from_the_installed_package(tmp_path):
    results = tmp_path / "results"
    r = subprocess.run(["bash", RUN, "--rehearse", str(results)], capture_output=True, text=True,
                       env=_kit_env(tmp_path), timeout=400)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert sorted(os.listdir(results)) == ["megatron_plain.log", "megatron_xirang.log", "pytest.log", "results.jsonl",
                                           "run.log"]  # at most 8 files come back from the device
    records = _records(results / "results.jsonl")
    site = os.path.realpath(tmp_path / "work" / "site")
    (env,) = [x for x in records if x["kind"] == "env"]
    assert env["problems"] == [] and all(path.startswith(site) for path in env["modules"].values())
    assert any(name.startswith("xirang_ds.plugins.") for name in env["modules"])
    sides = {x["side"]: x for x in records if x["kind"] == "side"}
    assert set(sides) == {"plain", "conservative", "balanced", "aggressive"}
    plain = sides["plain"]["peak_bytes"]
    for name, side in sides.items():
        assert "error" not in side, side.get("traceback")
        assert len(side["step_times_s"]) == 5 and len(side["warmup_step_times_s"]) == 3
        assert side["counts"]["kernels_per_step"] > 0 and side["counts"]["device_kernels_per_step"] is None  # no CUDA
        if name != "plain":
            assert side["budget_bytes"] == int(plain * {"conservative": 0.75, "balanced": 0.5, "aggressive": 0.6}[name])
    assert len([x for x in records if x["kind"] == "step"]) == 4 * (3 + 5)
    optimizer = [x for x in records if x["kind"] == "optimizer"][-1]
    assert optimizer["rounds_done"] == 10 and all(row["counts_per_step"]["kernels"] > 0
                                                  for row in optimizer["results"].values())
    (collected,) = [x for x in records if x["kind"] == "collected"]
    assert collected["xirang_ds"].startswith(site) and collected["tests"] > 0
    tests = [x for x in records if x["kind"] == "test"]
    assert len(tests) == collected["tests"] and {t["outcome"] for t in tests} == {"skipped"}  # no CUDA here
    assert {x["side"] for x in records if x["kind"] == "megatron_standin"} == {"plain", "xirang"}
    s = subprocess.run([sys.executable, os.path.join(KIT, "summarize.py"), str(results)], capture_output=True,
                       text=True, timeout=60)
    assert s.returncode == 0 and "missing" not in s.stdout, s.stdout
    summary = json.loads((results / "summary.json").read_text())
    assert summary["missing"] == []
    # every side's estimate beside its measurement (predict.py), priced by the CPU's profile here
    assert set(summary["predicted"]) == set(sides)
    assert all(p["predicted_step_time_s"] > 0 and p["measured_peak_bytes"] == sides[n]["peak_bytes"]
               and p["profile"].startswith("cpu") for n, p in summary["predicted"].items())


def test_summarize_keeps_what_a_cut_run_finished_and_names_what_is_missing(tmp_path):
    lines = [{"kind": "env", "torch": "2.11.0", "cuda_available": True, "gpu": "NVIDIA H200", "problems": []},
             {"kind": "side", "side": "plain", "model": "m", "peak_bytes": 1000, "step_time_median_s": 0.5,
              "final_loss": 5.0, "warmup_step_times_s": [2.0], "counts": {"device_kernels_per_step": 700, "device_syncs_per_step": 4}},
             {"kind": "step", "side": "conservative", "model": "m", "step": 1, "loss": 5.1, "time_s": 0.9},
             {"kind": "side", "side": "balanced", "model": "m", "error": "RuntimeError: CUDA out of memory"},
             {"kind": "collected", "tests": 3, "xirang_ds": "/site/xirang_ds/__init__.py"},
             {"kind": "test", "test": "tests/a.py::t", "outcome": "passed"}]
    text = "".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "test", "test": "tests/a.py::u", "outc'
    (tmp_path / "results.jsonl").write_text(text)  # the last line torn, as a killed writer leaves it
    (tmp_path / "megatron_plain.log").write_text(
        " iteration        1/      10 | elapsed time per iteration (ms): 3100.5 | lm loss: 1.059015E+01 |\n")
    s = subprocess.run([sys.executable, os.path.join(KIT, "summarize.py"), str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert s.returncode == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bench"]["plain"]["peak_bytes"] == 1000
    assert summary["bench"]["conservative"] == {"cut_after_steps": 1, "losses": [5.1], "step_times_s": [0.9]}
    assert summary["megatron"]["plain"]["losses"] == [10.59015]
    assert summary["missing"] == [
        "bench conservative: cut by its limit after 1 step(s)", "bench balanced: failed: RuntimeError: CUDA out of memory",
        "bench aggressive: no record (not started, or cut before its first step)", "optimizer: no record",
        "pytest: 1 of 3 tests finished", "megatron plain: 1 of 10 iterations in the log", "megatron xirang: no log"]


def test_the_imports_step_fails_when_the_checkout_stands_in_for_the_package(tmp_path):
    """What lost the 2026-12-04 run: here xirang_ds comes from the checkout (the editable install), not
    from the folder the kit installed into, and the step says so."""
    results = tmp_path / "results.jsonl"
    env = {**os.environ, "PYTHONPATH": KIT}
    r = subprocess.run([sys.executable, os.path.join(KIT, "imports.py"), str(results), str(tmp_path / "site")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert "not from the installed package" in r.stdout
    (record,) = _records(results)
    assert record["problems"] and record["modules"]["xirang_ds"].startswith(ROOT)
