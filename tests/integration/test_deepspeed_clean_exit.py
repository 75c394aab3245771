"""A finished run exits with status 0: xirang_ds.initialize shuts the process groups down before the
interpreter's teardown and drops every reference to them, so their gloo threads are joined. A group left
referenced keeps its threads to the C++ runtime's teardown, where they aborted a rank now and then
(``terminate called without an active exception``)."""
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
def threads():
    return [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
atexit.register(lambda: open(sys.argv[1] + "." + os.environ["LOCAL_RANK"], "w").write(
    ("alive" if dist.is_initialized() else "destroyed") + " " + ",".join(sorted(set(threads())))))
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
    for run in range(2):
        marker = tmp_path / f"exit{run}"
        out = subprocess.run([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(29761 + run),
                              str(script), str(marker)], capture_output=True, text=True, timeout=600, env=env,
                             cwd=str(tmp_path))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        assert "terminate called" not in out.stderr
        # every rank's exit found the groups shut down and freed: no gloo thread left (the script still holds
        # the engine, which held two groups, and torch's collectives held the default one in their defaults)
        assert [(tmp_path / f"exit{run}.{rank}").read_text() for rank in (0, 1)] == ["destroyed python"] * 2


def test_the_walk_drops_every_reference_it_can_change():
    import torch.distributed as dist

    from xirang_ds.integration.process_groups import forget_groups

    group = dist.ProcessGroup(dist.HashStore(), 0, 1)

    class Holder:
        kept = group

    def collective(tensor, group=group):
        return tensor

    def closure():
        return held

    held = {"group": group, "others": [1, group], "set": {group}}
    holder = Holder()
    holder.group = group
    module = type(sys)("a_module")
    module.fn, module.holder, module.closure = collective, holder, closure
    only_in_a_tuple = (group,)
    assert forget_groups([module, only_in_a_tuple]) == 6
    assert (Holder.kept, holder.group, collective.__defaults__, held) == (
        None, None, (None,), {"group": None, "others": [1, None], "set": set()})
    assert only_in_a_tuple == (group,)  # a tuple cannot change: named in the docstring
