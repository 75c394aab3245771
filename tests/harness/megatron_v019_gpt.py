"""megatron-core 0.19's GPT on CPU, built the way Megatron-LM core_v0.19 builds it, with and without the block
(and, with ``--launch``, pretrain_gpt.py core_v0.18's or 0.19's main block up to ``pretrain``).

The model comes from ``megatron.training.models.gpt.GPTModelConfig`` and its builder's
``build_distributed_models`` (what ``setup_model_and_optimizer`` calls when ``cfg_container.model`` is
set, training.py core_v0.19.0), with xirang's `PreWrapHook` in ``pre_wrap_hooks`` as
``wrap_launch`` puts it there, then Megatron's DDP and ``get_megatron_optimizer``, then
``prepare_optimizer`` (the call the patch inserts in training.py). Training reuses
``examples/megatron_gpt.py``'s step (Megatron's ``get_forward_backward_func``), tracker and parallel setup.

megatron-core 0.19 ships cp312 wheels only; this runs its sources (an unpacked wheel, ``--megatron-src``)
on Python 3.11 with `megatron_v019_shim` (``typing.override``, the triton-only paged-stash kernels
module) and `megatron_shim` (the CUDA-only calls). Both are recorded with the results.

    python -m tests.harness.megatron_v019_gpt --megatron-src DIR --steps 4 [--xirang-config C] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

import torch

SOURCE_ENV = "XIRANG_MEGATRON_019_SRC"
"""Folder holding megatron-core 0.19's unpacked sources (a ``megatron/`` package with ``training/``)."""
SOURCE_018_ENV = "XIRANG_MEGATRON_018_SRC"
"""The same for megatron-core 0.18 (``--launch`` only: 0.18 builds the model through the provider)."""


def put_sources_first(src: str, needs: str = "megatron/training/models/gpt.py") -> None:
    """Make ``src``'s ``megatron`` the one imported (ahead of the venv's 0.16.1), here and in spawned ranks.

    Args:
        src: an unpacked megatron-core wheel (0.18 and later hold ``megatron/training``).
        needs: a file the run needs there (0.19's model builders by default; 0.18 has none).
    """
    if not os.path.isfile(os.path.join(src, *needs.split("/"))):
        raise FileNotFoundError(f"{src} holds no {needs}: unpack megatron-core's wheel there (pip download "
                                "--no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.19.2, "
                                "then unzip)")
    loaded = sys.modules.get("megatron")  # a namespace package: its __path__, not a __file__
    if loaded is not None and not any(str(p).startswith(os.path.abspath(src)) for p in getattr(loaded, "__path__", [])):
        raise RuntimeError("another megatron is already imported in this process; run this in a fresh one")
    sys.path.insert(0, os.path.abspath(src))
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])


def build(opts: argparse.Namespace, margs: argparse.Namespace) -> tuple[Any, Any, Any]:
    """0.19's GPTModelConfig → builder (pre_wrap_hooks: `PreWrapHook`) → DDP → optimizer → prepare_optimizer."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.models.gpt import GPTModelConfig

    from xirang_ds.integration.megatron import prepare_optimizer
    from xirang_ds.integration.megatron_lm import PreWrapHook

    model_parallel_cuda_manual_seed(opts.seed)
    transformer = TransformerConfig(
        num_layers=opts.num_layers, hidden_size=opts.hidden_size, num_attention_heads=opts.num_attention_heads,
        ffn_hidden_size=opts.ffn_hidden_size, tensor_model_parallel_size=opts.tp, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False)
    model_cfg = GPTModelConfig(transformer=transformer, transformer_layer_spec=get_gpt_layer_local_spec(),
                               vocab_size=opts.vocab_size, seq_length=opts.seq_length)
    model_cfg.finalize()
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=opts.overlap_grad_reduce,
                                               bucket_size=opts.ddp_bucket_size)
    hook = PreWrapHook(ddp_config, get_args=lambda: margs)
    model_cfg.pre_wrap_hooks.append(hook)
    builder = model_cfg.get_builder_cls()(model_cfg)
    model = builder.build_distributed_models(pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                                             ddp_config=ddp_config, wrap_with_ddp=True,
                                             data_parallel_random_init=False)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=opts.lr, weight_decay=0.01,
                                                       clip_grad=0.0), model)
    optimizer = prepare_optimizer(optimizer, model, get_args=lambda: margs)
    return model, optimizer, hook.session


def train(opts: argparse.Namespace) -> dict:
    """This rank's losses, tracker figures and what ran, for ``opts.steps`` steps."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.package_info import __version__

    from tests.harness.megatron_runs import example
    from xirang_ds.data import batches, find_default_corpus, load_tokens

    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    ex = example()
    margs = argparse.Namespace(xirang_config=opts.xirang_config, micro_batch_size=opts.micro_batch_size)
    dp_size = parallel_state.get_data_parallel_world_size()
    init_num_microbatches_calculator(torch.distributed.get_rank(), None,  # as Megatron-LM's initialize does
                                     opts.micro_batch_size * opts.num_microbatches * dp_size, opts.micro_batch_size,
                                     dp_size)
    tokens = load_tokens(find_default_corpus())
    chunks, optimizer, session = build(opts, margs)
    (model,) = chunks
    model.config.finalize_model_grads_func = finalize_model_grads
    data = batches(tokens, opts.micro_batch_size, opts.seq_length, seed=opts.seed,
                   rank=parallel_state.get_data_parallel_rank(), world_size=dp_size)
    tracker, watch, run = ex._tracker(session, model, optimizer)
    run_step = ex.step_function(opts, model, optimizer, data)
    losses, window = [], None
    for step in range(opts.steps):
        if step == opts.steps - 1:
            window = tracker.open_window()
        losses.append(run_step())
    report = window.report(top=5).as_dict()
    window.close()
    result = {"megatron_core": __version__, "megatron_file": sys.modules["megatron.core"].__file__,
              "rank": torch.distributed.get_rank(), "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
              "losses": losses, "peak_bytes": report["peak_bytes"], "peak_by_category": report["peak_by_category"],
              "plugins": [p.section for p in session.plugins] if session else [],
              "model_prepared_by_pre_wrap_hook": (session is not None
                                                  and getattr(model.module, "xirang", None) is session),
              "ddp_bucket_size": model.ddp_config.bucket_size, "optimizer": type(optimizer).__name__}
    undo = [session.remove] if session is not None else []
    undo += [watch.remove, run.remove, tracker.stop] if watch is not None else []
    for call in undo:  # what example().train does after its window
        call()
    destroy_num_microbatches_calculator()
    return result


GPU_KIT_ARGS = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                "--max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 4 --train-iters 10 "
                "--lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 "
                "--clip-grad 1.0 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --bf16 "
                "--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
                "--no-persist-layer-norm --eval-iters 0 --eval-interval 1000000 --log-interval 1 --num-workers 0 "
                "--seed 1234").split()
"""tools/gpu_check/run.sh's pretrain_gpt.py arguments (its ``megatron_args``; the tools test compares)."""


def launch(xirang_config: Optional[str], argv: tuple[str, ...] = tuple(GPU_KIT_ARGS)) -> dict:
    """pretrain_gpt.py's ``__main__`` (core_v0.18 or 0.19, by the sources on the path) up to ``pretrain``,
    in this process, on the real objects of those sources.

    As the patched script does: ``maybe_wrap_for_inprocess_restart(pretrain)``, `wrap_launch`, then
    ``parse_and_validate_args`` over ``argv`` (the GPU kit's arguments) plus ``--xirang-config``, the
    config container (``pretrain_cfg_container_from_args``; at 0.19 with ``gpt_config_from_args``'s model
    config) and the wrapped ``pretrain`` with the script's arguments (0.18 passes a model provider, 0.19
    none); ``pretrain`` itself (CUDA from its first line) is stood in for by a recorder with its
    signature. Returns what each stage left.
    """
    import inspect

    from tests.harness import megatron_v019_shim

    set_aside = megatron_v019_shim.install()
    from megatron.core.package_info import __version__
    from megatron.training import inprocess_restart, pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from xirang_ds.compat.megatron import megatron_lm_launch
    from xirang_ds.integration.megatron import ModelProvider
    from xirang_ds.integration.megatron_lm import PreWrapHook, wrap_launch

    sys.argv = ["pretrain_gpt.py", *argv, *(["--xirang-config", xirang_config] if xirang_config else [])]
    pretrain, _ = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    shape = megatron_lm_launch(pretrain)
    seen: dict = {}

    def recorder(*args: Any, **kwargs: Any) -> None:
        seen.update(inspect.signature(recorder).bind(*args, **kwargs).arguments)

    recorder.__signature__ = inspect.signature(pretrain)
    wrapped, parse = wrap_launch(recorder, parse_and_validate_args)
    args = parse(extra_args_provider=None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    if shape == "config_builder":  # pretrain_gpt.py core_v0.19: the model from a config, no provider
        from megatron.training.argument_utils import gpt_config_from_args

        full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        wrapped(full_config, "datasets_provider", "encoder_or_decoder", "forward_step", store=None,
                get_embedding_ranks=None)
    else:  # core_v0.18: the container without a model config, and the script's model provider
        full_config = pretrain_cfg_container_from_args(args)
        wrapped(full_config, "datasets_provider", lambda pre_process=True, post_process=True: None,
                "encoder_or_decoder", "forward_step", store=None, get_embedding_ranks=None)
    model_cfg = getattr(full_config, "model", None)
    hooks = [h for h in getattr(model_cfg, "pre_wrap_hooks", None) or [] if isinstance(h, PreWrapHook)]
    return {"megatron_core": __version__, "launch": shape, "xirang_config": args.xirang_config,
            "pre_wrap_hooks": [type(h).__name__ for h in getattr(model_cfg, "pre_wrap_hooks", None) or []],
            "hook_sizes_the_container_ddp": bool(hooks) and hooks[0].ddp_config is full_config.ddp,
            "model_provider_passed": "model_provider" in seen,
            "model_provider_wrapped": isinstance(seen.get("model_provider"), ModelProvider),
            "set_aside": set_aside}


def run_rank(rank: int, world: int, opts: argparse.Namespace) -> dict:
    """One rank: the shims, Megatron's parallel state over gloo, `train`."""
    from tests.harness import megatron_v019_shim

    set_aside = megatron_v019_shim.install()
    from tests.harness.megatron_runs import example

    ex = example()
    created = ex.setup(rank, world, opts.tp)
    try:
        return {**train(opts), "set_aside": set_aside}
    finally:
        ex.teardown(created)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-src", default=os.environ.get(SOURCE_ENV), help=f"default ${SOURCE_ENV}")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--ddp-bucket-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--xirang-config", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--launch", action="store_true", help="only `launch`: pretrain_gpt.py's main block up to pretrain")
    opts = p.parse_args(argv)
    if not opts.megatron_src:
        p.error(f"--megatron-src (or ${SOURCE_ENV}) is required: megatron-core 0.19's unpacked wheel")
    return opts


def main(argv: Optional[list[str]] = None) -> int:
    from xirang_ds.launch import run_ranks

    opts = parse_args(argv)
    needs = "megatron/training/arguments.py" if opts.launch else "megatron/training/models/gpt.py"
    put_sources_first(opts.megatron_src, needs)
    if opts.launch:
        result = launch(opts.xirang_config)
        print(json.dumps(result))
        return 0
    results = run_ranks(run_rank, opts.world_size, opts)
    for r in results:
        print(f"rank {r['rank']} (tp {r['tp_rank']}) megatron-core {r['megatron_core']}: plugins {r['plugins']}, "
              f"losses {['%.6f' % x for x in r['losses']]}, last-step peak {r['peak_bytes']:,} bytes")
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            block = None
            if opts.xirang_config:
                with open(opts.xirang_config, encoding="utf-8") as cfg:
                    block = json.load(cfg).get("xirang")
            json.dump({"command": "python -m tests.harness.megatron_v019_gpt " + " ".join(sys.argv[1:]),
                       "xirang": block, "python": sys.version.split()[0], "torch": torch.__version__,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
