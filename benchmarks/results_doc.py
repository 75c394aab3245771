"""docs/results.md from the committed JSONs: one current table per model and configuration, each
rendered by the benchmark script that wrote its JSON and naming that script's command and the JSON.

    .venv/bin/python benchmarks/results_doc.py            # rewrite docs/results.md
    .venv/bin/python benchmarks/results_doc.py --check    # exit 1 when docs/results.md is stale

Nothing here measures: every figure comes from a JSON under ``benchmarks/results/``. A rerun of a
benchmark rewrites its JSON, this script the page (``tests/structure/test_results_doc.py`` fails when
the page is not what the JSONs give). Earlier runs stay in git history and in the JSONs ``SECTIONS``
does not list; the README quotes a few figures of this page, each with its command and JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = "benchmarks/results"
OUTPUT = os.path.join(ROOT, "docs", "results.md")
sys.path.insert(0, HERE)


@dataclasses.dataclass(frozen=True)
class Section:
    """One table: ``script``'s ``render`` over the JSON(s) ``jsons`` (their ``"rows"`` concatenated
    when several), under ``title``, with ``note`` (one line on how to read it) below the sources."""

    title: str
    script: str
    jsons: tuple[str, ...]
    note: str = ""
    command: Optional[str] = None
    """The command, where the JSON does not record it whole."""


CPU = "2 ranks over gloo on CPU"
GPT_162M = "162M GPT (`gpt:layers=12,hidden=768,heads=12,seq=256,vocab=50304`)"
SECTIONS: tuple[tuple[str, tuple[Section, ...]], ...] = (
    ("gpt-small (3.3M parameters), ZeRO-2 bf16, " + CPU, (
        Section("Every plugin alone, every preset and the tools users pick today, against plain DeepSpeed",
                "results_table", ("results_table.json",),
                "Ratios against DeepSpeed with hand-tuned buckets. Step times on a shared 2-core CPU are noisy: "
                "compare rows of one run only. The row `preset aggressive (memory_budget 0.25x)` was rerun since; "
                "its current figures are the next table's."),
        Section("aggressive under 0.25x of the hand-tuned peak (rerun with grad_release's host states and tiled "
                "recompute)", "results_table", ("results_table_aggressive_025_tiled.json",)),
        Section("Each preset at ZeRO-2 and ZeRO-3, no memory_budget", "presets_zero", ("presets_zero.json",)),
    )),
    (GPT_162M + ", bf16, " + CPU, (
        Section("ZeRO-2: every preset under its budget, every side in one run", "presets_zero",
                ("presets_zero_162m_bf16_rounds.json",),
                "balanced keeps its masters as 8-bit remainders since this run and conservative under a 0.5x "
                "budget keeps its optimizer states on the host: their current rows are the next two tables."),
        Section("ZeRO-2: balanced with 8-bit master remainders (plain's row from the run above)", "presets_zero",
                ("presets_zero_162m_bf16_masters8.json",)),
        Section("ZeRO-2: conservative under half the plain peak, optimizer states on the host (`states: auto`)",
                "presets_zero", ("presets_zero_162m_bf16_states_auto.json",)),
        Section("ZeRO-3: every preset under its budget, every side in one run", "presets_zero",
                ("presets_zero3_162m_bf16_conservative.json",),
                "balanced hands its 8-bit remainders to DeepSpeed's masters since this run: its current row is "
                "the next table's."),
        Section("ZeRO-3: balanced with 8-bit master remainders (plain's row from the run above)", "presets_zero",
                ("presets_zero3_162m_bf16_masters8.json",)),
    )),
    (GPT_162M + ", fp32, " + CPU, (
        Section("Each preset at ZeRO-2 and ZeRO-3, 3 steps, no memory_budget (measured before the chunked head "
                "and the masters as remainders)", "presets_zero", ("presets_zero_162m_fp32.json",)),
    )),
    ("Convergence over 300 steps, gpt-small and llama-small, " + CPU, (
        Section("ZeRO-2", "presets_convergence", ("presets_convergence.json",),
                "Final loss: the mean of the last 10% of steps. aggressive's \"exact masters\" rows and "
                "conservative's predate the latest changes to those presets."),
        Section("ZeRO-3", "presets_convergence", ("presets_convergence_zero3.json",)),
    )),
    ("Every preset in the configurations large runs use (gpt-tiny, save, resume), " + CPU, (
        Section("ZeRO 0-3, offload, bf16/fp16/fp32, clipping, accumulation, client optimizers, compiled models, "
                "settings", "presets_matrix",
                ("presets_matrix.json", "presets_matrix_clients.json", "presets_matrix_compiled.json",
                 "presets_matrix_settings.json"),
                "A regression matrix: its first run found a failure of ours (c36faca), fixed since."),
        Section("The same with each preset's activations.budget_fraction at 0.3", "presets_matrix",
                ("presets_matrix_budget.json",)),
        Section("The ds_config configurations on one rank", "presets_matrix", ("presets_matrix_one_rank.json",)),
    )),
    ("The largest GPT under 128 MiB per rank, ZeRO-2 bf16, " + CPU, (
        Section("Layers at the bench GPT's width (measured before the masters as remainders, the measured "
                "embeddings in int8 and grad_release's link-sized buckets)", "largest_model",
                ("largest_model.json",)),
        Section("The presets' rows rerun with memory_pool on", "largest_model", ("largest_model_presets_pool.json",)),
    )),
    ("The output head and its loss (`chunk`), ZeRO-2 bf16, " + CPU, (
        Section(GPT_162M, "head_loss", ("head_loss.json",)),
        Section("HF's LlamaForCausalLM, vocabulary 32,000", "head_loss", ("head_loss_llama.json",),
                "balanced at 0.5x was refused in this run; its current row is the next table's."),
        Section("HF's LlamaForCausalLM: balanced at 0.5x rerun", "head_loss", ("head_loss_llama_balanced.json",)),
        Section("HF's LlamaForCausalLM under transformers.Trainer, 300 steps", "hf_trainer_head",
                ("hf_trainer_head.json",),
                "Final loss: the mean of the last 30 steps. A rounding-only change of plain (the second row) "
                "moves it by about 1%, so the bound does not resolve a lossless preset here."),
    )),
    ("Estimator error, two small decoders, 1-2 ranks on CPU", (
        Section("68 configurations: ZeRO 0-3, micro-batch 1-8, accumulation, clipping, two Adams, bucket sizes, "
                "bf16/fp32, each section alone and each preset", "estimator_matrix", ("estimator_matrix.json",),
                "A regression matrix, not a hold-out: some of its rows drove estimator fixes "
                "(docs/observability.md says which).",
                command="python benchmarks/estimator_matrix.py --out benchmarks/results/estimator_matrix.json"),
    )),
    ("Megatron-core, examples/megatron_gpt.py, 20 steps, " + CPU, (
        Section("Plain Megatron against the sections (TP=2 unless DP=2 is named)", "megatron_figures",
                ("megatron/summary.json",), "The peak and losses of the last of 20 steps, both ranks.",
                command="python benchmarks/megatron_figures.py"),
    )),
)


def _load(path: str) -> dict:
    with open(os.path.join(ROOT, RESULTS, path), encoding="utf-8") as f:
        return json.load(f)


def _data(section: Section) -> dict:
    """The section's JSON, or its JSONs' rows concatenated (the first one's other keys)."""
    data = _load(section.jsons[0])
    for path in section.jsons[1:]:
        data = {**data, "rows": data["rows"] + _load(path)["rows"]}
    return data


def _commands(section: Section) -> list[str]:
    if section.command:
        return [section.command]
    return [_load(path)["command"] for path in section.jsons]


def render_section(section: Section, renderer: Callable[[dict], str]) -> str:
    table = renderer(_data(section))
    sources = f"JSON: {', '.join(f'`{RESULTS}/{p}`' for p in section.jsons)}."
    commands = [c for c in _commands(section) if c not in table]  # most tables name their command already
    sources += f" Command: {'; '.join(f'`{c}`' for c in commands)}." if commands else ""
    lines = [f"#### {section.title}", "", sources]
    if section.note:
        lines += ["", section.note]
    return "\n".join(lines + ["", table, ""])


def gpu_section(folder: str = "gpu/20261204") -> str:
    """The GPU check's figures (`tools/gpu_check/run.sh`), from its summary and bench JSONs."""
    summary, bench = _load(f"{folder}/summary.json"), _load(f"{folder}/bench.json")
    env = summary["env"]
    lines = [f"## On a GPU: one {env['gpu']}", "",
             f"torch {env['torch']}, CUDA {env['cuda']}, DeepSpeed {env['deepspeed']}, megatron-core "
             f"{env['megatron.core']}. JSON: `{RESULTS}/{folder}/summary.json`, `{RESULTS}/{folder}/bench.json`. "
             f"Command: `tools/gpu_check/run.sh`, then `python tools/gpu_check/summarize.py {RESULTS}/{folder}`.", "",
             f"#### The bench: `{bench['model']}`, ZeRO-2 bf16, {bench['world_size']} GPU, {bench['steps']} steps", "",
             "| side | allocator's peak | tracker's peak (phase) | step time (median) | final loss |",
             "|---|---:|---|---:|---:|"]
    for name, side in bench["sides"].items():
        if "error" in side:
            lines.append(f"| {name} | failed: {side['error'].strip().splitlines()[-1][:120]} | | | |")
            continue
        tracker = max(side["per_rank_peak_bytes"])
        lines.append(f"| {name} | {side['allocator_peak_bytes']:,} B | {tracker:,} B ({side['peak_phase']}) | "
                     f"{side['step_time_median_s'] * 1000:.0f} ms | {side['final_loss']:.4f} |")
    lines += ["", "The preset sides failed on an import (`xirang_ds.plugins` missing when the checkout ran over a "
                  "plain install; fixed since, `tests/structure/test_checkout_import.py`): no preset has a GPU figure "
                  "yet.", "", "#### Megatron-LM's `pretrain_gpt.py` with the patch, 10 iterations", "",
              "| run | loss at 10 | step (median, it. 4+) | allocated after it. 1 | max allocated |",
              "|---|---:|---:|---:|---:|"]
    for name, run in summary["megatron"].items():
        memory = run["memory_mb"]
        last = memory[max(memory, key=int)]
        lines.append(f"| {name} | {run['losses'][-1]:.6f} | {run['step_time_median_ms']:.1f} ms | "
                     f"{memory['1']['allocated_mb']:.2f} MB | {last['max_allocated_mb']:.2f} MB |")
    lines += ["", "The xirang run has int8 optimizer states ([docs/megatron.md](megatron.md#on-a-gpu-megatron-lms-pretrain_gptpy"
                  "-with-the-patch)).", ""]
    return "\n".join(lines)


def render() -> str:
    lines = ["# Results", "",
             "Generated by `python benchmarks/results_doc.py` from the committed JSONs under `benchmarks/results/`; "
             "do not edit by hand. Each table names the command that wrote its JSON. Earlier runs stay in git "
             "history. Memory on CPU is the live-storage tracker's exact bytes, the worst rank's; step times on "
             "the shared CPUs these ran on are noisy.", "", gpu_section(), "## On CPU", ""]
    for heading, sections in SECTIONS:
        lines += [f"### {heading}", ""]
        for section in sections:
            lines.append(render_section(section, importlib.import_module(section.script).render))
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when docs/results.md is not what the JSONs give")
    args = p.parse_args(argv)
    text = render()
    with open(OUTPUT, encoding="utf-8") if os.path.exists(OUTPUT) else open(os.devnull) as f:
        current = f.read()
    if args.check:
        print("stale: run python benchmarks/results_doc.py" if current != text else "up to date")
        return int(current != text)
    if current != text:
        with open(OUTPUT, "w", encoding="utf-8") as f:
            f.write(text)
    print(f"{os.path.relpath(OUTPUT, ROOT)}: {'written' if current != text else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
