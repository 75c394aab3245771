"""The Megatron integration's input handling: ``--xirang-config`` validated while Megatron-LM parses its
arguments (argparse's error names the flag and every problem), plugins that cannot run under Megatron
refused by name, Megatron settings that clash with the block refused with both named, and the
Megatron-LM glue (`wrap_pretrain`, the model provider, the optimizer hook) in Megatron-LM's order.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.harness.megatron_runs import example, gpt, write_block
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.integration import megatron as xm
from xirang_ds.launch import run_ranks

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _parse(tmp_path, content, capsys):
    path = tmp_path / "cfg.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    parser = xm.add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--xirang-config", str(path)])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def single_rank(rank: int, world: int, tmp: str, cases: dict[str, dict]) -> dict:
    """One rank, TP=1: run each case in Megatron's state; ``{key: its result}``. A key ``name`` or
    ``name:label`` runs ``case_<name>(ex, tmp, **kwargs)`` of this module."""
    ex = example()
    created = ex.setup(rank, world, 1)
    try:
        return {key: globals()[f"case_{key.split(':')[0]}"](ex, tmp, **kwargs) for key, kwargs in cases.items()}
    finally:
        ex.teardown(created)


def case_conflicts(ex: Any, tmp: str) -> dict:
    """Conflict rules against real TransformerConfigs and Megatron optimizers: each message, or ''."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from xirang_ds.config.loader import validate_block
    from xirang_ds.plugins.activations.config import ActivationsConfig
    from xirang_ds.plugins.optimizer_states.config import OptimizerStatesConfig
    from xirang_ds.plugins.precision.config import PrecisionConfig
    from xirang_ds.integration.megatron_conflicts import check_model, check_optimizer

    base = validate_block({})

    def with_activations(**fields: Any) -> Any:
        return dataclasses.replace(base, activations=ActivationsConfig(enabled=True, **fields))

    def message(issues: list) -> str:
        return " | ".join(f"{path}: {text}" for path, text in issues)

    full_block = gpt(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    uniform = gpt(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    selective = gpt(recompute_granularity="selective", recompute_modules=["core_attn"])
    plain = gpt()
    out = {
        "auto_vs_block": message(check_model(with_activations(), full_block)),
        "late_layers_vs_block": message(check_model(
            with_activations(candidates=("decoder.layers.2", "decoder.layers.3")), full_block)),
        "compress_mlp_vs_block": message(check_model(
            with_activations(planner=False, compress=("decoder.layers.1.mlp",)), full_block)),
        "mlp_vs_selective": message(check_model(
            with_activations(planner=False, recompute=("decoder.layers.*.mlp",)), selective)),
        "layer_vs_selective": message(check_model(
            with_activations(planner=False, offload=("decoder.layers.3",)), selective)),
        "auto_vs_uniform": message(check_model(with_activations(), uniform)),
        "auto_vs_none": message(check_model(with_activations(), plain)),
        "disabled_vs_block": message(check_model(base, full_block)),
        "precision_vs_bf16": message(check_model(
            dataclasses.replace(base, precision=PrecisionConfig(enabled=True)), gpt(bf16=True))),
        "precision_vs_fp32": message(check_model(
            dataclasses.replace(base, precision=PrecisionConfig(enabled=True)), plain)),
    }
    ddp = DistributedDataParallel(plain.config, DistributedDataParallelConfig(), plain)
    states = dataclasses.replace(base, optimizer_states=OptimizerStatesConfig(enabled=True))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), [ddp])
    out["states_vs_fp32_adam"] = message(check_optimizer(states, optimizer))
    import torch

    for member in optimizer.chained_optimizers:  # what --use-precision-aware-optimizer --exp-avg-dtype bf16 set
        member.config.use_precision_aware_optimizer = True
        member.config.exp_avg_dtype = torch.bfloat16
    out["states_vs_bf16_exp_avg"] = message(check_optimizer(states, optimizer))
    return out


def case_seams(ex: Any, tmp: str) -> dict:
    """The seams docs/megatron.md gives plugins: the TP layers by kind, and `gradient` before and
    after Megatron's DDP takes the gradients over."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from xirang_ds.compat.megatron import gradient, parallel_layers

    def backward(model: Any) -> None:
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        mask = torch.triu(torch.ones(32, 32, dtype=torch.bool), 1).view(1, 1, 32, 32)
        model(tokens, torch.arange(32).unsqueeze(0).expand(2, 32), mask, labels=tokens).mean().backward()

    plain = gpt(num_layers=1)
    backward(plain)
    wrapped = gpt(num_layers=1)
    ddp = DistributedDataParallel(wrapped.config, DistributedDataParallelConfig(), wrapped)
    backward(ddp)
    return {
        "kinds": {name: kind for name, _, kind in parallel_layers(plain)},
        "plain_is_grad": all(gradient(p) is p.grad is not None for p in plain.parameters()),
        "ddp_grad_dropped": all(p.grad is None for p in wrapped.parameters()),
        "ddp_is_main_grad": all(gradient(p) is p.main_grad for p in wrapped.parameters()),
        "same_values": all(torch.equal(gradient(a), gradient(b))
                           for a, b in zip(plain.parameters(), wrapped.parameters())),
    }


def case_comm_buffers_errors(ex: Any, tmp: str) -> dict:
    """comm_buffers against DistributedDataParallelConfig: explicit values on both sides, no overlap."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from xirang_ds.config.validate import XirangConfigError
    from xirang_ds.integration import megatron as xm

    def attempt(block: dict, **ddp: Any) -> str:
        session = xm.build_session({"xirang": {"comm_buffers": {"enabled": True, **block}}})
        config = DistributedDataParallelConfig(**ddp)
        try:
            xm.prepare_model(session, gpt(num_layers=1), config)
        except XirangConfigError as e:
            return str(e)
        return f"ok bucket_size={config.bucket_size}"

    return {
        "both_set": attempt({"reduce_bucket_size": 5000}, overlap_grad_reduce=True, bucket_size=4000),
        "same_value": attempt({"reduce_bucket_size": 4000}, overlap_grad_reduce=True, bucket_size=4000),
        "user_kept": attempt({}, overlap_grad_reduce=True, bucket_size=4000),
        "no_overlap": attempt({"reduce_bucket_size": 5000}, overlap_grad_reduce=False),
        "no_overlap_auto": attempt({}, overlap_grad_reduce=False),
        "allgather": attempt({"allgather_bucket_size": 5000}, overlap_grad_reduce=True),
    }


def case_megatron_lm_glue(ex: Any, tmp: str, flags: list, block: dict | None = None,
                          global_batch_size: int | None = None) -> dict:
    """Megatron-LM's order of calls with the glue the patch inserts: parse arguments with the
    ``extra_args_provider``, build through the wrapped model provider, let ``get_model``'s bucket
    logic read ``args``, wrap DDP, build the optimizer, call ``prepare_optimizer``, train two steps.
    With ``global_batch_size``, Megatron's micro-batch calculator is initialised first, as
    Megatron-LM's ``initialize_megatron`` does.

    The argument names ``get_model`` reads (``ddp_bucket_size``, ``overlap_grad_reduce``, ...) are
    Megatron-LM's (training.py core_v0.16.1 L1290-1322); its parser is not importable on CPU, so the
    few arguments it would supply are declared here.
    """
    from megatron.core import num_microbatches_calculator as calculator

    if global_batch_size is not None:
        calculator.init_num_microbatches_calculator(0, None, global_batch_size, 2, 1)
    try:
        return _glue(tmp, flags, block)
    finally:
        calculator.destroy_num_microbatches_calculator()


def _glue(tmp: str, flags: list, block: dict | None) -> dict:
    import argparse

    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from xirang_ds.integration import megatron as xm

    parser = argparse.ArgumentParser()
    for flag in ("--ddp-bucket-size", "--ddp-num-buckets", "--micro-batch-size"):
        parser.add_argument(flag, type=int, default=None)
    for flag in ("--overlap-grad-reduce", "--use-distributed-optimizer", "--accumulate-allreduce-grads-in-fp32"):
        parser.add_argument(flag, action="store_true")
    parser = xm.extra_args_provider(None)(parser)
    argv = list(flags)
    if block is not None:
        argv += ["--xirang-config", write_block(os.path.join(tmp, f"glue{len(os.listdir(tmp))}.json"), block)]
    args = parser.parse_args(argv)
    provider = xm.wrap_model_provider(lambda pre_process=True, post_process=True, **_: gpt(num_layers=2),
                                      get_args=lambda: args)
    model = provider(pre_process=True, post_process=True)
    bucket_from_args = args.ddp_bucket_size
    ddp_config = xm.ddp_config_from_args(args, model)
    if ddp_config.bucket_size is None and ddp_config.overlap_grad_reduce:
        ddp_config.bucket_size = 40_000_000  # get_model's default
    chunks = [DistributedDataParallel(model.config, ddp_config, model)]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), chunks)
    optimizer = xm.prepare_optimizer(optimizer, chunks, get_args=lambda: args)
    session = xm.session_of(chunks)
    late = provider(pre_process=True, post_process=True)  # e.g. MoE upcycling's dense copy
    steps = _two_steps(chunks[0], optimizer)
    out = {"session": session is not None, "bucket_from_args": bucket_from_args,
           "late_model_prepared": getattr(late, "xirang", None) is not None, "losses": steps}
    if session is not None:
        out.update(plugins=[p.section for p in session.plugins], global_steps=session.engine.global_steps,
                   micro_batch_size=session.engine.train_micro_batch_size_per_gpu())
        session.remove()
    return out


def _two_steps(model: Any, optimizer: Any) -> list[float]:
    import torch

    seq, batch = 32, 2
    tokens = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1).view(1, 1, seq, seq)
    losses = []
    for _ in range(2):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, position_ids, mask, labels=tokens).mean()
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        losses.append(float(loss))
    return losses


def test_import_stays_light():
    code = ("import sys, xirang_ds, xirang_ds.integration.megatron; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_flag_accepts_the_deepspeed_demo_config():
    path = os.path.join(ROOT, "configs", "demo.json")
    parser = xm.add_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--xirang-config", path]).xirang_config == path
    assert parser.parse_args([]).xirang_config is None


@pytest.mark.parametrize("content, expected", [
    ({"xirang": {"monitor": {"enabled": True, "warn_at": 1.5}}},
     "xirang.monitor.warn_at: must be between 0 and 1; got 1.5"),
    ({"xirang": {"monitor": {"enabled": True, "actions": ["empty_cache", "halve_micro_batch"],
                             "checkpoint_dir": "x"}}},
     "xirang.monitor.actions: 'halve_micro_batch' is not available with Megatron-core (allowed there: "
     "'empty_cache')"),
    ({"xirang": {"grad_release": {"enabled": True, "exact_method": "two_pass"}}},
     "xirang.grad_release.exact_method: xirang.grad_release.exact_method = \"two_pass\" runs backward twice"),
    ({"train_micro_batch_size_per_gpu": 8}, 'has no "xirang" block; add one'),
    ("{not json", "JSON syntax error at line 1"),
])
def test_flag_rejects_bad_config_naming_the_key(tmp_path, capsys, content, expected):
    err = _parse(tmp_path, content, capsys)
    assert "argument --xirang-config:" in err
    assert expected in err


def test_flag_rejects_missing_file(capsys):
    parser = xm.add_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--xirang-config", "no/such/file.json"])
    assert "config file not found: 'no/such/file.json'" in capsys.readouterr().err


def test_extra_args_provider_keeps_the_scripts_own():
    def modelopt_args(parser):
        parser.add_argument("--export-te-mcore-model", action="store_true")
        return parser

    parser = xm.extra_args_provider(modelopt_args)(argparse.ArgumentParser())
    args = parser.parse_args(["--export-te-mcore-model"])
    assert args.export_te_mcore_model and args.xirang_config is None


def test_deepspeed_only_plugin_is_refused_under_megatron():
    from dataclasses import dataclass

    from xirang_ds.config.schema import Section
    from xirang_ds.registry import Plugin, register_plugin, unregister

    @dataclass(frozen=True)
    class OnlyDeepSpeedConfig(Section):
        pass

    @register_plugin(OnlyDeepSpeedConfig, section="only_deepspeed", order=70)
    class OnlyDeepSpeed(Plugin):
        pass

    try:
        with pytest.raises(XirangConfigError) as e:
            xm.build_session({"xirang": {"only_deepspeed": {"enabled": True}}})
        assert ("xirang.only_deepspeed.enabled: the only_deepspeed plugin does not run under megatron yet "
                "(it supports deepspeed); set it to false for megatron runs") in str(e.value)
    finally:
        unregister("only_deepspeed")


def test_no_block_means_no_session():
    assert xm.build_session(None) is None
    assert xm.build_session({"train_micro_batch_size_per_gpu": 4}) is None


def test_session_names_its_framework():
    from xirang_ds.config.loader import validate_block
    from xirang_ds.session import Session

    with pytest.raises(ValueError, match="framework must be one of"):
        Session(validate_block({}), {}, framework="jax")


def test_wrap_pretrain_binds_megatron_lm_arguments():
    """Megatron-LM core_v0.16.1's pretrain parameters (training.py L702-716); the patch test checks
    them against the pinned source when a checkout is available."""
    seen = {}

    def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                 process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},
                 get_embedding_ranks=None, get_position_embedding_ranks=None, non_loss_data_func=None,
                 store=None, inprocess_call_wrapper=None):
        seen.update(model_provider=model_provider, extra_args_provider=extra_args_provider, store=store,
                    model_type=model_type)

    def provider(pre_process=True, post_process=True):
        return "model"

    xm.wrap_pretrain(pretrain)("datasets", provider, "encoder_or_decoder", "forward", store="s",
                               extra_args_provider=None)
    assert isinstance(seen["model_provider"], xm.ModelProvider) and seen["model_provider"].provider is provider
    assert (seen["store"], seen["model_type"]) == ("s", "encoder_or_decoder")
    parser = seen["extra_args_provider"](argparse.ArgumentParser())
    assert parser.parse_args([]).xirang_config is None


def test_wrap_pretrain_refuses_a_pretrain_without_the_providers():
    def pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
                 model_provider=None, store=None):
        # Megatron-LM core_v0.19: arguments parsed before pretrain, the model built from a config
        raise AssertionError("a stand-in: only its signature is read")

    def unknown(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func, store=None):
        # no model provider at all: a shape no tag has
        raise AssertionError("a stand-in: only its signature is read")

    from xirang_ds.compat.megatron import MegatronVersionError

    with pytest.raises(MegatronVersionError) as e:
        xm.wrap_pretrain(pretrain)
    assert not isinstance(e.value, TypeError)  # named, not a bare TypeError from deep inside
    assert ("wrap_pretrain serves Megatron-LM core_v0.16-0.17" in str(e.value)
            and "megatron-core 0.16.1" in str(e.value) and "is core_v0.19 and main" in str(e.value)
            and "apply patches/megatron-lm-core_v0.19.0.patch" in str(e.value))
    with pytest.raises(MegatronVersionError, match=r"pretrain\(cfg_container, .*store\) \(megatron-core 0.16.1\) "
                                                   r"matches none of the shapes xirang supports: core_v0.16-0.17"):
        xm.wrap_pretrain(unknown)


@pytest.fixture(scope="module")
def megatron_cases(tmp_path_factory):
    pytest.importorskip("megatron.core")
    tmp = str(tmp_path_factory.mktemp("megatron_cases"))
    glue = {"comm_buffers": {"enabled": True, "collective_latency_us": 1, "collective_bandwidth_gbps": 1},
            "monitor": {"enabled": True}}
    cases = {
        "conflicts": {},
        "seams": {},
        "comm_buffers_errors": {},
        "megatron_lm_glue": {"flags": ["--overlap-grad-reduce", "--micro-batch-size", "2"], "block": glue},
        "megatron_lm_glue:plain": {"flags": ["--overlap-grad-reduce", "--ddp-bucket-size", "4096"]},
        "megatron_lm_glue:kept": {"flags": ["--overlap-grad-reduce", "--ddp-bucket-size", "4096"], "block": glue},
        "megatron_lm_glue:released": {"flags": ["--overlap-grad-reduce", "--micro-batch-size", "2"],
                                      "block": {"grad_release": {"enabled": True}}, "global_batch_size": 2},
    }
    return run_ranks(single_rank, 1, tmp, cases)[0]


RECOMPUTE_BLOCK = ("TransformerConfig recompute_granularity='full', recompute_method='block', recompute_num_layers=2 "
                   "(Megatron-LM --recompute-granularity full --recompute-method block --recompute-num-layers 2)")


@pytest.mark.distributed
def test_megatron_recompute_clashes_with_activations_on_the_same_layers(megatron_cases):
    c = megatron_cases["conflicts"]
    assert c["auto_vs_block"].startswith("xirang.activations: Megatron recomputes decoder.layers.0, decoder.layers.1 "
                                         f"({RECOMPUTE_BLOCK}) and xirang.activations plans the same modules")
    assert "Drop the Megatron flags and let xirang plan, or limit xirang.activations" in c["auto_vs_block"]
    assert "recomputes decoder.layers.1 (" in c["compress_mlp_vs_block"]
    assert "plans the same modules (decoder.layers.1.mlp)" in c["compress_mlp_vs_block"]
    assert "recomputes decoder.layers.3.self_attention.core_attention (TransformerConfig " \
           "recompute_granularity='selective', recompute_modules=['core_attn'] (Megatron-LM " \
           "--recompute-granularity selective --recompute-modules core_attn))" in c["layer_vs_selective"]
    assert "decoder.layers.0, decoder.layers.1, decoder.layers.2, decoder.layers.3" in c["auto_vs_uniform"]
    # different layers, or nothing recomputed by Megatron, or activations off: no clash
    for case in ("late_layers_vs_block", "mlp_vs_selective", "auto_vs_none", "disabled_vs_block"):
        assert c[case] == "", case


@pytest.mark.distributed
def test_megatron_precision_and_optimizer_settings_clash(megatron_cases):
    c = megatron_cases["conflicts"]
    assert c["precision_vs_bf16"].startswith("xirang.precision.enabled: Megatron casts every weight to 16 bits "
                                             "(TransformerConfig bf16=True (Megatron-LM --bf16)")
    assert c["precision_vs_fp32"] == ""
    assert c["states_vs_fp32_adam"] == ""
    assert ("xirang.optimizer_states.enabled: Megatron already owns the optimizer states (OptimizerConfig "
            "use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16 (Megatron-LM "
            "--use-precision-aware-optimizer --exp-avg-dtype bf16))") in c["states_vs_bf16_exp_avg"]


@pytest.mark.distributed
def test_comm_buffers_against_megatron_bucket_settings(megatron_cases):
    c = megatron_cases["comm_buffers_errors"]
    assert ("xirang.comm_buffers.reduce_bucket_size: is 5,000 but DistributedDataParallelConfig.bucket_size "
            "(Megatron-LM --ddp-bucket-size) is set to 4,000; set one of them") in c["both_set"]
    assert c["same_value"] == c["user_kept"] == "ok bucket_size=4000"
    assert "unless overlap_grad_reduce is on (Megatron-LM --overlap-grad-reduce)" in c["no_overlap"]
    assert c["no_overlap_auto"] == "ok bucket_size=None"
    assert "xirang.comm_buffers.allgather_bucket_size: is 5,000 but Megatron's DDP gathers" in c["allgather"]


@pytest.mark.distributed
def test_megatron_lm_glue_in_megatron_lm_order(megatron_cases):
    glue, plain, kept = (megatron_cases[k] for k in ("megatron_lm_glue", "megatron_lm_glue:plain",
                                                     "megatron_lm_glue:kept"))
    assert glue["session"] and glue["plugins"] == ["comm_buffers", "monitor"]
    assert glue["bucket_from_args"] == 256 * 32  # the rule's size, written to args.ddp_bucket_size
    assert glue["global_steps"] == 2 and glue["micro_batch_size"] == 2
    assert not glue["late_model_prepared"]  # a model built after attach is left alone
    assert not plain["session"] and plain["bucket_from_args"] == 4096
    assert kept["session"] and kept["bucket_from_args"] == 4096  # the user's --ddp-bucket-size wins
    assert glue["losses"] == plain["losses"] == kept["losses"]
    released = megatron_cases["megatron_lm_glue:released"]  # micro-batches from Megatron's calculator
    assert released["plugins"] == ["grad_release"] and released["global_steps"] == 2
    assert released["losses"] == plain["losses"]


@pytest.mark.distributed
def test_seams_for_plugins_on_megatron_layers(megatron_cases):
    c = megatron_cases["seams"]
    assert c["kinds"] == {
        "embedding.word_embeddings": "vocab",
        "decoder.layers.0.self_attention.linear_proj": "row",
        "decoder.layers.0.self_attention.linear_qkv": "column",
        "decoder.layers.0.mlp.linear_fc1": "column",
        "decoder.layers.0.mlp.linear_fc2": "row",
        "output_layer": "column",
    }
    assert c["plain_is_grad"]  # without Megatron's DDP the gradient is param.grad
    assert c["ddp_grad_dropped"] and c["ddp_is_main_grad"]  # under it, param.main_grad; param.grad is None
    assert c["same_values"]


def test_preset_leaves_off_what_megatron_cannot_run_but_not_what_the_user_names(tmp_path):
    resolved = xm.validate_for_megatron({"preset": "balanced"})
    assert resolved.comm_buffers.enabled and resolved.monitor.enabled
    assert resolved.activations.enabled and resolved.optimizer_states.enabled  # both run under Megatron
    assert not resolved.grad_release.enabled and not resolved.memory_pool.enabled
    named = xm.validate_for_megatron({"preset": "balanced", "grad_release": {"enabled": True},
                                      "memory_pool": {"enabled": True}})
    assert named.grad_release.enabled and named.memory_pool.enabled  # run under Megatron when named


def _megatron_preset_table() -> dict:
    """docs/megatron.md's "Presets under Megatron" table: preset -> (runs, left off)."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "megatron.md").read_text(encoding="utf-8")
    section = text.split("### Presets under Megatron", 1)[1].split("\n\n* ", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| ")][1:]
    return {r[0]: (r[1].split(", "), r[2].split(", ")) for r in rows}


@pytest.mark.parametrize("preset", ["conservative", "balanced", "aggressive"])
def test_each_preset_under_megatron_runs_what_the_docs_table_says(preset):
    from xirang_ds import registry
    from xirang_ds.config.presets import PRESETS

    resolved = xm.validate_for_megatron({"preset": preset})
    asked = [n for n, s in PRESETS[preset].items() if isinstance(s, dict) and s.get("enabled")]
    runs = [n for n in asked if getattr(resolved, n).enabled]
    left_off = [n for n in asked if not getattr(resolved, n).enabled]
    assert _megatron_preset_table()[preset] == (runs, left_off)
    for name in runs:  # what runs is built for Megatron, with no key on that does nothing there
        cls = registry.plugin_class(name)
        assert "megatron" in cls.frameworks
        for key, (off, _) in cls.inert_keys.get("megatron", {}).items():
            if off is not None:  # None: no value asks for nothing (refused when written, else the default)
                assert getattr(getattr(resolved, name), key) == off
    for name in left_off:  # left off only where a preset may not turn it on; named, it runs
        cls = registry.plugin_class(name)
        assert "megatron" not in (cls.preset_frameworks if cls.preset_frameworks is not None else cls.frameworks)
        assert getattr(xm.validate_for_megatron({"preset": preset, name: {"enabled": True}}), name).enabled


def test_comm_buffers_keys_that_do_nothing_under_megatron_are_off_or_refused():
    resolved = xm.validate_for_megatron({"preset": "balanced"})  # the preset's arena and adapt
    assert resolved.comm_buffers.enabled and not resolved.comm_buffers.arena and not resolved.comm_buffers.adapt
    sized = xm.validate_for_megatron({"comm_buffers": {"enabled": True, "reduce_bucket_size": 1000, "arena": False}})
    assert sized.comm_buffers.reduce_bucket_size == 1000 and not sized.comm_buffers.adapt
    with pytest.raises(XirangConfigError) as e:
        xm.validate_for_megatron({"preset": "balanced", "monitor": {"warn_at": 1.5},
                                  "comm_buffers": {"adapt": True, "adapt_every_steps": 5, "lend_to_activations": True}})
    text = str(e.value)
    assert "(4 problems)" in text and "xirang.monitor.warn_at" in text  # every problem at once, nothing else
    assert ("xirang.comm_buffers.adapt: true does nothing under Megatron: Megatron's DDP buckets are views of its "
            "grad buffer") in text and "Fix: drop the key (or set it to false) for Megatron runs" in text
    assert "xirang.comm_buffers.adapt_every_steps: 5 does nothing under Megatron" in text
    assert "xirang.comm_buffers.lend_to_activations: true does nothing under Megatron" in text


def test_megatron_lm_checkpoint_formats_optimizer_states_and_grad_release_save_with():
    from xirang_ds.config.loader import validate_block
    from xirang_ds.integration.megatron_conflicts import check_args

    states = validate_block({"optimizer_states": {"enabled": True}})
    for fmt in ("torch", "torch_dist", "zarr"):  # torch_dist: the states go in torch layout (test_megatron.py)
        assert check_args(states, argparse.Namespace(save="/ckpt", ckpt_format=fmt)) == []
    issues = check_args(states, argparse.Namespace(save="/ckpt", ckpt_format="torch_dcp"))
    assert issues == [("xirang.optimizer_states.enabled",
                       "Megatron-LM would save with --ckpt-format torch_dcp, which does not build the optimizer's "
                       "sharded_state_dict where optimizer_states writes its states in torch layout; use "
                       "--ckpt-format torch_dist or torch, or set xirang.optimizer_states.enabled to false")]
    assert check_args(states, argparse.Namespace(save=None, ckpt_format="torch_dcp")) == []  # nothing saved
    assert check_args(validate_block({}), argparse.Namespace(save="/ckpt", ckpt_format="torch_dist")) == []
    released = validate_block({"grad_release": {"enabled": True}})
    issues = check_args(released, argparse.Namespace(save="/ckpt", ckpt_format="torch_dist"))
    assert [field for field, _ in issues] == ["xirang.grad_release.enabled"]
    assert "use --ckpt-format torch, or set xirang.grad_release.enabled to false" in issues[0][1]
    assert check_args(released, argparse.Namespace(save="/ckpt", ckpt_format="torch")) == []
