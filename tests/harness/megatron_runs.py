"""Megatron-core pieces the sections' Megatron tests share: ``examples/megatron_gpt.py`` as a module, the
block file it reads, a tiny GPTModel, and the memory comparison of two runs.

The rank functions themselves live in each section's ``test_megatron.py`` (module-level, so
``xirang_ds.launch.run_ranks`` can start them in fresh processes). Each sets up Megatron's parallel
state once per process and trains several variants in it with the same seed and data, so their losses
and byte counts can be compared exactly.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

EXAMPLE = os.path.join(ROOT, "examples", "megatron_gpt.py")


def example() -> Any:
    """``examples/megatron_gpt.py`` as a module (loaded once per process)."""
    name = "xirang_example_megatron_gpt"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def write_block(path: str, block: dict, **ds_keys: Any) -> str:
    """A ds_config-style JSON file holding ``block`` as its "xirang" key."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**ds_keys, "xirang": block}, f)
    return path


def gpt(num_layers: int = 4, **config: Any) -> Any:
    """A tiny megatron-core GPTModel (local spec) with ``config`` overriding ``TransformerConfig`` fields."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(0)
    tc = TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                           use_cpu_initialization=True, gradient_accumulation_fusion=False,
                           bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                           persist_layer_norm=False, apply_rope_fusion=False, **config)
    return GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256,
                    max_sequence_length=32)


def config_error(ex: Any, block: dict, tmp: str, argv: tuple[str, ...] = (), tp: int = 2) -> str:
    """The XirangConfigError building with ``block`` (and the example's ``argv``, at tensor-parallel size
    ``tp``) gives (``""`` when it builds)."""
    from xirang_ds.config.validate import XirangConfigError

    handle, path = tempfile.mkstemp(prefix="error", suffix=".json", dir=tmp)  # ranks may share tmp
    os.close(handle)
    config = write_block(path, block)
    try:
        ex.build(ex.parse_args([*argv, "--xirang-config", config]), tp)[2].remove()
    except XirangConfigError as e:
        return str(e)
    return ""


def prepare_error(block: dict, change: Any) -> str:
    """The XirangConfigError ``prepare_model`` gives for ``block`` on a 2-layer `gpt` that
    ``change(model)`` altered first (``""`` when it prepares)."""
    from xirang_ds.config.validate import XirangConfigError
    from xirang_ds.integration import megatron as xm

    session = xm.build_session({"xirang": block})
    model = gpt(num_layers=2)
    change(model)
    try:
        xm.prepare_model(session, model)
        return ""
    except XirangConfigError as e:
        return str(e)
    finally:
        session.remove()


MODEL_STATE_ROLES = ("parameters", "gradients", "optimizer_states", "comm_buffers")

TIMING_SLACK_BYTES = 64 * 1024
"""How far activations and temporaries move between two identical Megatron runs on gloo: the step
peak's moment shifts with the asynchronous TP/DP collectives (512, 1,024 and 65,536 bytes seen at
the peak in single runs out of several), and even the activations role's own highest moved by
1,024 bytes in one run."""


def assert_same_memory(got: dict, want: dict) -> None:
    """Two runs' tracker figures: model states, gradients and buffers to the byte, at the step peak
    and as each role's own highest; activations, temporaries and the peak within `TIMING_SLACK_BYTES`."""
    for mix in ("peak_by_category", "category_peaks"):
        x, y = got[mix], want[mix]
        assert {k: x.get(k) for k in MODEL_STATE_ROLES} == {k: y.get(k) for k in MODEL_STATE_ROLES}, (mix, x, y)
        for key in set(x) | set(y):
            assert abs(x.get(key, 0) - y.get(key, 0)) <= TIMING_SLACK_BYTES, (mix, key, x, y)
    assert abs(got["peak_bytes"] - want["peak_bytes"]) <= TIMING_SLACK_BYTES, (got["peak_bytes"], want["peak_bytes"])
