"""``xirang-ds bench``: the same model, data and seed trained with plain DeepSpeed (the user's
ds_config without the block) and with the block, side by side in one invocation.

Each side runs in fresh processes (1 or 2 CPU ranks over gloo, or GPUs), so memory figures do not
mix. Memory: every storage is tracked from the end of ``initialize`` over all steps (the live-storage
tracker; on CUDA the allocator's ``max_memory_allocated`` is the peak and the tracker gives the
categories); the peak is the worst rank's. Besides the breakdown at the overall peak, each
category's own highest (``category_peaks``: activations peak at the end of forward even when the
overall peak is in the optimizer step) is reported, worst rank per category. Time: the median step
time after the first step, with the tracker on for both sides. Loss: the mean over ranks of the
last steps' losses. ``peer`` runs a tool users pick today on the plain side (`PEERS`).
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import xirang_ds
from xirang_ds.config.types import format_bytes
from xirang_ds.memory.categories import ACTIVATIONS, CATEGORIES, HOST, OPTIMIZER_STATES
from xirang_ds.memory.device_peak import device_peak
from xirang_ds.memory.host_ledger import ledger
from xirang_ds.step_counts import count_step


@dataclass
class SideResult:
    """One side of the bench (baseline or xirang), worst rank for memory."""

    peak_bytes: int
    peak_by_category: dict[str, int]
    peak_phase: str
    step_time_median_s: float
    final_loss: float
    phase_peaks: dict[str, int] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    per_rank_peak_bytes: list[int] = field(default_factory=list)
    plugin_figures: dict[str, dict] = field(default_factory=dict)
    """What each plugin measured (`Session.figures`, rank 0): e.g. the activation planner's reach,
    the bytes comm_buffers lent to activations per step."""
    allocator_peak_bytes: Optional[int] = None
    summary: str = ""
    category_peaks: dict[str, int] = field(default_factory=dict)
    steady_peak_bytes: Optional[int] = None
    """The tracker's peak over the steps after the first (worst rank): the first step's measuring and
    profiling passes left out, so the steps a long run repeats (None with one step)."""
    steady_peak_by_category: dict[str, int] = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    """Rank 0's step after the measured ones, counted (`step_counts`): what a CPU's step time hides."""
    host_ledger: dict = field(default_factory=dict)
    """The host tiers' bytes as the host holds them (`xirang_ds.memory.host_ledger`), on the rank holding most."""

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def _final_loss(losses: list[float]) -> float:
    tail = max(1, min(10, len(losses) // 5))
    return sum(losses[-tail:]) / tail


def optimizer_step(engine, data) -> float:
    """One optimizer step of a DeepSpeed engine: ``gradient_accumulation_steps`` micro-steps of
    ``engine(x, y)``, ``engine.backward``, ``engine.step`` over ``(input_ids, labels)`` from ``data``.

    Returns:
        The mean of the micro-steps' losses.
    """
    gas = engine.gradient_accumulation_steps()
    total = 0.0
    for _ in range(gas):
        x, y = (t.to(engine.device) for t in next(data))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total += float(loss.detach())
    return total / gas


def timed_step(engine, data) -> tuple[float, float]:
    """`optimizer_step` and its wall time; on CUDA the device is drained before and after, so the
    time is the step's own, not the launches' alone."""
    import torch

    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = optimizer_step(engine, data)
    if cuda:
        torch.cuda.synchronize()
    return loss, time.perf_counter() - start


def _client_optimizer(factory: str):
    def make(model, ds_config: dict):
        params = dict((ds_config.get("optimizer") or {}).get("params") or {})
        params.pop("torch_adam", None)
        params.pop("adam_w_mode", None)
        ds_config = {k: v for k, v in ds_config.items() if k != "optimizer"}
        ds_config["zero_allow_untested_optimizer"] = True  # what DeepSpeed asks users to add for these
        if factory == "torchao_adamw8bit":
            from torchao.optim import AdamW8bit as cls
        elif factory == "torchao_adamw4bit":
            from torchao.optim import AdamW4bit as cls
        else:
            from bitsandbytes.optim import AdamW8bit as cls
        return ds_config, cls(model.parameters(), **params)

    return make


def _checkpoint_blocks(model, ds_config: dict):
    """torch.utils.checkpoint (non-reentrant) around every block, as a user edits model code."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return ds_config, None


def _untracked_step(optimizer, tracker) -> None:
    """torchao's step is torch.compile'd, and Dynamo refuses to trace under a dispatch mode: run it
    with the tracker paused and register its states after each step (the compiled step's own
    temporaries go uncounted)."""
    step = optimizer.step

    def tracked_step(*args, **kwargs):
        with tracker.paused():
            out = step(*args, **kwargs)
        tracker.mark(list(optimizer.state.values()), OPTIMIZER_STATES)
        return out

    optimizer.step = tracked_step


PEERS = {
    "torchao_adamw8bit": _client_optimizer("torchao_adamw8bit"),
    "torchao_adamw4bit": _client_optimizer("torchao_adamw4bit"),
    "bnb_adamw8bit": _client_optimizer("bnb_adamw8bit"),
    "torch_checkpoint": _checkpoint_blocks,
}
"""What users pick today, applied to the plain DeepSpeed side: a low-bit client optimizer built from
the ds_config's ``optimizer`` params, or ``torch.utils.checkpoint`` around every block."""


def bench_rank(rank: int, world: int, model_text: str, ds_config: dict, steps: int, data_path: Optional[str],
               seed: int, use_xirang: bool, peer: Optional[str] = None, compile_as: Optional[str] = None) -> dict:
    """One rank of one side: train ``steps`` optimizer steps and measure (``peer``: a `PEERS` key;
    ``compile_as``: ``"blocks"`` compiles the children of every ``nn.ModuleList`` in place, ``"model"`` the
    whole model before ``initialize``)."""
    import deepspeed
    import torch

    from xirang_ds.data import batches, load_tokens
    from xirang_ds.models import build_model, parse_model_spec

    spec = parse_model_spec(model_text)
    tokens = load_tokens(data_path)
    model = build_model(spec, seed=seed)
    seq, vocab = spec.seq, spec.vocab
    if compile_as == "blocks":  # the children of every ModuleList, each compiled in place
        for block in [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]:
            block.compile()
    init = xirang_ds.initialize if use_xirang else deepspeed.initialize
    optimizer = None
    if peer is not None:
        ds_config, optimizer = PEERS[peer](model, ds_config)
    parameters = model.parameters()
    if compile_as == "model":
        model = torch.compile(model)
    engine, *_ = init(model=model, model_parameters=parameters, config=ds_config, optimizer=optimizer)
    session = getattr(engine, "xirang", None)
    tracker, watch = track_engine(engine)
    if peer is not None and peer.startswith("torchao"):
        _untracked_step(optimizer, tracker)
    cuda = torch.cuda.is_available() and engine.device.type == "cuda"
    device_window = None
    if cuda:
        torch.cuda.synchronize()
        device_window = device_peak().open()  # the monitor's window resets only itself
    window = tracker.open_window()
    data = batches(tokens, engine.train_micro_batch_size_per_gpu(), seq, seed=seed, vocab=vocab, rank=rank,
                   world_size=world)
    losses, times = [], []
    steady = None
    for step in range(steps):
        if step == 1:
            steady = tracker.open_window()
        loss, seconds = timed_step(engine, data)
        times.append(seconds)
        losses.append(loss)
    report = window.report()
    out = {
        "peak_bytes": report.peak_bytes, "peak_by_category": report.by_category, "peak_phase": report.phase,
        "phase_peaks": report.phase_peaks, "losses": losses, "step_times_s": times,
        "allocator_peak_bytes": device_window.peak_bytes if device_window is not None else None,
        "summary": session.summary() if session is not None else "",
        "category_peaks": window.category_peaks(),
    }
    if steady is not None:
        steady_report = steady.report()
        out.update(steady_peak_bytes=steady_report.peak_bytes, steady_peak_by_category=steady_report.by_category)
        steady.close()
    out["plugin_figures"] = session.figures() if session is not None else {}
    out["counts"] = step_counts(engine, data, tracker)  # after the figures: one more step, counted
    out["host_ledger"] = ledger().figures()
    window.close()
    if device_window is not None:
        device_window.close()
    if watch is not None:
        watch.remove()
        tracker.stop()
    elif session is not None:
        session.remove()
    return out


def track_engine(engine) -> tuple:
    """The live-storage tracker of a run: the session's (``engine.xirang``), or for plain DeepSpeed one
    started here with the engine's roles watched. Returns ``(tracker, watch)``; ``watch`` is ``None``
    for the session's, else remove it and stop the tracker when done."""
    from xirang_ds.memory.engine_roles import watch_engine
    from xirang_ds.memory.tracker import MemoryTracker

    session = getattr(engine, "xirang", None)
    if session is not None:
        return session.track_memory(), None
    tracker = MemoryTracker()
    watch = watch_engine(tracker, engine)
    tracker.start()
    return tracker, watch


def step_counts(engine, data, tracker=None) -> dict:
    """One more training step, counted (`xirang_ds.step_counts`): kernels, host syncs, host-link bytes
    by category and the optimizer's kernels per step, named as the bench's JSON gives them."""
    c = count_step(lambda: optimizer_step(engine, data), engine.device, tracker)
    return {"kernels_per_step": c.kernels, "host_syncs_per_step": c.host_syncs, "host_reads_per_step": c.host_reads,
            "link_bytes_per_step": c.link_bytes_total, "link_bytes_by_category": c.link_bytes,
            "optimizer_kernels_per_step": c.optimizer_kernels, "kernels_by_source_per_step": c.kernels_by_source,
            "device_kernels_per_step": c.device_kernels,
            "device_syncs_per_step": c.device_syncs}


def combine(per_rank: list[dict]) -> SideResult:
    """Worst rank for memory, rank-mean for losses, rank-max per step for time."""
    worst = max(per_rank, key=lambda r: r["allocator_peak_bytes"] or r["peak_bytes"])
    steps = len(per_rank[0]["losses"])
    losses = [sum(r["losses"][i] for r in per_rank) / len(per_rank) for i in range(steps)]
    times = [max(r["step_times_s"][i] for r in per_rank) for i in range(steps)]
    timed = times[1:] if len(times) > 1 else times
    return SideResult(
        peak_bytes=worst["allocator_peak_bytes"] or worst["peak_bytes"], peak_by_category=worst["peak_by_category"],
        peak_phase=worst["peak_phase"], step_time_median_s=statistics.median(timed), final_loss=_final_loss(losses),
        phase_peaks=worst["phase_peaks"],
        losses=losses, step_times_s=times, per_rank_peak_bytes=[r["peak_bytes"] for r in per_rank],
        allocator_peak_bytes=worst["allocator_peak_bytes"], summary=per_rank[0]["summary"],
        category_peaks={c: max(r["category_peaks"].get(c, 0) for r in per_rank) for c in CATEGORIES},
        plugin_figures=per_rank[0].get("plugin_figures", {}), counts=per_rank[0].get("counts", {}),
        host_ledger=max((r.get("host_ledger") or {} for r in per_rank), key=lambda h: h.get("held_bytes", 0)),
        **_steady(per_rank))


def _steady(per_rank: list[dict]) -> dict:
    """The worst rank's peak over the steps after the first (`SideResult.steady_peak_bytes`)."""
    ranks = [r for r in per_rank if r.get("steady_peak_bytes") is not None]
    if not ranks:
        return {}
    worst = max(ranks, key=lambda r: r["steady_peak_bytes"])
    return {"steady_peak_bytes": worst["steady_peak_bytes"],
            "steady_peak_by_category": worst["steady_peak_by_category"]}


def strip_block(ds_config: dict) -> dict:
    out = copy.deepcopy(ds_config)
    out.pop("xirang", None)
    return out


def run_side(model_text: str, ds_config: dict, steps: int, world_size: int, data_path: Optional[str], seed: int,
             use_xirang: bool, peer: Optional[str] = None, compile_as: Optional[str] = None) -> SideResult:
    from xirang_ds.launch import run_ranks

    threads = max(1, (os.cpu_count() or 2) // world_size)
    per_rank = run_ranks(bench_rank, world_size, model_text, ds_config, steps, data_path, seed, use_xirang, peer,
                         compile_as, threads=threads)
    return combine(per_rank)


def run_bench(model_text: str, ds_config: dict, steps: int = 20, world_size: int = 1,
              data_path: Optional[str] = None, seed: int = 0, baseline_config: Optional[dict] = None,
              compile_as: Optional[str] = None) -> dict:
    """Baseline then xirang; the JSON-ready result with the ratios.

    Args:
        baseline_config: the baseline's ds_config (default: ``ds_config`` without the block).
        compile_as: both sides compile ``"blocks"`` (each in place) or the whole ``"model"`` (``None``: eager).
    """
    from xirang_ds.models import describe_model

    base = run_side(model_text, baseline_config or strip_block(ds_config), steps, world_size, data_path, seed, False,
                    compile_as=compile_as)
    ours = run_side(model_text, ds_config, steps, world_size, data_path, seed, True, compile_as=compile_as)
    return {
        "model": describe_model(model_text), "steps": steps, "world_size": world_size, "seed": seed, "compile": compile_as,
        "data": data_path or "stdlib docstrings",
        "baseline": base.as_dict(), "xirang": ours.as_dict(),
        "peak_ratio": ours.peak_bytes / base.peak_bytes,
        "activations_peak_ratio": (ours.category_peaks[ACTIVATIONS] / base.category_peaks[ACTIVATIONS]
                                   if base.category_peaks.get(ACTIVATIONS) else None),
        "step_time_ratio": ours.step_time_median_s / base.step_time_median_s,
        "loss_delta": ours.final_loss - base.final_loss,
    }


def format_result(result: dict) -> str:
    """The side-by-side table."""
    base, ours = result["baseline"], result["xirang"]
    rows = [("", "baseline", "xirang", "ratio")]
    for c in CATEGORIES:
        a, b = base["peak_by_category"].get(c, 0), ours["peak_by_category"].get(c, 0)
        if a or b:
            rows.append((c, format_bytes(a), format_bytes(b), f"{b / a:.2f}" if a else "-"))
    for c in (ACTIVATIONS, HOST):
        a, b = base.get("category_peaks", {}).get(c, 0), ours.get("category_peaks", {}).get(c, 0)
        if a or b:
            rows.append((f"{c} peak (own moment)", format_bytes(a), format_bytes(b), f"{b / a:.2f}" if a else "-"))
    rows.append(("peak (worst rank)", f"{format_bytes(base['peak_bytes'])}", f"{format_bytes(ours['peak_bytes'])}",
                 f"{result['peak_ratio']:.2f}"))
    rows.append(("peak phase", base["peak_phase"], ours["peak_phase"], ""))
    rows.append(("step time (median)", f"{base['step_time_median_s'] * 1000:.0f} ms",
                 f"{ours['step_time_median_s'] * 1000:.0f} ms", f"{result['step_time_ratio']:.2f}"))
    rows.append(("final loss", f"{base['final_loss']:.4f}", f"{ours['final_loss']:.4f}",
                 f"{result['loss_delta']:+.4f}"))
    for key, label in (("kernels_per_step", "kernels per step"), ("host_syncs_per_step", "host syncs per step"),
                       ("link_bytes_per_step", "host-link bytes per step"),
                       ("optimizer_kernels_per_step", "optimizer kernels per step")):
        a, b = base.get("counts", {}).get(key), ours.get("counts", {}).get(key)
        if a is not None and b is not None:
            rows.append((label, f"{a:,}", f"{b:,}", f"{b / a:.2f}" if a else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"bench: {result['model']}, {result['world_size']} rank(s), {result['steps']} steps, "
             f"data: {os.path.basename(str(result['data']))}"]
    if result.get("compile"):
        lines.append(f"both sides torch.compile the {result['compile']}; on CPU the tracker counts what compiled "
                     "code keeps (saved tensors, outputs), not its transient buffers")
    for i, r in enumerate(rows):
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if ours.get("summary"):
        lines += ["", ours["summary"]]
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


def append_jsonl(path: str, record: dict) -> None:
    """Add ``record`` as one JSON line of ``path``, flushed and synced before returning: results kept
    as they come, so a run cut by a time limit or killed keeps every record it finished."""
    line = json.dumps(record, default=str)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str) -> list[dict]:
    """Every whole record of ``path`` (none when absent); a line a killed writer left torn is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


__all__ = ["optimizer_step", "run_bench", "run_side", "format_result", "write_json", "append_jsonl", "timed_step", "track_engine", "step_counts", "read_jsonl", "bench_rank", "SideResult", "PEERS"]
