"""The example trains under the deepspeed launcher and torchrun (2 CPU ranks) and in one process."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def _run(cmd: list[str], tmp_path) -> str:
    import json

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "xirang": {"preset": "conservative"}}))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd + [os.path.join(ROOT, "examples", "train_gpt.py"), "--ds-config", str(cfg),
                                "--model", "gpt-tiny", "--steps", "2"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.distributed
def test_deepspeed_launcher(tmp_path):
    out = _run([os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", "29731"], tmp_path)
    assert "2 rank(s)" in out and "comm_buffers" in out


@pytest.mark.distributed
def test_torchrun(tmp_path):
    out = _run([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", "29733"], tmp_path)
    assert "2 rank(s)" in out and "comm_buffers" in out


def test_single_process(tmp_path):
    out = _run([sys.executable], tmp_path)
    assert "1 rank(s)" in out
