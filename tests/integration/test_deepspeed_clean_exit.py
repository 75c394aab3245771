"""A finished run exits with status 0: xirang_ds.initialize shuts the process group down before the
interpreter's teardown, where its threads aborted a rank now and then (``terminate called without an
active exception``) when the script did not destroy it."""
import os
import subprocess
import sys

import pytest

BIN = os.path.dirname(sys.executable)

SCRIPT = """
import atexit, os, sys
import torch
import torch.distributed as dist
from xirang_ds.launch import disable_shm_build

disable_shm_build()
import xirang_ds

# registered before initialize, so it runs after xirang's exit handler (last in, first out)
atexit.register(lambda: open(sys.argv[1] + "." + os.environ["LOCAL_RANK"], "w").write(
    "alive" if dist.is_initialized() else "destroyed"))
model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 10))
config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "xirang": {"preset": "aggressive"}}
engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
for _ in range(2):
    x = torch.randn(2, 3, 16, 16, dtype=torch.bfloat16)
    engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), torch.randint(0, 10, (2,))))
    engine.step()
# the end of a user's script: no destroy_process_group()
"""


@pytest.mark.distributed
def test_repeated_runs_exit_cleanly_with_the_group_shut_down(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for run in range(3):
        marker = tmp_path / f"exit{run}"
        out = subprocess.run([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(29761 + run),
                              str(script), str(marker)], capture_output=True, text=True, timeout=600, env=env,
                             cwd=str(tmp_path))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        assert "terminate called" not in out.stderr
        # every rank's exit found the group already shut down
        assert [(tmp_path / f"exit{run}.{rank}").read_text() for rank in (0, 1)] == ["destroyed", "destroyed"]
