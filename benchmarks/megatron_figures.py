"""The Megatron-core figures of docs/megatron.md for grad_release and distribute_saved_inputs: each run
is ``examples/megatron_gpt.py`` (2 CPU ranks over gloo, 20 steps, the last step measured by the
live-storage tracker) with the arguments and "xirang" block below; each rank's result is written as
given by the example's ``--json``.

    .venv/bin/python benchmarks/megatron_figures.py [--only NAME ...] [--out benchmarks/results/megatron]
    .venv/bin/python benchmarks/megatron_figures.py --render benchmarks/results/megatron/summary.json

The runs' losses are compared in ``summary.json`` (bit-identical where docs/megatron.md says so);
``--render`` prints the Markdown table of a saved run (docs/results.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXAMPLE = os.path.join(ROOT, "examples", "megatron_gpt.py")

GRAD_RELEASE = {"grad_release": {"enabled": True, "bucket_size_numel": 8192}}
THREE = {"precision": {"enabled": True}, "optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]},
         "activations": {"enabled": True, "budget_fraction": 0.5,
                         "options": ["keep", "recompute", "compress", "offload"]}}
RECOMPUTE = {"activations": {"enabled": True, "planner": False, "recompute": ["decoder.layers.*"]}}
DISTRIBUTED = {"activations": {**RECOMPUTE["activations"], "distribute_saved_inputs": True}}
ONE = ["--num-microbatches", "1"]
DP2 = ["--tp", "1", "--micro-batch-size", "2", "--num-microbatches", "1", "--overlap-grad-reduce"]
DEEP = ["--num-layers", "8", "--dropout", "0.1"]

RUNS: dict[str, tuple[list[str], dict | None]] = {
    "tp2_plain_2mb": ([], None),
    "tp2_grad_release_2mb": ([], GRAD_RELEASE),
    "tp2_plain_1mb": (ONE, None),
    "tp2_grad_release_1mb": (ONE, GRAD_RELEASE),
    "dp2_plain_1mb": (DP2, None),
    "dp2_grad_release_1mb": (DP2, GRAD_RELEASE),
    "tp2_three_1mb": (ONE, THREE),
    "tp2_three_grad_release_1mb": (ONE, {**THREE, **GRAD_RELEASE}),
    "tp2_three_2mb": ([], THREE),
    "tp2_three_grad_release_2mb": ([], {**THREE, **GRAD_RELEASE}),
    "tp2_8layers_plain": (DEEP, None),
    "tp2_8layers_recompute": (DEEP, RECOMPUTE),
    "tp2_8layers_recompute_distributed": (DEEP, DISTRIBUTED),
}
SAME_LOSSES = [("tp2_plain_2mb", "tp2_grad_release_2mb"), ("tp2_plain_1mb", "tp2_grad_release_1mb"),
               ("dp2_plain_1mb", "dp2_grad_release_1mb"), ("tp2_three_1mb", "tp2_three_grad_release_1mb"),
               ("tp2_three_2mb", "tp2_three_grad_release_2mb"), ("tp2_8layers_plain", "tp2_8layers_recompute"),
               ("tp2_8layers_plain", "tp2_8layers_recompute_distributed")]


def run(name: str, out: str, steps: int) -> list[dict]:
    args, block = RUNS[name]
    argv = [sys.executable, EXAMPLE, "--steps", str(steps), *args, "--json", os.path.join(out, f"{name}.json")]
    with tempfile.TemporaryDirectory() as tmp:
        if block is not None:
            path = os.path.join(tmp, "block.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"xirang": block}, f)
            argv += ["--xirang-config", path]
        subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, f"{name}.json"), encoding="utf-8") as f:
        return json.load(f)


def render(summary: dict, folder: str = os.path.join(ROOT, "benchmarks", "results", "megatron")) -> str:
    """One row per run of ``summary`` (its ``peak_bytes``; final losses from the runs' own JSONs in
    ``folder``): the peak per rank against plain Megatron with the same arguments."""
    plain = {json.dumps(summary["runs"][n]["args"]): n for n in summary["runs"] if summary["runs"][n]["xirang"] is None}
    same: dict[str, list[str]] = {}
    for pair, equal in summary["same_losses"].items():
        first, second = pair.split(" vs ")
        same.setdefault(second, []).extend([first] if equal else [])
    lines = ["| run | Megatron arguments | \"xirang\" sections | peak per rank (bytes) | of plain | final loss | "
             "losses bit-identical to |", "|---|---|---|---|---:|---:|---|"]
    for name, run in summary["runs"].items():
        with open(os.path.join(folder, f"{name}.json"), encoding="utf-8") as f:
            loss = json.load(f)[0]["losses"][-1]
        peaks = summary["peak_bytes"][name]
        ref = summary["peak_bytes"][plain[json.dumps(run["args"])]]
        sections = ", ".join(run["xirang"] or {}) or "plain"
        lines.append(f"| {name} | {' '.join(run['args']) or '-'} | {sections} | "
                     f"{' / '.join(f'{p:,}' for p in peaks)} | {max(peaks) / max(ref):.2f}x | {loss:.5f} | "
                     f"{', '.join(same.get(name, [])) or '-'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, choices=sorted(RUNS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "megatron"))
    parser.add_argument("--render", default=None, metavar="JSON", help="print the table of a saved summary.json")
    opts = parser.parse_args()
    if opts.render:
        with open(opts.render, encoding="utf-8") as f:
            print(render(json.load(f), os.path.dirname(os.path.abspath(opts.render))))
        return 0
    os.makedirs(opts.out, exist_ok=True)
    results = {}
    for name in opts.only or RUNS:
        results[name] = run(name, opts.out, opts.steps)
        ranks = results[name]
        print(f"{name:36s} peak per rank {[r['memory']['peak_bytes'] for r in ranks]} "
              f"final loss {ranks[0]['losses'][-1]:.5f}")
    summary = {"steps": opts.steps, "runs": {n: {"args": RUNS[n][0], "xirang": RUNS[n][1]} for n in results},
               "peak_bytes": {n: [r["memory"]["peak_bytes"] for r in rs] for n, rs in results.items()},
               "same_losses": {f"{a} vs {b}": all(x["losses"] == y["losses"] for x, y in zip(results[a], results[b]))
                               for a, b in SAME_LOSSES if a in results and b in results}}
    with open(os.path.join(opts.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["same_losses"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
