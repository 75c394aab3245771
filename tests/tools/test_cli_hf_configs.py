"""The CLI on what users bring: HF-style ds_configs (``"auto"`` fields, ``"preset": "auto"``) and their own
model factories (``module:factory`` with the run's ``--seq`` and ``--vocab``)."""
import json
import os
import subprocess
import sys

import pytest

from xirang_ds.cli import main

HF_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    "xirang": {"preset": "auto"},
}
SETTINGS = ["--set", "train_micro_batch_size_per_gpu=2", "--set", "gradient_accumulation_steps=1",
            "--set", "gradient_clipping=1.0", "--set", "bf16.enabled=true",
            "--set", "zero_optimization.reduce_bucket_size=65536"]
NEEDED = ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "bf16.enabled",
          "zero_optimization.reduce_bucket_size"]


def _write(tmp_path, config, name="c.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("command", [["validate", "{cfg}", "--model", "gpt-tiny"],
                                     ["estimate", "--model", "gpt-tiny", "--ds-config", "{cfg}"],
                                     ["bench", "--model", "gpt-tiny", "--ds-config", "{cfg}"]])
def test_every_hf_auto_field_that_needs_a_value_is_named_with_its_flag(tmp_path, capsys, command):
    block = {"preset": "auto", "monitor": {"warn_at": 1.5}}  # and the block's own problem beside them
    cfg = _write(tmp_path, {**HF_CONFIG, "xirang": block})
    assert main([c.format(cfg=cfg) for c in command]) == 2
    err = capsys.readouterr().err
    for path in NEEDED:
        assert f"  {path}: \"auto\" is filled by HF Trainer/Accelerate" in err and f"--set {path}=" in err, err
    assert "TrainingArguments.per_device_train_batch_size" in err and "xirang.monitor.warn_at" in err
    # the fields that change no memory are filled, not asked for
    assert "optimizer.params.lr:" not in err and "train_batch_size:" not in err


def test_validate_and_estimate_take_the_values_from_set(tmp_path, capsys):
    cfg = _write(tmp_path, HF_CONFIG)
    assert main(["validate", cfg, "--model", "gpt-tiny", *SETTINGS]) == 0
    out = capsys.readouterr().out
    assert "valid; preset conservative" in out and "preset auto took conservative" in out
    assert 'optimizer.params.lr "auto": 5e-05' in out and 'train_batch_size "auto": left to DeepSpeed' in out
    estimate = tmp_path / "e.json"
    assert main(["estimate", "--model", "gpt-tiny", "--ds-config", cfg, *SETTINGS, "--json", str(estimate)]) == 0
    result = json.loads(estimate.read_text())
    assert result["predicted_peak_bytes"] > 0
    assert any(n.startswith('optimizer.params.weight_decay "auto"') for n in result["notes"])
    assert main(["validate", cfg, "--set", "bf16"]) == 2
    assert "--set: must be KEY=VALUE" in capsys.readouterr().err


def test_bench_takes_preset_auto(tmp_path, corpus_path):
    cfg = _write(tmp_path, HF_CONFIG)
    out = tmp_path / "b.json"
    args = ["bench", "--model", "gpt-tiny", "--ds-config", cfg, "--steps", "2", "--json", str(out), *SETTINGS]
    assert main(args + (["--data", corpus_path] if corpus_path else [])) == 0
    result = json.loads(out.read_text())
    assert "preset auto took conservative" in result["xirang"]["summary"]


FACTORY = """
import json
import torch

from xirang_ds.models import BUILTIN_SPECS, Decoder, with_seq


def make(seq, vocab):
    with open("calls.json", "a") as f:
        f.write(json.dumps({"seq": seq, "vocab": vocab}) + "\\n")
    spec = with_seq(BUILTIN_SPECS["gpt-tiny"], seq)
    return Decoder(type(spec)(**{**spec.__dict__, "vocab": vocab}))


def make_fixed():
    return Decoder(BUILTIN_SPECS["gpt-tiny"])
"""


def _estimate_factory(tmp_path, *flags):
    exe = os.path.join(os.path.dirname(sys.executable), "xirang-ds")
    cfg = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
                            "xirang": {"monitor": {"enabled": True}}})
    out = subprocess.run([exe, "estimate", "--ds-config", cfg, "--json", "e.json", *flags], capture_output=True,
                         text=True, cwd=str(tmp_path), env=dict(os.environ, PYTHONWARNINGS="ignore"))
    return out


def test_a_factory_in_a_module_without_a_dot_gets_the_runs_seq_and_vocab(tmp_path):
    """The console script imports ``mymodel`` from the current directory; the factory is called with the
    flags' sequence length and vocabulary, and the estimate's inputs have that length."""
    (tmp_path / "mymodel.py").write_text(FACTORY)
    out = _estimate_factory(tmp_path, "--model", "mymodel:make", "--seq", "32", "--vocab", "300")
    assert out.returncode == 0, out.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "calls.json").read_text().splitlines()]
    assert calls and all(c == {"seq": 32, "vocab": 300} for c in calls)
    for seq in (16, 64):  # a factory that takes no arguments: the flags still shape the inputs
        out = _estimate_factory(tmp_path, "--model", "mymodel:make_fixed", "--seq", str(seq), "--vocab", "256")
        assert out.returncode == 0, out.stderr[-3000:]
        calls.append(json.loads((tmp_path / "e.json").read_text())["phases"]["forward"]["activations"])
    assert calls[-1] > 3 * calls[-2]


def test_a_factory_without_seq_and_vocab_is_refused_naming_the_flags(tmp_path, capsys):
    (tmp_path / "mymodel2.py").write_text(FACTORY)
    cfg = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "xirang": {"monitor": {"enabled": True}}})
    assert main(["estimate", "--model", "mymodel2:make", "--ds-config", cfg, "--vocab", "300"]) == 2
    err = capsys.readouterr().err
    assert "model factory 'mymodel2:make' needs the run's sequence length and vocabulary: pass --seq" in err
    assert main(["estimate", "--model", "nosuchmodule:make", "--ds-config", cfg, "--seq", "8", "--vocab", "8"]) == 2
    assert "cannot load model factory 'nosuchmodule:make'" in capsys.readouterr().err


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
         "max_position_embeddings": 64, "tie_word_embeddings": False}


def test_an_hf_config_is_estimated_and_planned_for_a_named_gpu(tmp_path, capsys):
    """``--model hf:PATH`` builds the model from its config alone (the config's length and vocabulary unless
    the flags say otherwise); ``--gpu`` prices the plan by that GPU's profile and takes its memory for
    ``memory_budget: auto``; the JSON says whether the block fits and the least budget it meets."""
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA))
    block = {"activations": {"enabled": True, "budget": "auto", "options": ["keep", "offload", "recompute"]}}
    cfg = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                            "zero_optimization": {"stage": 2}, "xirang": block})
    out = str(tmp_path / "e.json")
    assert main(["estimate", "--model", f"hf:{tmp_path / 'llama'}", "--ds-config", cfg, "--gpu", "h100",
                 "--json", out]) == 0
    est = json.loads(open(out).read())
    assert est["fits"] is True and est["least_budget_bytes"] < est["predicted_peak_bytes"]
    plan = est["plans"]["activations"]
    assert plan["device_profile"] == "h100" and set(plan["plan"]) >= {"model.layers.0", "model.layers.1"}
    # a budget below the least: refused in the JSON with the least budget, which then fits
    tight = _write(tmp_path, {**json.loads(open(cfg).read()),
                              "xirang": {**block, "memory_budget": est["least_budget_bytes"] // 2}}, "t.json")
    assert main(["estimate", "--model", f"hf:{tmp_path / 'llama' / 'config.json'}", "--ds-config", tight,
                 "--gpu", "h100", "--seq", "32", "--json", out]) == 0
    refused = json.loads(open(out).read())
    assert refused["fits"] is False and "no activation plan fits" in " ".join(refused["notes"])
    least = _write(tmp_path, {**json.loads(open(cfg).read()),
                              "xirang": {**block, "memory_budget": refused["least_budget_bytes"]}}, "l.json")
    assert main(["estimate", "--model", f"hf:{tmp_path / 'llama'}", "--ds-config", least, "--gpu", "h100",
                 "--seq", "32", "--json", out]) == 0
    assert json.loads(open(out).read())["fits"] is True
    assert main(["estimate", "--model", f"hf:{tmp_path}", "--ds-config", cfg]) == 2  # no config.json there
    assert "no config.json there" in capsys.readouterr().err
