"""The GPU check's figures from its results folder, as JSON and a markdown table.

    python tools/gpu_check/summarize.py benchmarks/results/gpu/20261204

Reads what run.sh wrote: env.json, pytest.xml, bench.json and Megatron-LM's logs (its iteration
lines and its "memory (MB)" lines). Writes summary.json beside them and prints the tables. Step
times are medians over iterations 3 and later (the first two build kernels and caches).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
import xml.etree.ElementTree as ET

ITERATION = re.compile(r"iteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)"
                       r".*?lm loss: ([\d.E+-]+)")
MEMORY = re.compile(r"\(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+)")


def megatron(path: str) -> dict:
    """Losses, step times and the allocator's figures of one pretrain_gpt.py log."""
    losses, times, memory = {}, {}, {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if m := ITERATION.search(line):
                losses[int(m[1])], times[int(m[1])] = float(m[3]), float(m[2])
            if m := MEMORY.search(line):
                memory[int(m[1])] = {"allocated_mb": float(m[2]), "max_allocated_mb": float(m[3])}
    later = [t for i, t in times.items() if i >= 3]
    return {"iterations": len(losses), "losses": [losses[i] for i in sorted(losses)],
            "step_time_median_ms": statistics.median(later) if later else None, "memory_mb": memory}


def pytest_counts(path: str) -> dict:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def main(folder: str) -> int:
    def have(name: str) -> str | None:
        path = os.path.join(folder, name)
        return path if os.path.exists(path) else None

    out: dict = {}
    if have("env.json"):
        out["env"] = json.load(open(have("env.json"), encoding="utf-8"))
    if have("pytest.xml"):
        out["pytest"] = pytest_counts(have("pytest.xml"))
    if have("bench.json"):
        bench = json.load(open(have("bench.json"), encoding="utf-8"))
        out["bench"] = {"model": bench["model"], "sides": {
            name: ({"error": side["error"].splitlines()[-1] if "\n" in side["error"] else side["error"]}
                   if "error" in side else {k: side[k] for k in ("peak_bytes", "allocator_peak_bytes", "peak_phase",
                                                                 "step_time_median_s", "final_loss") if k in side}
                   if "peak_bytes" in side else side)
            for name, side in bench["sides"].items()}}
    runs = {name: megatron(have(f"megatron_{name}.log")) for name in ("plain", "xirang") if have(f"megatron_{name}.log")}
    if runs:
        out["megatron"] = runs
    with open(os.path.join(folder, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)

    env = out.get("env", {})
    print(f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
          f"deepspeed {env.get('deepspeed', '?')}, megatron-core {env.get('megatron.core', '?')}")
    if "pytest" in out:
        print(f"pytest -m gpu: {out['pytest']}")
    for name, side in out.get("bench", {}).get("sides", {}).items():
        if "peak_bytes" in side:
            print(f"bench {name}: peak {side['peak_bytes']:,} B, step {side['step_time_median_s'] * 1000:.0f} ms, "
                  f"loss {side['final_loss']:.4f}")
        else:
            print(f"bench {name}: {side.get('error') or side.get('skipped')}")
    if runs:
        print("| pretrain_gpt.py | loss at 10 | step (median, it. 3+) | allocated after it. 1 | max allocated |")
        print("|---|---|---|---|---|")
        for name, r in runs.items():
            mem = r["memory_mb"]
            last = mem[max(mem)] if mem else {}
            print(f"| {name} | {r['losses'][-1]:.6f} | {r['step_time_median_ms']:.1f} ms | "
                  f"{mem.get(1, {}).get('allocated_mb', float('nan')):.2f} MB | "
                  f"{last.get('max_allocated_mb', float('nan')):.2f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
