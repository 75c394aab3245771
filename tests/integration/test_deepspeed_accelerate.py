"""Accelerate with patch_deepspeed(): its ``"auto"`` filling leaves the block alone, and ``accelerate launch``
trains with ``"preset": "auto"``."""
import copy
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")

BIN = os.path.dirname(sys.executable)


def _blocks() -> dict[str, dict]:
    """Every value the block takes: each preset with every key written out (``"auto"`` budgets, sizes, ...)
    and ``"preset": "auto"``."""
    from xirang_ds.config.loader import to_dict, validate_block
    from xirang_ds.config.presets import PRESETS

    blocks = {name: to_dict(validate_block({"preset": name})) for name in PRESETS}
    blocks["auto"] = {"preset": "auto", "sensitivity": "tolerant", "memory_budget": "auto",
                      "activations": {"budget": "auto"}, "memory_pool": {"size": "auto"}}
    return blocks


@pytest.mark.parametrize("name", sorted(_blocks()))
def test_accelerate_fills_its_autos_and_leaves_the_block_as_written(name):
    from accelerate.utils import DeepSpeedPlugin

    import xirang_ds

    block = _blocks()[name]
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
          "xirang": copy.deepcopy(block)}
    plugin = DeepSpeedPlugin(hf_ds_config=ds)
    filled = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0}
    xirang_ds.patch_deepspeed()
    try:
        # as Accelerator._prepare_deepspeed calls it
        plugin.deepspeed_config_process(must_match=False, **filled)
    finally:
        xirang_ds.unpatch_deepspeed()
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 4
    assert plugin.deepspeed_config["xirang"] == block
    # unpatched, Accelerate's own walk is back
    if "auto" in json.dumps(block):
        with pytest.raises(ValueError, match="not found in kwargs"):
            DeepSpeedPlugin(hf_ds_config=ds).deepspeed_config_process(must_match=False, **filled)


SCRIPT = """
import json
import torch
import xirang_ds
from xirang_ds.launch import disable_shm_build

disable_shm_build()
xirang_ds.patch_deepspeed()
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 16)), batch_size=4)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for (x,) in data:
    accelerator.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
print("RESULT " + json.dumps({"preset": model.xirang.config.preset, "steps": model.global_steps}))
accelerator.end_training()
"""


def test_accelerate_launch_with_preset_auto(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6},
        "xirang": {"preset": "auto", "memory_budget": "auto", "activations": {"budget": "auto"}}}))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = subprocess.run([os.path.join(BIN, "accelerate"), "launch", "--num_processes", "1", "--use_deepspeed",
                          "--deepspeed_config_file", "ds.json", "train.py"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result == {"preset": "conservative", "steps": 4}  # auto took the least aggressive preset that fits
