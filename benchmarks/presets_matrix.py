"""Every preset in every configuration large runs use, as a user would try them (issue 25, item 1):
ZeRO 0-3; ``offload_optimizer`` and ``offload_param`` to cpu where DeepSpeed takes them; bf16, fp16 and
fp32; clipping on and off; accumulation 1 and 4. For each configuration plain DeepSpeed and each preset
train gpt-tiny at 2 ranks from the same seed and batches; each side saves a checkpoint, trains one step
more, and a fresh engine of the same ds_config loads the checkpoint and takes that step again.

A row records, per side: the losses, what the preset left out (and which of its keys fell back) with
the session's lines, whether the resumed step's loss equals the continued one bit for bit, and any
error (a failure is a finding, never skipped). Each configuration runs in fresh processes under a time
limit, so one that hangs cannot hold the rest.

    .venv/bin/python benchmarks/presets_matrix.py --json benchmarks/results/presets_matrix.json

Beside the ds_config's AdamW, each stage and precision (accumulation 4, clipping) also trains with a torch
optimizer passed to ``initialize``: AdamW, which optimizer_states replaces, and SGD and Adagrad, which it
leaves alone; and at each stage a compiled model, compiled before ``initialize`` or by ``engine.compile()``
after it (bf16, accumulation 2, clipping); and settings users write beside those (`EXTRAS`: a batch size
DeepSpeed derives, fp16 loss-scale keys, overlap_comm, grad_accum_dtype, communication_data_type, a
scheduler, sub_group_size, 16-bit weights gathered on save, where ``save_16bit_model``'s file must equal the
engine's gathered weights). ``--kind ds_config``, ``client``, ``compiled``
or ``settings`` runs one part.
``--budget-fraction 0.3`` gives every preset ``activations.budget_fraction`` 0.3, so that its planner
recomputes, offloads or compresses in each configuration (without it the presets keep every activation).
``--only "zero3 bf16 offload_param gas4 clip"`` (repeatable) runs the named configurations;
``--render JSON`` prints the summary of a saved run; ``--compare JSON`` adds each preset's losses against
another run's (the budget's against none: where the plans change a number):

    .venv/bin/python benchmarks/presets_matrix.py --render benchmarks/results/presets_matrix_budget.json \
        --compare benchmarks/results/presets_matrix.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_table import deep_merge, load_or_run, short_error  # noqa: E402

PRESETS = ("conservative", "balanced", "aggressive")
OFFLOADS = {0: ("none",), 1: ("none", "offload_optimizer"), 2: ("none", "offload_optimizer"),
            3: ("none", "offload_optimizer", "offload_param", "offload_both")}
"""DeepSpeed offloads the optimizer at ZeRO 1-3 and the parameters at ZeRO-3 only."""
DTYPES = ("bf16", "fp16", "fp32")
CLIENT_OPTIMIZERS = ("AdamW", "SGD", "Adagrad")
"""torch optimizers passed to ``initialize`` (the ds_config then has no optimizer block): an Adam type
optimizer_states can replace, and two it cannot."""
EXTRAS = {
    "zero2 bf16 train_batch_size derives accumulation": dict(stage=2, gas=4, set={"train_batch_size": 16},
                                                              drop=["gradient_accumulation_steps"]),
    "zero2 bf16 train_batch_size derives micro-batch": dict(stage=2, gas=4, set={"train_batch_size": 16},
                                                             drop=["train_micro_batch_size_per_gpu"]),
    "zero2 fp16 static loss scale": dict(stage=2, dtype="fp16", set={"fp16": {"loss_scale": 128}}),
    "zero2 fp16 hysteresis and window": dict(stage=2, dtype="fp16", gas=4,
                                             set={"fp16": {"hysteresis": 1, "loss_scale_window": 50}}),
    "zero2 bf16 overlap_comm without contiguous_gradients": dict(
        stage=2, set={"zero_optimization": {"overlap_comm": True, "contiguous_gradients": False}}),
    "zero1 bf16 grad_accum_dtype fp32": dict(stage=1, gas=4, set={"data_types": {"grad_accum_dtype": "fp32"}}),
    "zero2 bf16 communication_data_type fp32": dict(stage=2, gas=4, set={"communication_data_type": "fp32"}),
    "zero2 bf16 WarmupDecayLR": dict(stage=2, set={"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2, "total_num_steps": 10}}}),
    "zero3 bf16 sub_group_size": dict(stage=3, gas=4, set={"zero_optimization": {"sub_group_size": 100000}}),
    "zero3 bf16 16-bit weights gathered on save": dict(
        stage=3, set={"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True}}),
}
"""ds_config settings users write beside the ones above (bf16, clipping, accumulation 1 unless stated)."""
COMPILED = ("model", "engine")
"""torch.compile: the model compiled before ``initialize``, or ``engine.compile()`` after it (DeepSpeed's way at
ZeRO-3, where its engine does not take an already compiled model)."""


def configurations() -> dict[str, dict]:
    out = {}
    for stage, dtype, gas, clip in itertools.product((0, 1, 2, 3), DTYPES, (1, 4), (0.0, 1.0)):
        for offload in OFFLOADS[stage]:
            name = f"zero{stage} {dtype} {offload} gas{gas} {'clip' if clip else 'noclip'}"
            out[name] = dict(stage=stage, dtype=dtype, offload=offload, gas=gas, clip=clip)
    for stage, dtype, client in itertools.product((0, 1, 2, 3), DTYPES, CLIENT_OPTIMIZERS):
        name = f"zero{stage} {dtype} none gas4 clip client {client}"
        out[name] = dict(stage=stage, dtype=dtype, offload="none", gas=4, clip=1.0, client=client)
    for name, extra in EXTRAS.items():
        out[name] = {"dtype": "bf16", "offload": "none", "gas": 1, "clip": 1.0, **extra}
    for stage, compiled in itertools.product((0, 1, 2, 3), COMPILED):
        name = f"zero{stage} bf16 none gas2 clip compiled {compiled}"
        out[name] = dict(stage=stage, dtype="bf16", offload="none", gas=2, clip=1.0, compiled=compiled)
    return out


def ds_config(spec: dict, xirang: dict | None) -> dict:
    """The tests' small ds_config (AdamW, 1e6-element buckets, micro-batch 2) in this configuration."""
    zero: dict = {"stage": spec["stage"], "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6}
    if spec["stage"] == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=1e6)
    if spec["offload"] in ("offload_optimizer", "offload_both"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if spec["offload"] in ("offload_param", "offload_both"):
        zero["offload_param"] = {"device": "cpu"}
    cfg: dict = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": spec["gas"],
                 "steps_per_print": 10**6, "zero_optimization": zero,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}}
    if spec.get("client"):
        del cfg["optimizer"]
        cfg["zero_allow_untested_optimizer"] = True  # ZeRO takes only DeepSpeed's optimizers without it
    if spec["clip"]:
        cfg["gradient_clipping"] = spec["clip"]
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    for key in spec.get("drop", ()):
        del cfg[key]
    cfg = deep_merge(cfg, spec.get("set", {}))
    if xirang is not None:
        cfg["xirang"] = xirang
    return cfg


def _engine(cfg: dict, client: str | None, compiled: str | None = None):
    import deepspeed
    import torch

    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    torch._dynamo.reset()
    model = build_model(BUILTIN_SPECS["gpt-tiny"], seed=0)
    optimizer = None
    if client == "AdamW":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    elif client == "SGD":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    elif client == "Adagrad":
        optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    if compiled == "model":
        model = torch.compile(model)
    init = xirang_ds.initialize if "xirang" in cfg else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), optimizer=optimizer, config=cfg)
    if compiled == "engine":
        engine.compile()
    return engine


def _side(rank: int, world: int, cfg: dict, steps: int, ckpt: str, client: str | None = None,
          compiled: str | None = None) -> dict:
    from xirang_ds.bench import optimizer_step
    from xirang_ds.data import batches, find_default_corpus, load_tokens

    def data(skip: int):
        it = batches(load_tokens(find_default_corpus()), 2, 64, seed=0, rank=rank, world_size=world)
        for _ in range(skip):
            next(it)
        return it

    engine = _engine(cfg, client, compiled)
    gas = engine.gradient_accumulation_steps()
    it = data(0)
    losses = [optimizer_step(engine, it) for _ in range(steps)]
    engine.save_checkpoint(ckpt)
    out: dict = {}
    if cfg["zero_optimization"].get("stage3_gather_16bit_weights_on_model_save"):
        # the 16-bit weights gathered into one file, as for inference: each equals the engine's own
        import torch
        from deepspeed.runtime.zero import GatheredParameters

        engine.save_16bit_model(ckpt, "model_16bit.bin")
        torch.distributed.barrier()  # rank 0 writes the file
        saved = torch.load(os.path.join(ckpt, "model_16bit.bin"), map_location="cpu")
        with GatheredParameters(list(engine.module.parameters())):
            own = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        out["16bit_weights_equal"] = set(saved) >= set(own) and all(torch.equal(saved[n], own[n]) for n in own)
        if not out["16bit_weights_equal"]:  # a finding, recorded as the side's error
            raise AssertionError("save_16bit_model wrote weights that differ from the engine's gathered ones")
    continued = optimizer_step(engine, it)
    out["losses"] = losses + [continued]
    session = getattr(engine, "xirang", None)
    if session is not None:
        out.update(plugins=[p.section for p in session.plugins], left_out=[i.section for i in session.left_out],
                   said=[line.strip() for line in session.summary().splitlines() if _says_left_out(line)])
        session.remove()
    del engine
    resumed_engine = _engine(cfg, client, compiled)
    resumed_engine.load_checkpoint(ckpt)
    out["resumed"] = optimizer_step(resumed_engine, data(steps * gas))
    out["resumes_identically"] = out["resumed"] == continued
    resumed_session = getattr(resumed_engine, "xirang", None)
    if resumed_session is not None:
        resumed_session.remove()
    return out


def _says_left_out(line: str) -> bool:
    return any(words in line for words in ("left out", "falls back", "fell back"))


def one_configuration(rank: int, world: int, spec: dict, steps: int, root: str,
                      budget_fraction: float | None) -> dict:
    """Plain DeepSpeed, then each preset, in this rank's process; an error is recorded, not raised."""
    import torch.distributed as dist
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    # DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels; torch computes fp16 on
    # every CPU with reference kernels, so the fp16 rows stand in for a GPU's here (as in tests/__init__.py)
    CPU_Accelerator.is_fp16_supported = lambda self: True
    results = {}
    for side in ("plain",) + PRESETS:
        block = {"preset": side}
        if budget_fraction is not None:  # the planner recomputes, offloads or compresses to fit
            block["activations"] = {"budget_fraction": budget_fraction}
        cfg = ds_config(spec, None if side == "plain" else block)
        try:
            results[side] = _side(rank, world, cfg, steps, os.path.join(root, side), spec.get("client"),
                                  spec.get("compiled"))
        except Exception as e:  # a finding: recorded with its message (a refusal: xirang's own clear error)
            from xirang_ds.config.validate import XirangConfigError

            results[side] = {"error": short_error(e) if not isinstance(e, XirangConfigError) else str(e),
                             "refused": isinstance(e, XirangConfigError)}
        dist.barrier()
    return results


def _child(spec: dict, steps: int, world: int, budget_fraction: float | None) -> dict:
    from xirang_ds.launch import run_ranks

    with tempfile.TemporaryDirectory(prefix="xirang-matrix-") as root:
        return run_ranks(one_configuration, world, spec, steps, root, budget_fraction)[0]


def run(args: argparse.Namespace) -> dict:
    kinds = {"ds_config": lambda spec: not {"client", "compiled", "set", "drop"} & set(spec),
             "client": lambda spec: "client" in spec, "compiled": lambda spec: "compiled" in spec,
             "settings": lambda spec: bool({"set", "drop"} & set(spec))}
    configs = {name: spec for name, spec in configurations().items()
               if args.kind == "all" or kinds[args.kind](spec)}
    names = args.only or list(configs)
    unknown = [n for n in names if n not in configs]
    if unknown:
        raise SystemExit(f"--only: unknown configuration(s) {unknown}; known: {list(configs)}")
    rows = []
    for name in names:
        start = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(configs[name]),
               "--steps", str(args.steps), "--world-size", str(args.world_size)]
        if args.budget_fraction is not None:
            cmd += ["--budget-fraction", str(args.budget_fraction)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode == 0:
                sides = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                sides = {"error": short_error(Exception(proc.stderr[-4000:]))}
        except subprocess.TimeoutExpired:
            sides = {"error": f"timed out after {args.timeout} s"}
        rows.append({"name": name, **configs[name], "seconds": round(time.perf_counter() - start, 1),
                     "sides": sides})
        print(f"{name}: {summary_line(rows[-1])}", flush=True)
    return {"command": "python benchmarks/presets_matrix.py " + " ".join(sys.argv[1:]), "steps": args.steps,
            "budget_fraction": args.budget_fraction,
            "world_size": args.world_size, "model": "gpt-tiny", "rows": rows}


def summary_line(row: dict) -> str:
    sides = row["sides"]
    if "error" in sides:
        return "FAILED " + sides["error"]
    parts = []
    for side, r in sides.items():
        if "error" in r:
            parts.append(f"{side} ERROR {r['error']}")
            continue
        text = f"{side} {r['losses'][-1]:.4f}" + ("" if r["resumes_identically"] else " RESUME-DIFFERS")
        if r.get("left_out"):
            text += f" (left out {','.join(r['left_out'])})"
        parts.append(text)
    return "; ".join(parts)


def render(data: dict) -> str:
    """One Markdown row per stage, offload and optimizer (over precision, accumulation and clipping): the
    configurations, the sides that failed, the resumed steps equal bit for bit, and what each preset left
    out, with the configurations where it did when not all; then every failure in full."""
    rows = data["rows"]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        kind = (f"torch {row['client']}, passed in" if row.get("client") else
                "ds_config AdamW" + (f", compiled {row['compiled']}" if row.get("compiled") else ""))
        if {"set", "drop"} & set(row):  # a setting of EXTRAS: its name after the stage
            kind = f"ds_config AdamW, {row['name'].split(' ', 1)[1]}"
        groups.setdefault((row["stage"], row["offload"], kind), []).append(row)
    lines = ["| ZeRO | offload | optimizer | configurations | preset sides failed | resumed step bit for bit | "
             + " | ".join(f"{p} leaves out" for p in PRESETS) + " |", "|---" * (6 + len(PRESETS)) + "|"]
    failures = []
    for (stage, offload, optimizer), members in groups.items():
        sides = [(row, side, r) for row in members for side, r in _sides(row).items()]
        failed = [(row, side, r) for row, side, r in sides if "error" in r]
        kinds = [_failure(row, side, r) for row, side, r in failed]
        failures += [f"- {row['name']}, {side}: {' '.join(r['error'].split())}{FAILURES[kind]}"
                     for (row, side, r), kind in zip(failed, kinds)]
        ours, refused = kinds.count("ours"), kinds.count("refused")
        deepspeeds = kinds.count("plain") + kinds.count("alike")
        resumed = sum(1 for _, _, r in sides if r.get("resumes_identically"))
        cells = []
        for preset in PRESETS:
            where: dict[str, list[str]] = {}
            for row in members:
                for item in _sides(row).get(preset, {}).get("left_out", []):
                    where.setdefault(item, []).append(_variant(row))
            cells.append(", ".join(item + ("" if len(names) == len(members) else f" ({_common(names, members)})")
                                   for item, names in where.items()) or "-")
        notes = [f"{refused} refused at initialize, where plain DeepSpeed fails"] if refused else []
        if deepspeeds:
            notes.append(f"{deepspeeds} failing as plain DeepSpeed does")
        failed_cell = f"{ours}" + (f" ({'; '.join(notes)})" if notes else "")
        lines.append(f"| {stage} | {offload} | {optimizer} | {len(members)} | {failed_cell} | {resumed} of "
                     f"{len(sides)} | " + " | ".join(cells) + " |")
    total = sum(len(_sides(r)) for r in rows)
    lines += ["", f"{len(rows)} configurations, {total} sides (plain DeepSpeed and each preset): "
                  f"{len(failures)} failed."]
    return "\n".join(lines + failures)


FAILURES = {"plain": " (DeepSpeed's own)", "alike": " (plain DeepSpeed fails the same way)",
            "refused": " (refused at initialize; plain DeepSpeed fails)", "ours": ""}
"""A failed side's kind → how the summary lists it; only ``ours`` counts against a preset."""


def _failure(row: dict, side: str, result: dict) -> str:
    """The kind of a failed side: plain DeepSpeed's own, a preset failing as plain does, a preset refused at
    initialize where plain fails, or a failure of ours."""
    plain = _sides(row).get("plain", {})
    if side == "plain":
        return "plain"
    if "error" in plain and result.get("refused"):
        return "refused"
    return "alike" if "error" in plain and result["error"] == plain["error"] else "ours"



def compare(data: dict, other: dict) -> str:
    """Each preset's losses in ``data`` against the same configuration's in ``other`` (a budget against
    none): how many runs are equal bit for bit, and the largest relative difference of any step's loss."""
    theirs = {row["name"]: _sides(row) for row in other["rows"]}
    lines = []
    for preset in PRESETS:
        pairs = [(r[preset]["losses"], theirs[row["name"]][preset]["losses"]) for row in data["rows"]
                 for r in [_sides(row)] if "losses" in r.get(preset, {})
                 and "losses" in theirs.get(row["name"], {}).get(preset, {})]
        worst = max((abs(a - b) / abs(b) for mine, yours in pairs for a, b in zip(mine, yours)), default=0.0)
        equal = sum(1 for mine, yours in pairs if mine == yours)
        lines.append(f"{preset}: {equal} of {len(pairs)} runs equal bit for bit; largest relative difference "
                     f"of a step's loss {worst:.2e}")
    return "\n".join(lines)


def _sides(row: dict) -> dict:
    sides = row["sides"]
    return {"run": sides} if "error" in sides else sides


def _variant(row: dict) -> str:
    return f"{row['dtype']} gas{row['gas']} {'clip' if row['clip'] else 'noclip'}"


def _common(names: list[str], members: list[dict]) -> str:
    """``names`` shortened: a precision whose every variant is there, by its name alone (``fp16, fp32 gas4``)."""
    out = []
    for dtype in DTYPES:
        mine = [n for n in names if n.split()[0] == dtype]
        if not mine:
            continue
        every = [_variant(r) for r in members if r["dtype"] == dtype]
        rest = [set(n.split()[1:]) for n in mine]
        shared = set.intersection(*rest)
        if len(mine) == len(every):
            out.append(dtype)
        elif shared and len(mine) == len(every) // 2:
            out.append(f"{dtype} {' '.join(sorted(shared))}")
        else:
            out.append("; ".join(mine))
    return ", ".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--only", action="append")
    parser.add_argument("--kind", choices=("all", "ds_config", "client", "compiled", "settings"), default="all",
                        help="the ds_config's AdamW block, torch optimizers passed to initialize, a compiled model, "
                             "other ds_config settings (EXTRAS), or all")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    parser.add_argument("--budget-fraction", type=float,
                        help="each preset's activations.budget_fraction: the planner fits its saved activations "
                             "into this fraction of what keeping every module saves")
    parser.add_argument("--json")
    parser.add_argument("--render")
    parser.add_argument("--compare", help="a saved run of the same configurations: each preset's losses against it")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child), args.steps, args.world_size, args.budget_fraction)))
        return 0
    data = load_or_run(args, run, indent=None)
    print(render(data))
    if args.compare:
        with open(args.compare, encoding="utf-8") as f:
            print(compare(data, json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
