"""Train megatron-core's GPTModel (local spec) at tensor-parallel size 2 with the "xirang" block.

    torchrun --nproc_per_node 2 examples/megatron_gpt.py --xirang-config configs/demo.json --steps 20
    python examples/megatron_gpt.py --xirang-config configs/demo.json      # starts 2 CPU ranks itself
    python examples/megatron_gpt.py --steps 20                              # plain Megatron, for comparison

A plain megatron-core loop (parallel_state, GPTModel, Megatron's DDP and optimizer,
``get_forward_backward_func``); the xirang lines are `xirang_megatron.build_session`,
`xirang_megatron.prepare_model` and `xirang_megatron.attach`, and ``--xirang-config`` is registered
by `xirang_megatron.add_arguments`, exactly as in Megatron-LM. The same ds_config file a DeepSpeed
run uses works: only its "xirang" block is read.

On CPU (no CUDA) it installs the test shim ``tests/harness/megatron_shim.py`` for megatron-core's CUDA-only
calls and runs Megatron's fp32 optimizer without gradient clipping by default (``--clip-grad`` sets it).
At the end each rank reports the last step's peak with its per-category breakdown, measured by the
live-storage tracker (the session's when the block turns a tracking plugin on, else one started here
the same way).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Optional

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from xirang_ds.integration import megatron as xirang_megatron  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-model-parallel-size", "--tp", type=int, default=2, dest="tp")
    p.add_argument("--pipeline-model-parallel-size", "--pp", type=int, default=1, dest="pp",
                   help="pipeline stages (Megatron's 1F1B schedule over point-to-point sends)")
    p.add_argument("--world-size", type=int, default=2, help="ranks to start when not under torchrun")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=2, help="gradient accumulation")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=256, help="at least 256 (the data are bytes)")
    p.add_argument("--share-embeddings-and-output-weights", action="store_true", dest="tied",
                   help="the output layer uses the word embedding's weight (GPTModel's argument)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-grad", type=float, default=None,
                   help="OptimizerConfig.clip_grad (default 1.0 on GPU, 0 on CPU)")
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    p.add_argument("--overlap-grad-reduce", action="store_true", help="Megatron DDP's bucketed overlap")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: main parameters and states sharded over data parallel")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism (activations outside the TP regions split over the sequence)")
    p.add_argument("--bf16", action="store_true",
                   help="Megatron's bf16 training: bf16 weights (Float16Module) and fp32 masters in its optimizer")
    p.add_argument("--ddp-bucket-size", type=int, default=None, help="DistributedDataParallelConfig.bucket_size")
    p.add_argument("--data", default=None, help="text file (default: tinyshakespeare if present, else the "
                                                "standard library's docstrings)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="write each rank's losses and memory figures here")
    xirang_megatron.add_arguments(p)
    return p.parse_args(argv)


def build(opts: argparse.Namespace, tp_size: int) -> tuple[Any, Any, Any]:
    """GPTModel (this pipeline stage's layers) → (xirang prepare_model) → Megatron DDP → Megatron
    optimizer → (xirang attach).

    Returns:
        ``(model, optimizer, session)``; ``session`` is None without ``--xirang-config``.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if opts.bf16 else torch.float32
    model_parallel_cuda_manual_seed(opts.seed)
    config = TransformerConfig(
        num_layers=opts.num_layers, hidden_size=opts.hidden_size, num_attention_heads=opts.num_attention_heads,
        ffn_hidden_size=opts.ffn_hidden_size, tensor_model_parallel_size=tp_size, use_cpu_initialization=True,
        hidden_dropout=opts.dropout, attention_dropout=opts.dropout, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,  # the fused kernels need Apex or TE
        pipeline_model_parallel_size=opts.pp, bf16=opts.bf16, params_dtype=dtype,
        sequence_parallel=opts.sequence_parallel,
        pipeline_dtype=dtype if opts.pp > 1 else None)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=opts.vocab_size,
                     max_sequence_length=opts.seq_length, share_embeddings_and_output_weights=opts.tied,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=opts.overlap_grad_reduce,
                                               use_distributed_optimizer=opts.use_distributed_optimizer,
                                               bucket_size=opts.ddp_bucket_size)
    session = xirang_megatron.build_session(opts.xirang_config)
    if session is not None:
        xirang_megatron.prepare_model(session, model, ddp_config)
    if opts.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    model = DistributedDataParallel(config, ddp_config, model)
    clip_grad = opts.clip_grad if opts.clip_grad is not None else (1.0 if on_gpu else 0.0)
    optimizer_config = OptimizerConfig(optimizer="adam", lr=opts.lr, weight_decay=0.01, clip_grad=clip_grad,
                                       use_distributed_optimizer=opts.use_distributed_optimizer, bf16=opts.bf16,
                                       params_dtype=dtype)
    optimizer = get_megatron_optimizer(optimizer_config, [model])
    if session is not None:
        optimizer = xirang_megatron.attach(session, model, optimizer, micro_batch_size=opts.micro_batch_size,
                                           num_microbatches=opts.num_microbatches)
    return model, optimizer, session


def train(opts: argparse.Namespace, inspect: Optional[Callable[[Any, Any, Any], dict]] = None) -> dict:
    """Build, train ``opts.steps`` optimizer steps and measure the last one; this rank's results.

    Args:
        opts: from `parse_args`.
        inspect: ``inspect(model, optimizer, session)`` runs after training, before the session is
            removed; its dict joins the results (the tests count storages independently with it).
    """
    from megatron.core import parallel_state

    model, optimizer, session, make_data = build_loop(opts)
    tracker, watch, run = _tracker(session, model, optimizer)
    data = make_data()
    run_step = step_function(opts, model, optimizer, data)
    losses, times, window = [], [], None
    for step in range(opts.steps):
        if step == opts.steps - 1 and tracker is not None:
            window = tracker.open_window()
        start = time.perf_counter()
        losses.append(run_step())
        times.append(time.perf_counter() - start)
    result = {"losses": losses, "median_step_s": sorted(times)[len(times) // 2],
              "rank": torch.distributed.get_rank(), "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
              "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
              "plugins": [p.section for p in session.plugins] if session else [],
              "summary": session.summary() if session else "plain Megatron (no --xirang-config)"}
    if window is not None:
        report = window.report(top=5)
        result["memory"] = report.as_dict()
        result["memory"]["category_peaks"] = window.category_peaks()  # each role's own highest
        window.close()
    if inspect is not None:
        result.update(inspect(model, optimizer, session))
    if session is not None:
        comm = session.plugin("comm_buffers")
        result["decisions"] = dict(comm.decisions) if comm is not None else {}
        session.remove()
    if watch is not None:
        watch.remove()
        run.remove()
        tracker.stop()
    return result


def build_loop(opts: argparse.Namespace) -> tuple[Any, Any, Any, Callable[[], Any]]:
    """`build`, Megatron's schedule hooks on the model config, and this rank's batches.

    Returns:
        ``(model, optimizer, session, make_data)``; ``make_data()`` returns an iterator of
        ``(inputs, labels)`` micro-batches, from the first.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from xirang_ds.data import batches, find_default_corpus, load_tokens

    tokens = load_tokens(opts.data or find_default_corpus())  # host data, loaded before any tracking
    model, optimizer, session = build(opts, parallel_state.get_tensor_model_parallel_world_size())
    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    if opts.overlap_grad_reduce:
        config.no_sync_func = model.no_sync
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def make_data() -> Any:
        return batches(tokens, opts.micro_batch_size, opts.seq_length, seed=opts.seed, rank=dp_rank,
                       world_size=dp_size)

    return model, optimizer, session, make_data


def step_function(opts: argparse.Namespace, model: Any, optimizer: Any, data: Any) -> Callable[[], float]:
    """One optimizer step per call over ``data`` (``opts.num_microbatches`` micro-batches through
    Megatron's ``get_forward_backward_func``); each call returns the step's mean loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model.parameters()).device
    seq = opts.seq_length
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(opts.micro_batch_size, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1).view(1, 1, seq, seq)

    def forward_step(data_iterator: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
        inputs, labels = (t.to(device) for t in next(data_iterator))
        output = chunk(inputs, position_ids, mask, labels=labels)  # per-token loss [b, s]

        def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss = out.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    forward_backward = get_forward_backward_func()

    def run_step() -> float:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        micro = forward_backward(forward_step_func=forward_step, data_iterator=data, model=[model],
                                 num_microbatches=opts.num_microbatches, seq_length=seq,
                                 micro_batch_size=opts.micro_batch_size, forward_only=False)
        optimizer.step()
        return _stage_loss(micro)

    return run_step


def _stage_loss(micro: list) -> float:
    """The step's mean loss; under pipeline parallelism only the last stage has it, and it sends it to
    the other stages of its pipeline."""
    from megatron.core import parallel_state

    loss = torch.tensor(sum(float(m["lm loss"]) for m in micro) / len(micro) if micro else 0.0, dtype=torch.float64)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(loss, parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=parallel_state.get_pipeline_model_parallel_group())
    return float(loss)


def _tracker(session: Any, model: Any, optimizer: Any) -> tuple[Any, Any, Any]:
    """The live-storage tracker on CPU: the session's, else one driven the same way (`watch_run`)."""
    if torch.cuda.is_available():
        return None, None, None
    if session is not None:
        return session.track_memory(), None, None
    from xirang_ds.integration.megatron_run import MegatronRun, watch_run
    from xirang_ds.memory.tracker import MemoryTracker

    tracker = MemoryTracker("cpu")
    run = MegatronRun([model], optimizer)
    watch = watch_run(tracker, run)
    tracker.start()
    return tracker, watch, run


def setup(rank: int, world: int, tp: int, pp: int = 1) -> bool:
    """Process group (if none yet) and Megatron's parallel state; on CPU, the test shim first.

    Returns:
        True when this call created the process group (`teardown` then destroys it).
    """
    import torch.distributed as dist

    if not torch.cuda.is_available():
        from tests.harness.megatron_shim import install

        install()
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return created


def teardown(created: bool) -> None:
    """Undo `setup`: Megatron's parallel state, and the process group if `setup` created it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def run_rank(rank: int, world: int, opts: argparse.Namespace) -> dict:
    """One rank of `main` under `xirang_ds.launch.run_ranks`: `setup`, `train`, `teardown`."""
    created = setup(rank, world, opts.tp, opts.pp)
    try:
        return train(opts)
    finally:
        teardown(created)


def report(results: list[dict]) -> str:
    """Per-rank lines: final loss, step peak and its breakdown by category."""
    lines = [results[0]["summary"]]
    for r in results:
        lines.append(f"rank {r['rank']} (tp rank {r['tp_rank']}): final loss {r['losses'][-1]:.4f}, "
                     f"median step {r['median_step_s'] * 1000:.0f} ms")
        memory = r.get("memory")
        if memory:
            cats = ", ".join(f"{k} {v:,}" for k, v in memory["peak_by_category"].items() if v)
            lines.append(f"  last step peak {memory['peak_bytes']:,} bytes in {memory['peak_phase']}: {cats}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    opts = parse_args(argv)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        setup(rank, world, opts.tp, opts.pp)
        try:
            mine = train(opts)
            results: list[Any] = [None] * world
            dist.all_gather_object(results, mine)
        finally:
            teardown(created=True)
        if rank != 0:
            return 0
    else:
        from xirang_ds.launch import run_ranks

        results = run_ranks(run_rank, opts.world_size, opts)
    print(report(results))
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
