"""The presets under HF Trainer: HF's ``LlamaForCausalLM`` built from a config (vocab 32,000, hidden
512, 8 layers, sequence 256; its own ``loss_function``), trained by ``Trainer`` with
``TrainingArguments(deepspeed=...)`` and ``xirang_ds.patch_deepspeed()``, as a user's script would.

Each side runs in fresh processes (2 ranks, ZeRO-2 bf16, micro-batch 2, clipping 1.0, AdamW at a
constant 1e-3, the same seeded windows of the corpus): plain DeepSpeed, then each preset under
``memory_budget`` at a fraction of the plain side's measured peak (conservative 0.75x, balanced 0.5x),
and plain DeepSpeed taking each step's samples as two micro-batches of one (accumulation 2): the
same samples and the same arithmetic but for rounding, the noise floor of the loss comparison. The
peak is the tracker's worst-rank peak over the whole run (the planner's profiling steps included),
started from a Trainer callback once the engine exists, as `xirang_ds.bench` does; the step time is
the median step after the first; the loss is the mean over ranks HF Trainer logs, its final value the
mean of the last 10% of steps (`presets_convergence.py`'s rule, against its bounds).

    .venv/bin/python benchmarks/hf_trainer_head.py --steps 300 --world-size 2 \\
        --data ../shared/data/tinyshakespeare.txt --json benchmarks/results/hf_trainer_head.json

``--only WORD`` runs plain DeepSpeed and the rows whose label holds that word; ``--render JSON`` prints
the Markdown table of a saved run.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from head_loss import head_cell, mib  # noqa: E402
from presets_convergence import BOUNDS, final  # noqa: E402
from results_table import load_or_run, short_error  # noqa: E402

BUDGETS = (("conservative", 0.75), ("balanced", 0.5))
LR = 1e-3
NOISE = "plain, micro-batch 1 x accumulation 2"


def _ds_config(block) -> dict:
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "steps_per_print": 10**6,
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto", "torch_adam": True}}}
    if block is not None:
        ds["xirang"] = block
    return ds


def train_rank(rank: int, world: int, block, steps: int, micro: int, accumulation: int, data_path, seed: int) -> dict:
    """One rank of one side under HF Trainer (``micro * accumulation`` samples a step); what it measured."""
    import tempfile

    import torch
    from hf_llama import llama_32k_config
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import xirang_ds
    from xirang_ds.data import load_tokens
    from xirang_ds.memory.engine_roles import watch_engine
    from xirang_ds.memory.tracker import MemoryTracker

    xirang_ds.patch_deepspeed()
    config = llama_32k_config()
    seq = config.max_position_embeddings
    tokens = load_tokens(data_path)  # byte tokens, all below the vocabulary
    starts = torch.randint(0, tokens.numel() - seq, (steps * micro * accumulation * world,),
                           generator=torch.Generator().manual_seed(seed))
    dataset = [{"input_ids": tokens[s:s + seq], "labels": tokens[s:s + seq]} for s in starts.tolist()]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    state: dict = {"times": []}

    class Measure(TrainerCallback):
        """The tracker from the moment the engine exists; each step's wall time."""

        def on_train_begin(self, args, st, control, **kwargs):
            engine = trainer.model_wrapped
            session = getattr(engine, "xirang", None)
            if session is not None:
                tracker = session.track_memory()
            else:
                tracker = MemoryTracker()
                state["watch"] = watch_engine(tracker, engine)
                tracker.start()
            state.update(session=session, tracker=tracker, window=tracker.open_window())

        def on_step_begin(self, args, st, control, **kwargs):
            state["start"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kwargs):
            state["times"].append(time.perf_counter() - state["start"])

    with tempfile.TemporaryDirectory(prefix="xirang-hf-") as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=micro, max_steps=steps, use_cpu=True,
                                 bf16=True, deepspeed=_ds_config(block), learning_rate=LR,
                                 gradient_accumulation_steps=accumulation, weight_decay=0.01,
                                 lr_scheduler_type="constant", max_grad_norm=1.0, seed=seed, report_to=[],
                                 logging_steps=1, save_strategy="no", disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Measure()])
        result = trainer.train()
    report = state["window"].report()
    session = state["session"]
    out = {"peak_bytes": report.peak_bytes, "peak_phase": report.phase, "step_times_s": state["times"],
           "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
           "global_step": result.global_step,
           "figures": session.figures().get("activations", {}) if session is not None else {},
           "summary": session.summary() if session is not None else ""}
    state["window"].close()
    if session is None:
        state["watch"].remove()
        state["tracker"].stop()
    return out


def side(block, args: argparse.Namespace, accumulation: int = 1) -> dict:
    from xirang_ds.launch import run_ranks

    micro = args.micro // accumulation
    ranks = run_ranks(train_rank, args.world_size, block, args.steps, micro, accumulation, args.data, 0)
    worst = max(ranks, key=lambda r: r["peak_bytes"])
    losses = ranks[0]["losses"]  # HF Trainer logs the mean over ranks, the same on every rank
    return {"peak_bytes": worst["peak_bytes"], "peak_phase": worst["peak_phase"],
            "step_time_s": statistics.median(worst["step_times_s"][1:] or worst["step_times_s"]),
            "steps": worst["global_step"], "losses": losses, "final_loss": final(losses),
            "figures": ranks[0]["figures"], "summary": ranks[0]["summary"]}


def run(args: argparse.Namespace) -> dict:
    data = {"command": " ".join(["python", "benchmarks/hf_trainer_head.py"] + sys.argv[1:]),
            "model": "transformers.LlamaForCausalLM(benchmarks.hf_llama.llama_32k_config())", "steps": args.steps,
            "world_size": args.world_size, "micro_batch": args.micro, "rows": []}
    print("plain DeepSpeed under HF Trainer ...", file=sys.stderr, flush=True)
    plain = side(None, args)
    data["rows"].append({"config": "plain", **plain})
    rows = [(NOISE, None, None, 2)]
    for preset, fraction in BUDGETS:
        block = {"preset": preset, "memory_budget": int(fraction * plain["peak_bytes"])}
        rows.append((f"{preset} at {fraction}x the plain peak", preset, block, 1))
    for label, preset, block, accumulation in rows:
        if args.only and not any(word in label for word in args.only):
            continue
        print(f"{label} ...", file=sys.stderr, flush=True)
        row = {"config": label, "preset": preset, "block": copy.deepcopy(block), "accumulation": accumulation}
        try:
            ours = side(block, args, accumulation)
        except Exception as e:  # recorded in the table, the next row still runs
            row["error"] = short_error(e)
        else:
            change = ours["final_loss"] / plain["final_loss"] - 1
            row.update(ours, peak_ratio=ours["peak_bytes"] / plain["peak_bytes"],
                       step_time_ratio=ours["step_time_s"] / plain["step_time_s"], loss_change=change)
            if preset is not None:
                row["within_bound"] = abs(change) <= BOUNDS[preset]
        data["rows"].append(row)
    return data


def render(data: dict) -> str:
    lines = [f"`{data['command']}` (HF Trainer, {data['model']}, micro-batch {data['micro_batch']}, "
             f"{data['world_size']} ranks, {data['steps']} steps)", "",
             "| configuration | peak (worst rank) | peak ratio | step time ratio | final loss (vs plain) | "
             "saved activations | outside the candidates | head |",
             "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        if "error" in row:
            lines.append(f"| {row['config']} | refused: {row['error']} | | | | | | |")
            continue
        figures = row.get("figures") or {}
        bound = f", bound {BOUNDS[row['preset']]:.1%}" if row.get("preset") else ""
        change = f" ({row['loss_change']:+.2%}{bound})" if "loss_change" in row else ""
        ratio = lambda key: f"{row[key]:.2f}x" if key in row else "1.00x"  # noqa: E731
        lines.append(f"| {row['config']} | {mib(row['peak_bytes'])} | {ratio('peak_ratio')} | "
                     f"{ratio('step_time_ratio')} | {row['final_loss']:.4f}{change} | "
                     f"{mib(figures.get('keep_bytes'))} | {mib(figures.get('outside_bytes'))} | "
                     f"{head_cell(figures.get('heads'))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--data", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--render", default=None, help="print the table of a saved JSON")
    parser.add_argument("--only", nargs="+", default=None, metavar="WORD",
                        help="run plain DeepSpeed and the rows whose label holds one of these words")
    args = parser.parse_args()
    print(render(load_or_run(args, run)))


if __name__ == "__main__":
    main()
