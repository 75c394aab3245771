"""tools/gpu_check: ``run.sh --dry-run`` checks what prepare.sh wrote (every wheel the GPU machine
lacks, by name and sha256) and prints the plan, on any machine."""
import hashlib
import os
import subprocess

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
    for part in ("pytest -m gpu", "bench_presets.py", "pretrain_gpt.py", "deadline 470 s"):
        assert part in r.stdout
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
