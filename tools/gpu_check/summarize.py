"""The GPU check's figures from its results folder, whole or cut short, and what is missing.

    python tools/gpu_check/summarize.py benchmarks/results/gpu/<date>

Reads what run.sh wrote: results.jsonl (the machine and imports, every bench side and its steps, the
optimizer's rounds, every test) and Megatron-LM's logs (iteration lines, "memory (MB)" lines). Writes
summary.json beside them (with ``"missing"``: each expected result that is absent or cut, and why
where the records say) and prints the tables. Megatron step times are medians over iterations 4 and
later (the first three build kernels and caches). A folder of the 2026-12-04 layout (bench.json,
pytest.xml) is read too. Exit status 0 when nothing is missing.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
import xml.etree.ElementTree as ET
from typing import Any, Optional

ITERATION = re.compile(r"iteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)"
                       r".*?lm loss: ([\d.E+-]+)")
MEMORY = re.compile(r"\(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+)"
                    r"(?: \| reserved: ([\d.]+) \| max reserved: ([\d.]+))?")
SIDES = ("plain", "conservative", "balanced", "aggressive")
MEGATRON = ("plain", "xirang")
WARMUP_ITERATIONS = 3


def megatron(path: str) -> dict[str, Any]:
    """Losses, step times and the allocator's figures of one pretrain_gpt.py log."""
    losses, times, memory = {}, {}, {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if m := ITERATION.search(line):
                losses[int(m[1])], times[int(m[1])] = float(m[3]), float(m[2])
            if m := MEMORY.search(line):
                memory[int(m[1])] = {"allocated_mb": float(m[2]), "max_allocated_mb": float(m[3]),
                                     "reserved_mb": float(m[4]) if m[4] else None,
                                     "max_reserved_mb": float(m[5]) if m[5] else None}
    later = [t for i, t in times.items() if i > WARMUP_ITERATIONS]
    return {"iterations": len(losses), "losses": [losses[i] for i in sorted(losses)],
            "step_time_median_ms": statistics.median(later) if later else None,
            "steps_in_median": len(later), "memory_mb": memory}


def _records(path: str) -> list[dict]:
    """Every whole record; the line a killed writer left half-written is skipped."""
    from xirang_ds.bench import read_jsonl

    return read_jsonl(path)


def _side(record: dict) -> dict:
    if "error" in record:
        return {"error": record["error"]}
    keep = ("parameters", "budget_bytes", "note", "peak_bytes", "allocator_peak_bytes", "reserved_peak_bytes",
            "step_time_median_s", "warmup_step_times_s", "init_s", "final_loss", "counts", "wall_s")
    return {k: record[k] for k in keep if k in record}


def from_records(records: list[dict], missing: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    env = [r for r in records if r.get("kind") == "env"]
    if env:
        out["env"] = {k: v for k, v in env[-1].items() if k not in ("kind", "modules")}
        for problem in env[-1].get("problems", []):
            missing.append(f"imports: {problem}")
    else:
        missing.append("imports: no record (the step did not finish)")
    sides: dict[str, dict] = {}
    configs = out["configs"] = {}  # each side's (model, ds_config), for `predict`
    for name in SIDES:
        done = [r for r in records if r.get("kind") == "side" and r.get("side") == name]
        steps = [r for r in records if r.get("kind") == "step" and r.get("side") == name]
        if done:
            sides[name] = _side(done[-1])
            if done[-1].get("ds_config"):
                configs[name] = (done[-1]["model"], done[-1]["ds_config"])
            if "error" in done[-1]:
                missing.append(f"bench {name}: failed: {done[-1]['error']}")
        elif steps:
            sides[name] = {"cut_after_steps": len(steps), "losses": [s["loss"] for s in steps],
                           "step_times_s": [s["time_s"] for s in steps]}
            missing.append(f"bench {name}: cut by its limit after {len(steps)} step(s)")
        else:
            missing.append(f"bench {name}: no record (not started, or cut before its first step)")
    plain = sides.get("plain", {})
    for name, side in sides.items():
        if name != "plain" and side.get("peak_bytes") and plain.get("peak_bytes"):
            side["peak_ratio"] = side["peak_bytes"] / plain["peak_bytes"]
            if side.get("step_time_median_s") and plain.get("step_time_median_s"):
                side["step_time_ratio"] = side["step_time_median_s"] / plain["step_time_median_s"]
    out["bench"] = sides
    rounds = [r for r in records if r.get("kind") == "optimizer"]
    if rounds:
        last = rounds[-1]
        out["optimizer"] = {"device": last.get("device"), "numel": last.get("numel"),
                            "rounds_done": last.get("rounds_done"), "skipped": last.get("skipped"),
                            "results": {name: {k: v for k, v in row.items() if k != "update_ns_per_param_all_rounds"}
                                        for name, row in last["results"].items()}}
        if last.get("rounds_done", 0) < last.get("rounds", 0):
            missing.append(f"optimizer: {last['rounds_done']} of {last['rounds']} rounds")
        if not any("counts_per_step" in row for row in last["results"].values()):
            missing.append("optimizer: no counts per step (cut before them)")
    else:
        missing.append("optimizer: no record")
    collected = [r for r in records if r.get("kind") == "collected"]
    tests = {r["test"]: r for r in records if r.get("kind") == "test"}
    outcomes: dict[str, int] = {}
    for r in tests.values():
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    out["pytest"] = {"collected": collected[-1]["tests"] if collected else None, "outcomes": outcomes,
                     "failed": [t for t, r in tests.items() if r["outcome"] not in ("passed", "skipped")]}
    if not collected:
        missing.append("pytest: did not collect (no record)")
    elif len(tests) < collected[-1]["tests"]:
        missing.append(f"pytest: {len(tests)} of {collected[-1]['tests']} tests finished")
    for r in records:
        if r.get("kind") == "skipped":
            missing.append(f"{r['step']}: skipped, the deadline was near")
    return out


def from_legacy(folder: str) -> dict[str, Any]:
    """The 2026-12-04 layout: env.json, pytest.xml, bench.json."""
    out: dict[str, Any] = {}
    path = os.path.join(folder, "env.json")
    if os.path.exists(path):
        out["env"] = json.load(open(path, encoding="utf-8"))
    path = os.path.join(folder, "pytest.xml")
    if os.path.exists(path):
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        out["pytest"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    path = os.path.join(folder, "bench.json")
    if os.path.exists(path):
        bench = json.load(open(path, encoding="utf-8"))
        out["bench"] = {name: ({"error": side["error"].strip().splitlines()[0]} if "error" in side else _side(side))
                        for name, side in bench["sides"].items()}
        out["configs"] = {"plain": (bench["model"], bench["ds_config"])}  # the presets' budgets are not recorded
    return out


def _ms(seconds: Optional[float]) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds else "-"


def main(folder: str) -> int:
    missing: list[str] = []
    records_path = os.path.join(folder, "results.jsonl")
    out = from_records(_records(records_path), missing) if os.path.exists(records_path) else from_legacy(folder)
    runs = {}
    standins = {r["side"]: r for r in _records(records_path) if r.get("kind") == "megatron_standin"} \
        if os.path.exists(records_path) else {}
    for name in MEGATRON if not standins and out.get("env", {}).get("cuda_available", True) else ():
        path = os.path.join(folder, f"megatron_{name}.log")
        if not os.path.exists(path):
            missing.append(f"megatron {name}: no log")
            continue
        runs[name] = megatron(path)
        if runs[name]["iterations"] < 10:
            missing.append(f"megatron {name}: {runs[name]['iterations']} of 10 iterations in the log")
    if runs:
        out["megatron"] = runs
    configs = out.pop("configs", {})
    env = out.get("env", {})
    if configs and out.get("bench"):
        from predict import predict

        out["predicted"] = predict(out["bench"], configs, env.get("gpu"), env.get("cuda_available", True))
    if not out.get("env", {}).get("cuda_available", True):  # a rehearsal: megatron-core's loop stood in
        out["megatron_standin"] = {name: standins[name]["ranks"] for name in standins}
        missing.extend(f"megatron {name} (stand-in): no record" for name in MEGATRON if name not in standins)
    if os.path.exists(os.path.join(folder, "converge.log")) and not os.path.exists(os.path.join(folder, "run.log")):
        missing = [m for m in missing if m.startswith("bench ")]  # converge.sh: the bench sides alone
        out = {k: v for k, v in out.items() if k in ("env", "bench")}
    out["missing"] = missing
    with open(os.path.join(folder, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)

    env = out.get("env", {})
    print(f"{env.get('gpu') or 'no GPU'}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
          f"deepspeed {env.get('deepspeed', '?')}, megatron-core {env.get('megatron-core', env.get('megatron.core', '?'))}")
    if out.get("bench"):
        print("| bench side | peak (allocator) | reserved | step (median) | warm-up | loss | kernels/step (ops; CUDA) | host syncs/step (ops; CUDA) | link bytes/step |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, s in out["bench"].items():
            if "peak_bytes" not in s:
                print(f"| {name} | {s.get('error') or ('cut after %s steps' % s.get('cut_after_steps'))} |||||||")
                continue
            counts = {k: "-" if v is None else v for k, v in (s.get("counts") or {}).items()}
            print(f"| {name} | {s['peak_bytes']:,} B | {s.get('reserved_peak_bytes') or '-'} | "
                  f"{_ms(s.get('step_time_median_s'))} | {sum(s.get('warmup_step_times_s') or [0]):.1f} s | "
                  f"{s.get('final_loss', float('nan')):.4f} | {counts.get('kernels_per_step', '-')}; "
                  f"{counts.get('device_kernels_per_step', '-')} | {counts.get('host_syncs_per_step', '-')}; "
                  f"{counts.get('device_syncs_per_step', '-')} | {counts.get('link_bytes_per_step', '-')} |")
    if out.get("predicted"):
        print("| bench side | predicted step | measured step | error | predicted peak | measured peak | error |")
        print("|---|---|---|---|---|---|---|")
        for name, p in out["predicted"].items():
            if "error" in p and "profile" not in p:
                print(f"| {name} | estimate failed: {p['error']} ||||||")
                continue
            print(f"| {name} | {_ms(p['predicted_step_time_s'])} | {_ms(p['measured_step_time_s'])} | "
                  f"{p.get('step_time_error', float('nan')):+.1%} | {p['predicted_peak_bytes']:,} B | "
                  f"{p['measured_peak_bytes'] or 0:,} B | {p.get('peak_error', float('nan')):+.1%} |")
    if "optimizer" in out:
        opt = out["optimizer"]
        print(f"optimizer step ({opt['device']}, {opt['numel']:,} elements, {opt['rounds_done']} rounds):")
        for name, row in opt["results"].items():
            counts = {k: "-" if v is None else v for k, v in (row.get("counts_per_step") or {}).items()}
            print(f"  {name}: {row['state_bytes_per_param']:.3f} B/param, {row['update_ns_per_param']:.3f} ns/param, "
                  f"kernels {counts.get('kernels', '-')} (CUDA {counts.get('device_kernels', '-')}), "
                  f"host syncs {counts.get('host_syncs', '-')} (CUDA {counts.get('device_syncs', '-')})")
    if "pytest" in out:
        print(f"pytest -m gpu: {out['pytest']}")
    if runs:
        print("| pretrain_gpt.py | loss at 10 | step (median, it. 4+) | allocated after it. 1 | max allocated | max reserved |")
        print("|---|---|---|---|---|---|")
        for name, r in runs.items():
            mem = r["memory_mb"]
            last = mem[max(mem)] if mem else {}
            loss = f"{r['losses'][-1]:.6f}" if r["losses"] else "-"
            step = f"{r['step_time_median_ms']:.1f} ms" if r["step_time_median_ms"] else "-"
            print(f"| {name} | {loss} | {step} | {mem.get(1, {}).get('allocated_mb', float('nan')):.2f} MB | "
                  f"{last.get('max_allocated_mb', float('nan')):.2f} MB | {last.get('max_reserved_mb') or '-'} MB |")
    for line in missing:
        print(f"missing: {line}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
