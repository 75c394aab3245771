"""DeepSpeed's ``offload_optimizer`` at ZeRO 1-3 and ``offload_param`` at ZeRO 3: the estimate against the run, and
the predicted step at 0.91B.

    .venv/bin/python benchmarks/estimate_offload.py [--out benchmarks/results/estimate_offload.json]

Each case runs 3 steps of DeepSpeed with the optimizer offloaded (``{"device": "cpu"}``, torch's AdamW on
the host tensors) and, for the first cases, the same ds_config without the offload, on this CPU (gloo; 1 or 2
ranks), and takes the worst rank's tracker peak. On a CPU the host is the device: the tracker counts DeepSpeed's
host buffers (the fp32 partition and its gradient, the states, the staging buffers) and its update's temporaries
as ``host``, apart from the device's bytes, as they are apart on a GPU (`xirang_ds.memory.engine_roles`). Each
is estimated before it runs (`xirang_ds.planning.spec.estimate_spec`); memory on the CPU is exact, so each row
reproduces to the byte. Then ZeRO 3 with ``offload_param`` to the CPU (``param_cases``), the optimizer offloaded too
or not, on 2 ranks and on one: the tracker counts DeepSpeed's flat host buffers of the 16-bit partitions as
``host``. On a CPU the copy of a partition to the device is the partition itself, so a GPU's copies in at each fetch
(which the estimate adds on a GPU; on one rank each weight whole as its module takes it) are not in these runs.

Then the 0.91B GPT of the 2026-12-04 H200 run on one H200 (``benchmarks/configs/plain_0.91b.json``), without the
offload, with it (torch's AdamW on the host, as that ds_config's ``torch_adam`` asks) and with it under
DeepSpeedCPUAdam (``torch_adam`` dropped): the predicted peak, the host bytes and the predicted step (a
prediction, not a measurement: the host's update is priced by a DGX H100/H200 server's spec, `device_profile.HOSTS`).
"""
from __future__ import annotations

import argparse
import copy
import json
import os

from xirang_ds.bench import bench_rank
from xirang_ds.launch import run_ranks
from xirang_ds.memory.device_profile import PROFILES
from xirang_ds.memory.model_states import offloaded_optimizer_host, offloaded_params_host
from xirang_ds.memory.run_shape import RunShape
from xirang_ds.models import build_model, parse_model_spec
from xirang_ds.planning.spec import estimate_spec

CASES = [  # model, stage, dtype, accumulation, ranks, xirang block, also without the offload
    ("gpt-tiny", 2, "bf16", 1, 2, None, True),
    ("gpt-small", 2, "bf16", 1, 2, None, True),
    ("gpt-tiny", 1, "bf16", 1, 2, None, True),
    ("gpt-tiny", 2, "bf16", 2, 2, None, True),
    ("gpt-tiny", 2, "fp32", 1, 2, None, False),
    ("gpt-tiny", 1, "bf16", 2, 1, None, False),
    ("llama-tiny", 2, "bf16", 1, 2, None, False),
    ("gpt-small", 2, "bf16", 1, 2, {"preset": "conservative"}, False),
    ("gpt-small", 2, "bf16", 1, 2, {"preset": "balanced"}, False),
    ("gpt-small", 2, "bf16", 1, 2, {"preset": "conservative", "memory_budget": 20_000_000}, False),
    ("gpt-tiny", 3, "bf16", 1, 2, None, True),
    ("gpt-small", 3, "bf16", 2, 2, None, True),
    ("gpt-small", 3, "bf16", 1, 2, {"preset": "conservative"}, False),
    ("gpt-small", 3, "bf16", 1, 2, {"preset": "conservative", "memory_budget": 20_000_000}, False),
]
PARAM_CASES = [  # ZeRO 3 bf16 with offload_param to the CPU: model, accumulation, ranks, optimizer offloaded too, block
    ("gpt-small", 1, 2, False, None),
    ("gpt-small", 2, 2, True, None),
    ("llama-tiny", 1, 2, True, None),
    ("gpt-small", 1, 2, True, {"preset": "conservative"}),
    ("gpt-small", 2, 1, True, None),
]
BIG = "gpt:layers=16,hidden=2048,heads=16,seq=1024,vocab=50304"
STEPS = 3


def ds_config(stage: int, dtype: str, gas: int, block: dict | None, offload: bool) -> dict:
    c = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
         "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 1e6,
                                                         "allgather_bucket_size": 1e6},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}}
    if dtype == "bf16":  # fp16: DeepSpeed refuses it on a CPU
        c["bf16"] = {"enabled": True}
    if offload:
        c["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if block is not None:
        c["xirang"] = copy.deepcopy(block)
    return c


def measure(model: str, config: dict, world: int) -> dict:
    runs = run_ranks(bench_rank, world, model, config, STEPS, None, 0, "xirang" in config)
    worst = max(runs, key=lambda r: r["peak_bytes"])
    est = estimate_spec(model, config, world)
    numels = [p.numel() for p in build_model(parse_model_spec(model)).parameters()]
    shape = RunShape.from_ds_config(config, world)
    resident = offloaded_optimizer_host(shape, numels)[0] + offloaded_params_host(shape, numels)  # between updates
    return {"measured_peak_bytes": worst["peak_bytes"], "measured_by_category": worst["peak_by_category"],
            "measured_host_bytes": max(r["peak_by_category"]["host"] for r in runs),
            "predicted_peak_bytes": est.predicted_peak_bytes, "predicted_by_category": est.by_category,
            "predicted_host_at_peak_phase": est.phases[est.peak_phase]["host"] + resident,
            "deepspeed_host_bytes": est.deepspeed_host_bytes,
            "error": (est.predicted_peak_bytes - worst["peak_bytes"]) / worst["peak_bytes"],
            "notes": [n for n in est.notes if "offload" in n or "not modelled" in n]}


def predicted_0_91b() -> dict:
    with open(os.path.join(os.path.dirname(__file__), "configs", "plain_0.91b.json")) as f:
        plain = json.load(f)
    out = {}
    for label, offload in (("on_device", False), ("offloaded", True), ("offloaded_cpu_adam", True)):
        config = copy.deepcopy(plain)
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if label == "offloaded_cpu_adam":  # DeepSpeedCPUAdam, what DeepSpeed builds without torch_adam
            del config["optimizer"]["params"]["torch_adam"]
        est = estimate_spec(BIG, config, 1, "cuda", device_profile=PROFILES["h200"])
        st = est.step_time
        out[label] = {"predicted_peak_bytes": est.predicted_peak_bytes, "host_peak_bytes": est.host_peak_bytes,
                      "deepspeed_host_bytes": est.deepspeed_host_bytes,
                      "predicted_step_time_s": st.seconds, "parts": st.parts, "kernels": st.counts["kernels"],
                      "host_syncs": st.counts["host_syncs"], "host_optimizer": st.counts.get("host_optimizer")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/estimate_offload.json")
    args = parser.parse_args()
    rows = []
    for model, stage, dtype, gas, world, block, both in CASES:
        row = {"model": model, "stage": stage, "dtype": dtype, "gradient_accumulation_steps": gas, "ranks": world,
               "xirang": block, "offloaded": measure(model, ds_config(stage, dtype, gas, block, True), world)}
        if both:
            row["on_device"] = measure(model, ds_config(stage, dtype, gas, block, False), world)
        rows.append(row)
        off = row["offloaded"]
        print(f"{model} ZeRO-{stage} {dtype} gas {gas} {world} rank(s) {block or ''}: measured "
              f"{off['measured_peak_bytes']:,}, predicted {off['predicted_peak_bytes']:,} ({off['error']:+.2%})"
              + (f"; on the device {row['on_device']['measured_peak_bytes']:,}" if both else ""), flush=True)
    params = []
    for model, gas, world, optimizer_too, block in PARAM_CASES:
        config = ds_config(3, "bf16", gas, block, optimizer_too)
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
        row = {"model": model, "gradient_accumulation_steps": gas, "ranks": world, "offload_optimizer": optimizer_too,
               "xirang": block, "offloaded": measure(model, config, world)}
        numels = [p.numel() for p in build_model(parse_model_spec(model)).parameters()]
        row["partitions_host_bytes"] = offloaded_params_host(RunShape.from_ds_config(config, world), numels)
        params.append(row)
        off = row["offloaded"]
        print(f"{model} ZeRO-3 offload_param gas {gas} {world} rank(s) optimizer offloaded {optimizer_too} "
              f"{block or ''}: measured {off['measured_peak_bytes']:,}, predicted {off['predicted_peak_bytes']:,} "
              f"({off['error']:+.2%})", flush=True)
    result = {"cases": rows, "param_cases": params, "h200_0.91b": predicted_0_91b()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["h200_0.91b"], indent=1))


if __name__ == "__main__":
    main()
