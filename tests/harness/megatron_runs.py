"""Megatron-core runs for the tests: ranks that drive ``examples/megatron_gpt.py`` (module-level
functions, so ``xirang_ds.launch.run_ranks`` can start them in fresh processes).

Each function sets up Megatron's parallel state once per process and trains several variants in it
with the same seed and data, so their losses and byte counts can be compared exactly.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
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


def write_block(path: str, block: dict, **ds_keys: Any) -> str:
    """A ds_config-style JSON file holding ``block`` as its "xirang" key."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**ds_keys, "xirang": block}, f)
    return path


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def count_storages(model: Any, optimizer: Any, session: Any) -> dict:
    """An independent count of what the tracker should find, by role (`train`'s ``inspect``)."""
    from xirang_ds.integration.megatron_compat import (
        buffer_tensors,
        global_memory_buffer_tensors,
        inner_optimizers,
        parallel_layers,
        unwrap,
    )
    from xirang_ds.memory.engine_roles import optimizer_state_tensors

    grads, _ = buffer_tensors([model])
    states = [t for opt in inner_optimizers(optimizer) for t in optimizer_state_tensors(opt)]
    params = list(model.parameters())
    return {
        "params_bytes": storage_bytes(params),
        "grad_buffer_bytes": storage_bytes(grads),
        "main_grad_numel": sum(p.main_grad.numel() for p in params),
        "states_bytes": storage_bytes(states),
        "arena_bytes": storage_bytes(global_memory_buffer_tensors()),
        "param_shapes": {n: [list(p.shape), bool(getattr(p, "tensor_model_parallel", False)),
                             int(getattr(p, "partition_dim", -1))] for n, p in unwrap(model).named_parameters()},
        "layer_kinds": {name: kind for name, _, kind in parallel_layers(unwrap(model))},
        "buckets": sum(len(group.buckets) for group in model.bucket_groups),
        "bucket_size": model.ddp_config.bucket_size,
        "monitor": list(session.plugin("monitor").history) if session and session.plugin("monitor") else [],
        "profile_files": dict(session.plugin("profiler").files) if session and session.plugin("profiler") else {},
    }


def tp2_runs(rank: int, world: int, tmp: str, steps: int) -> dict:
    """TP=2 on 2 ranks: plain Megatron, then the lossless plugins (comm_buffers, profiler, monitor)."""
    ex = example()
    created = ex.setup(rank, world, 2)
    try:
        common = ["--steps", str(steps), "--overlap-grad-reduce"]
        plain = ex.train(ex.parse_args(common), count_storages)
        block = {"memory_budget": "64MB", "comm_buffers": {"enabled": True},
                 "monitor": {"enabled": True, "warn_at": 0.5, "act_at": 0.9},
                 "profiler": {"enabled": True, "step": 2, "output_dir": os.path.join(tmp, "trace"),
                              "formats": ["json"]}}
        config = write_block(os.path.join(tmp, f"xirang{rank}.json"), block, bf16={"enabled": True})
        xirang = ex.train(ex.parse_args(common + ["--xirang-config", config]), count_storages)
        return {"plain": plain, "xirang": xirang, "removal": removal_check(ex, config)}
    finally:
        ex.teardown(created)


def removal_check(ex: Any, config: str) -> dict:
    """Build with the session attached, remove it, and report what is left on the objects."""
    model, optimizer, session = ex.build(ex.parse_args(["--xirang-config", config, "--overlap-grad-reduce"]), 2)
    session.track_memory()
    wrapped = "step" in vars(optimizer)
    session.remove()
    params = list(model.parameters())
    return {"wrapped_before": wrapped, "step_wrapped_after": "step" in vars(optimizer),
            "session_left_on_model": hasattr(model.module, "xirang"),
            "forward_hooks": len(model._forward_hooks) + len(model._forward_pre_hooks),
            "grad_hooks": sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in params),
            "tracker_active": session.tracker.active}


def dp2_runs(rank: int, world: int, tmp: str, steps: int) -> dict:
    """TP=1 on 2 ranks (data parallel 2): the TP=2 run's reference, and DDP bucket sizing."""
    ex = example()
    created = ex.setup(rank, world, 1)
    try:
        common = ["--steps", str(steps), "--micro-batch-size", "2", "--overlap-grad-reduce"]
        reference = ex.train(ex.parse_args(common), count_storages)
        block = {"comm_buffers": {"enabled": True, "collective_latency_us": 1, "collective_bandwidth_gbps": 1}}
        config = write_block(os.path.join(tmp, f"buckets{rank}.json"), block)
        sized = ex.train(ex.parse_args(common + ["--xirang-config", config]), count_storages)
        return {"reference": reference, "sized": sized}
    finally:
        ex.teardown(created)


def single_rank(rank: int, world: int, tmp: str, cases: dict[str, dict]) -> dict:
    """One rank, TP=1: run each case in Megatron's state; ``{key: its result}``. A key ``name`` or
    ``name:label`` runs ``case_<name>(ex, tmp, **kwargs)`` of this module."""
    ex = example()
    created = ex.setup(rank, world, 1)
    try:
        return {key: globals()[f"case_{key.split(':')[0]}"](ex, tmp, **kwargs) for key, kwargs in cases.items()}
    finally:
        ex.teardown(created)


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


def case_conflicts(ex: Any, tmp: str) -> dict:
    """Conflict rules against real TransformerConfigs and Megatron optimizers: each message, or ''."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from xirang_ds.config.loader import validate_block
    from xirang_ds.config.schema import ActivationsConfig, OptimizerStatesConfig, PrecisionConfig
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

    from xirang_ds.integration.megatron_compat import gradient, parallel_layers

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


ACTIVATION_PLANS = {
    "keep": {"planner": False, "keep": ["decoder.layers.*"]},
    "recompute": {"planner": False, "recompute": ["decoder.layers.*"]},
    "compress": {"planner": False, "compress": ["decoder.layers.*"]},
    "offload": {"planner": False, "offload": ["decoder.layers.*"]},
    "recompute_offload": {"planner": False, "recompute_offload": ["decoder.layers.*"]},
    "recompute_distributed": {"planner": False, "recompute": ["decoder.layers.*"], "distribute_saved_inputs": True},
    "planner": {"budget_fraction": 0.5, "options": ["keep", "recompute", "compress", "offload"]},
}
"""The lossless activation plans `tp2_activations` runs (the ``"activations"`` section of each)."""


def tp2_activations(rank: int, world: int, tmp: str, steps: int, plans: dict[str, dict]) -> dict:
    """TP=2 on 2 ranks with dropout on: plain Megatron, then each activations plan; and full recompute
    with Megatron's RNG tracker left alone in recomputation (the control that shows the restore matters)."""
    import torch

    from xirang_ds.integration import megatron_compat

    ex = example()
    created = ex.setup(rank, world, 2)

    def plan_of(model: Any, optimizer: Any, session: Any) -> dict:
        plugin = session.plugin("activations")
        arena = megatron_compat.global_memory_buffer_tensors()
        distribute = plugin.runtime.distribute
        return {"plan": dict(plugin.plan), "state": plugin.state, "candidates": list(plugin._candidates),
                "sharded_bytes": distribute.sharded_bytes if distribute is not None else 0,
                "layers": [name for name, _ in megatron_compat.transformer_layers(megatron_compat.unwrap(model))],
                "arena_view_packable": [plugin.runtime.eligible(t.view(-1)[: t.numel() // 2]) for t in arena],
                "plain_tensor_packable": plugin.runtime.eligible(torch.ones(4096))}

    try:
        common = ["--steps", str(steps), "--overlap-grad-reduce", "--dropout", "0.1"]
        out = {"plain": ex.train(ex.parse_args(common))}
        for name, section in plans.items():
            block = {"monitor": {"enabled": True}, "activations": {"enabled": True, **section}}
            config = write_block(os.path.join(tmp, f"{name}{rank}.json"), block)
            out[name] = ex.train(ex.parse_args(common + ["--xirang-config", config]), plan_of)
        get, set_ = megatron_compat.rng_tracker_states, megatron_compat.set_rng_tracker_states
        megatron_compat.rng_tracker_states, megatron_compat.set_rng_tracker_states = dict, lambda states: None
        try:
            config = write_block(os.path.join(tmp, f"norng{rank}.json"),
                                 {"monitor": {"enabled": True}, "activations": {"enabled": True,
                                                                                **plans["recompute"]}})
            out["recompute_without_tracker"] = ex.train(ex.parse_args(common + ["--xirang-config", config]))
        finally:
            megatron_compat.rng_tracker_states, megatron_compat.set_rng_tracker_states = get, set_
        out["removal"] = activations_removal(ex, write_block(os.path.join(tmp, f"removal{rank}.json"), {
            "activations": {"enabled": True, **plans["recompute"]}}))
        out["bad_glob"] = config_error(ex, {"activations": {"enabled": True, "planner": False,
                                                            "recompute": ["decoder.layer.*"]}}, tmp)
        out["selective"] = config_error(ex, {"activations": {"enabled": True, "planner": False,
                                                             "selective_recompute": ["decoder.layers.0"]}}, tmp)
        out["distribute_with_sp"] = distribute_with_sequence_parallel()
        return out
    finally:
        ex.teardown(created)


def distribute_with_sequence_parallel() -> str:
    """``distribute_saved_inputs`` on a model whose config has sequence parallelism: the message."""
    from xirang_ds.config.validate import XirangConfigError
    from xirang_ds.integration import megatron as xm

    session = xm.build_session({"xirang": {"activations": {"enabled": True, "planner": False,
                                                           "recompute": ["decoder.layers.*"],
                                                           "distribute_saved_inputs": True}}})
    model = gpt(num_layers=2)
    model.config.sequence_parallel = True  # its layers' inputs are split over TP, not replicated
    try:
        xm.prepare_model(session, model)
        return ""
    except XirangConfigError as e:
        return str(e)
    finally:
        session.remove()


def activations_removal(ex: Any, config: str) -> dict:
    """Build with an activations plan, remove the session: which forwards are still replaced."""
    model, optimizer, session = ex.build(ex.parse_args(["--xirang-config", config]), 2)
    replaced_before = sorted(n for n, m in model.named_modules() if "forward" in vars(m))
    session.remove()
    return {"before": replaced_before, "after": sorted(n for n, m in model.named_modules() if "forward" in vars(m))}


def config_error(ex: Any, block: dict, tmp: str) -> str:
    """The XirangConfigError building with ``block`` gives (``""`` when it builds)."""
    from xirang_ds.config.validate import XirangConfigError

    config = write_block(os.path.join(tmp, f"error{len(os.listdir(tmp))}.json"), block)
    try:
        ex.build(ex.parse_args(["--xirang-config", config]), 2)[2].remove()
    except XirangConfigError as e:
        return str(e)
    return ""


STATE_SCHEDULES = {
    "fp32": {"schedule": [{"dtype": "fp32"}]},
    "int8": {"schedule": [{"dtype": "int8"}]},
    "int4": {"schedule": [{"dtype": "int4"}]},
}
"""The optimizer_states sections `tp2_optimizer_states` runs."""


def _states_inspect(model: Any, optimizer: Any, session: Any) -> dict:
    """Per-rank figures of a run with optimizer_states: formats, bytes, replicated parameters' values."""
    import zlib

    from xirang_ds.integration.megatron_compat import inner_optimizers, unwrap

    out: dict = {"inner": [type(o).__name__ for o in inner_optimizers(optimizer)],
                 "replicated": {n: zlib.crc32(p.detach().numpy().tobytes()) for n, p in unwrap(model).named_parameters()
                                if not getattr(p, "tensor_model_parallel", False)}}
    plugin = session.plugin("optimizer_states") if session else None
    if plugin is not None:
        opts = plugin.optimizers
        quantized = [(o, p) for o in opts for p, s in o.state.items() if s and o.state_format(p) != "fp32"]
        out.update(formats=[o.format_numel() for o in opts], held=sum(o.state_nbytes() for o in opts),
                   quantized_numel=sum(p.numel() for _, p in quantized),
                   quantized_bytes=sum(o.state_nbytes(p) for o, p in quantized),
                   kept=dict(plugin.keep_reasons))
    return out


def tp2_optimizer_states(rank: int, world: int, tmp: str, steps: int, schedules: dict[str, dict]) -> dict:
    """TP=2 on 2 ranks: plain Megatron, then each optimizer_states schedule; a checkpoint round trip
    through Megatron's optimizer state_dict; removal mid-run; bad input."""
    ex = example()
    created = ex.setup(rank, world, 2)
    try:
        common = ["--steps", str(steps), "--overlap-grad-reduce"]
        out = {"plain": ex.train(ex.parse_args(common), _states_inspect)}
        for name, section in schedules.items():
            config = write_block(os.path.join(tmp, f"{name}{rank}.json"),
                                 {"optimizer_states": {"enabled": True, **section}})
            out[name] = ex.train(ex.parse_args(common + ["--xirang-config", config]), _states_inspect)
        config = write_block(os.path.join(tmp, f"resume{rank}.json"), {"optimizer_states": {
            "enabled": True, "stochastic_rounding": True, "schedule": [{"dtype": "fp32", "until_step": 2},
                                                                       {"dtype": "int8"}]}})
        out["resume"] = states_resume(ex, ex.parse_args(["--xirang-config", config]), 3, 2)
        config = write_block(os.path.join(tmp, f"removal{rank}.json"),
                             {"optimizer_states": {"enabled": True, **schedules["fp32"]}})
        out["removal"] = states_removal(ex, ex.parse_args(["--xirang-config", config]), 2)
        out["bad_glob"] = config_error(ex, {"optimizer_states": {"enabled": True, "keep_fp32": ["decoder.layer.*"]}},
                                       tmp)
        return out
    finally:
        ex.teardown(created)


def states_resume(ex: Any, opts: Any, before: int, after: int) -> dict:
    """Train ``before`` steps, save model and Megatron optimizer state dicts, train ``after`` more; then a
    fresh build loads both and trains the same ``after`` steps on the same batches."""
    import copy

    model, optimizer, session, make_data = ex.build_loop(opts)
    run_step = ex.step_function(opts, model, optimizer, make_data())
    for _ in range(before):
        run_step()
    saved_model = copy.deepcopy(model.module.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    continued = [run_step() for _ in range(after)]
    formats = session.plugin("optimizer_states").optimizer.format_numel()
    session.remove()
    model, optimizer, session, make_data = ex.build_loop(opts)
    data = make_data()
    for _ in range(before * opts.num_microbatches):
        next(data)
    model.module.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_optimizer)
    run_step = ex.step_function(opts, model, optimizer, data)
    resumed = [run_step() for _ in range(after)]
    session.remove()
    codes = sorted({str(t.dtype) for st in saved_optimizer["state"].values() for k, t in st.items()
                    if k.endswith("_codes")})
    return {"continued": continued, "resumed": resumed, "formats": formats, "saved_codes": codes}


def states_removal(ex: Any, opts: Any, steps: int) -> dict:
    """Train ``steps`` with the plugin, remove it, train ``steps`` more; and plain Megatron for 2 x ``steps``."""
    model, optimizer, session, make_data = ex.build_loop(opts)
    run_step = ex.step_function(opts, model, optimizer, make_data())
    losses = [run_step() for _ in range(steps)]
    from xirang_ds.integration.megatron_compat import inner_optimizers

    during = [type(o).__name__ for o in inner_optimizers(optimizer)]
    try:
        optimizer.sharded_state_dict({})
        sharded = ""
    except RuntimeError as e:
        sharded = str(e)
    session.remove()
    after = [type(o).__name__ for o in inner_optimizers(optimizer)]
    losses += [run_step() for _ in range(steps)]
    plain_opts = ex.parse_args([])
    model, optimizer, _, make_data = ex.build_loop(plain_opts)
    run_step = ex.step_function(plain_opts, model, optimizer, make_data())
    return {"losses": losses, "plain": [run_step() for _ in range(2 * steps)], "during": during, "after": after,
            "sharded": sharded, "sharded_after_removal": "sharded_state_dict" in vars(optimizer.chained_optimizers[0])}


def tp2_precision(rank: int, world: int, tmp: str, steps: int) -> dict:
    """TP=2 on 2 ranks: plain fp32 Megatron, then xirang.precision (bf16, on-demand weight copies);
    removal; the settings refused under Megatron."""
    from xirang_ds.integration import megatron as xm

    ex = example()
    created = ex.setup(rank, world, 2)

    def rules(model: Any, optimizer: Any, session: Any) -> dict:
        plugin = session.plugin("precision")
        return {"megatron_layers": list(plugin.rules.megatron_layers), "dtype": str(plugin.plan.dtype),
                "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}

    try:
        common = ["--steps", str(steps), "--overlap-grad-reduce"]
        out = {"plain": ex.train(ex.parse_args(common))}
        config = write_block(os.path.join(tmp, f"precision{rank}.json"), {"precision": {"enabled": True}})
        out["bf16"] = ex.train(ex.parse_args(common + ["--xirang-config", config]), rules)
        model, optimizer, session = ex.build(ex.parse_args(["--xirang-config", config]), 2)
        wrapped = sorted(n for n, m in model.named_modules() if vars(m).keys() & {"forward", "compute_language_model_loss"})
        session.remove()
        out["removal"] = {"before": wrapped, "after": sorted(
            n for n, m in model.named_modules() if vars(m).keys() & {"forward", "compute_language_model_loss"})}
        refused = {}
        for key, value in (("dtype", "fp16"), ("weight_copies", "persistent")):
            try:
                xm.build_session({"xirang": {"precision": {"enabled": True, key: value}}})
                refused[key] = ""
            except Exception as e:  # XirangConfigError
                refused[key] = str(e)
        out["refused"] = refused
        return out
    finally:
        ex.teardown(created)


def tp2_memory_pool(rank: int, world: int, tmp: str, steps: int) -> dict:
    """TP=2 on 2 ranks: int8 optimizer states and compressed layer activations, without and with
    memory_pool (``size: auto``); the pool's figures."""
    ex = example()
    created = ex.setup(rank, world, 2)

    def pool_figures(model: Any, optimizer: Any, session: Any) -> dict:
        plugin = session.plugin("memory_pool")
        return {"pool": plugin.figures() if plugin is not None else None}

    try:
        block = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]},
                 "activations": {"enabled": True, "planner": False, "compress": ["decoder.layers.*"]}}
        common = ["--steps", str(steps), "--overlap-grad-reduce"]
        out = {}
        for name, extra in (("without", {}), ("with", {"memory_pool": {"enabled": True}})):
            config = write_block(os.path.join(tmp, f"pool_{name}{rank}.json"), {**block, **extra})
            out[name] = ex.train(ex.parse_args(common + ["--xirang-config", config]), pool_figures)
        return out
    finally:
        ex.teardown(created)
