"""megatron-core 0.19 on this CPU (Python 3.11): Megatron-LM core_v0.19's launch and its GPT at TP=2 with the block.

megatron-core 0.17 and newer ship cp312 wheels only; these tests run 0.19's sources from an unpacked
wheel named by ``XIRANG_MEGATRON_019_SRC`` (skipped without it; 0.18.2's launch test likewise with
``XIRANG_MEGATRON_018_SRC``)::

    pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.19.2 -d /tmp/mcore019
    (cd /tmp/mcore019 && mkdir src && cd src && unzip -q ../megatron_core-0.19.2-*.whl)
    XIRANG_MEGATRON_019_SRC=/tmp/mcore019/src pytest tests/integration/test_megatron_v019.py

Each runs `tests.harness.megatron_v019_gpt` in a fresh process (the venv's megatron-core 0.16.1 must not
be imported there), with `tests.harness.megatron_v019_shim` and `tests.harness.megatron_shim`; what
they set aside is asserted below, so a new one cannot slip in. The PreWrapHook unit tests at the end
need neither the wheel nor a process group.
"""
import argparse
import json
import os
import subprocess
import sys

import pytest

from tests.harness.megatron_v019_gpt import SOURCE_018_ENV, SOURCE_ENV

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SET_ASIDE = ["typing.override", "triton", "CUDA streams"]
"""The first words of each `megatron_v019_shim.SET_ASIDE` entry a run of 0.19.2 uses, in order."""


@pytest.fixture(scope="module")
def src():
    path = os.environ.get(SOURCE_ENV)
    if not path:
        pytest.skip(f"set {SOURCE_ENV} to megatron-core 0.19's unpacked wheel (this module's docstring)")
    if not os.path.isfile(os.path.join(path, "megatron", "training", "models", "gpt.py")):
        pytest.fail(f"{SOURCE_ENV}={path} holds no megatron/training/models/gpt.py")
    return path


def _harness(src, *argv, timeout=600):
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "tests.harness.megatron_v019_gpt", "--megatron-src", src, *argv],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _block(tmp_path, name, block):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"xirang": block}))
    return str(path)


def test_pretrain_gpt_019_main_block_takes_the_flag_and_hooks_the_model_config(src, tmp_path):
    """pretrain_gpt.py core_v0.19's own sequence (in-process-restart wrapper, parse_and_validate_args with the
    GPU kit's arguments, gpt_config_from_args, pretrain_cfg_container_from_args) through wrap_launch."""
    done = _harness(src, "--launch", "--xirang-config", _block(tmp_path, "b", {"preset": "balanced"}))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["launch"] == "config_builder"
    assert result["xirang_config"].endswith("b.json")
    assert result["pre_wrap_hooks"] == ["PreWrapHook"] and result["hook_sizes_the_container_ddp"]
    assert not result["model_provider_passed"] and result["megatron_core"].startswith("0.19.")
    assert [s.split(":")[0] for s in result["set_aside"]] == SET_ASIDE


def test_pretrain_gpt_018_main_block_takes_the_flag_and_wraps_the_model_provider(tmp_path):
    """core_v0.18.2's sequence (the container without a model config, the script's model provider) through
    wrap_launch on megatron-core 0.18.2's own parser and pretrain signature."""
    src = os.environ.get(SOURCE_018_ENV)
    if not src:
        pytest.skip(f"set {SOURCE_018_ENV} to megatron-core 0.18.2's unpacked wheel (as for 0.19.2)")
    done = _harness(src, "--launch", "--xirang-config", _block(tmp_path, "b", {"preset": "balanced"}))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["megatron_core"].startswith("0.18.") and result["launch"] == "config_and_provider"
    assert result["xirang_config"].endswith("b.json") and result["pre_wrap_hooks"] == []
    assert result["model_provider_passed"] and result["model_provider_wrapped"]
    assert [s.split(":")[0] for s in result["set_aside"]] == ["typing.override", "triton (0.18)", "CUDA streams"]


def test_a_bad_block_stops_megatron_lm_019_argument_parsing(src, tmp_path):
    done = _harness(src, "--launch", "--xirang-config", _block(tmp_path, "bad", {"optimizer_states": {"enabld": 1}}))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "argument --xirang-config" in done.stderr and "xirang.optimizer_states.enabld" in done.stderr
    assert "did you mean" in done.stderr


@pytest.mark.distributed
def test_gpt_019_at_tp2_plain_and_with_the_block(src, tmp_path):
    """0.19's GPTModelConfig → builder (PreWrapHook) → DDP → optimizer → prepare_optimizer, 3 steps at TP=2
    on gloo with DDP's overlapped reduction: both ranks agree, the block's plugins run, comm_buffers'
    bucket size reaches 0.19's DDP through cfg_container.ddp (Megatron's default is 40,000,000) and int8
    optimizer states lower the step peak."""
    runs = {}
    link = {"collective_latency_us": 1, "collective_bandwidth_gbps": 1}
    for name, block in (("plain", None),
                        ("block", {"comm_buffers": {"enabled": True, **link}, "monitor": {"enabled": True},
                                   "optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]}})):
        out = tmp_path / f"{name}_results.json"
        argv = ["--steps", "3", "--overlap-grad-reduce", "--json", str(out)]
        if block:
            argv += ["--xirang-config", _block(tmp_path, name, block)]
        done = _harness(src, *argv)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = json.loads(out.read_text())["results"]
    for name, ranks in runs.items():
        assert [r["tp_rank"] for r in ranks] == [0, 1], name
        assert ranks[0]["losses"] == ranks[1]["losses"], name
        assert all(r["megatron_core"].startswith("0.19.") and "/megatron/" in r["megatron_file"] for r in ranks)
        assert all(r["megatron_file"].startswith(src) for r in ranks), "the venv's 0.16.1 was imported"
        assert [s.split(":")[0] for s in ranks[0]["set_aside"]] == SET_ASIDE
    plain, block = runs["plain"][0], runs["block"][0]
    assert plain["plugins"] == [] and not plain["model_prepared_by_pre_wrap_hook"]
    assert block["plugins"] == ["comm_buffers", "optimizer_states", "monitor"]
    assert block["model_prepared_by_pre_wrap_hook"]
    assert plain["ddp_bucket_size"] == 40_000_000 and block["ddp_bucket_size"] == 8192  # the rule's size
    assert abs(block["losses"][-1] - plain["losses"][-1]) < 1e-2 * plain["losses"][-1]  # int8 states
    assert block["peak_by_category"]["optimizer_states"] < plain["peak_by_category"]["optimizer_states"]


# PreWrapHook without the wheel ---------------------------------------------------------------------------
def test_pre_wrap_hook_passes_chunks_through_without_the_flag():
    from xirang_ds.integration.megatron_lm import PreWrapHook

    chunks = [object()]
    hook = PreWrapHook(None, get_args=lambda: argparse.Namespace(xirang_config=None))
    assert hook(chunks) is chunks and hook.session is None


def test_bucket_sizing_follows_megatron_num_buckets():
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig

    from xirang_ds.integration.megatron_lm import _bucket_sizing

    chunk = torch.nn.Linear(10, 10)  # 110 parameters
    ddp = DistributedDataParallelConfig(bucket_size=None)
    ddp.num_buckets = 2  # a field from megatron-core 0.17 on; set here on 0.16.1's dataclass
    sized = _bucket_sizing(ddp, [chunk])
    assert sized.bucket_size == 55 and sized is not ddp and ddp.bucket_size is None
    plain = _bucket_sizing(DistributedDataParallelConfig(bucket_size=4000), [chunk])
    assert plain.bucket_size == 4000


def test_the_gpu_kit_passes_pretrain_gpt_the_arguments_parsed_here():
    """tools/gpu_check/run.sh's pretrain_gpt.py arguments are the ones the launch test parses with 0.19's
    own parser (GPU_KIT_ARGS), so a flag 0.19 dropped fails here, not on the GPU machine."""
    import re
    import shlex

    from tests.harness.megatron_v019_gpt import GPU_KIT_ARGS

    script = open(os.path.join(ROOT, "tools", "gpu_check", "run.sh"), encoding="utf-8").read()
    gpu_branch = script.split("megatron_args=(--steps", 1)[1]
    match = re.search(r"megatron_args=\((.*?)\)\n", gpu_branch, flags=re.S)
    assert match, "no GPU megatron_args in run.sh"
    assert shlex.split(match.group(1).replace("\n", " ")) == GPU_KIT_ARGS
    prepare = open(os.path.join(ROOT, "tools", "gpu_check", "prepare.sh"), encoding="utf-8").read()
    assert 'patch="$root/patches/megatron-lm-core_v0.19.0.patch"' in prepare
