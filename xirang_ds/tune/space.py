"""The joint space `xirang_ds.tune` searches: each searched section's options, the candidates (their product
over ZeRO stages and micro-batches), and the base every option is profiled on."""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Optional

from xirang_ds.config.loader import BLOCK_KEY, deep_merge
from xirang_ds.registry import built_sections

SEARCHED = ("optimizer_states", "grad_release", "precision", "activations")
"""Sections whose options the tuner chooses (comm_buffers is always on in its adaptive mode)."""


@dataclass(frozen=True)
class Option:
    """One value of one dimension: a label, what it writes into the ds_config, and whether it
    changes the numbers training computes (lossy) or only where and when they live."""

    label: str
    block: dict = field(default_factory=dict)  # sections laid over the candidate's block
    ds: dict = field(default_factory=dict)  # keys laid over the ds_config (ZeRO stage, micro-batch)
    lossy: bool = False


@dataclass
class Candidate:
    """A point of the joint space and what is known about it."""

    options: tuple[Option, ...]
    ds_config: dict
    micro_batch: int
    predicted_peak: Optional[int] = None
    predicted_time_s: Optional[float] = None
    rejected: Optional[str] = None
    measured_peak: Optional[int] = None
    measured_time_s: Optional[float] = None
    measured_loss: Optional[float] = None
    error: Optional[str] = None

    @property
    def name(self) -> str:
        parts = [o.label for o in self.options if o.label]
        return "+".join(parts) or "base"

    def as_dict(self) -> dict:
        return {"name": self.name, "micro_batch": self.micro_batch, "predicted_peak_bytes": self.predicted_peak,
                "predicted_step_time_s": self.predicted_time_s, "rejected": self.rejected,
                "measured_peak_bytes": self.measured_peak, "measured_step_time_s": self.measured_time_s,
                "measured_final_loss": self.measured_loss, "error": self.error,
                "block": self.ds_config.get(BLOCK_KEY, {})}


def search_space(ds_config: dict, world_size: int, lossless_only: bool = False,
                 micro_batches: Optional[list[int]] = None) -> list[list[Option]]:
    """The dimensions of the joint space for this ds_config, each with its default first.

    The ZeRO stage varies over 0-2 on several ranks (the stage the user wrote stays a candidate);
    stage 3 is searched only when the user asked for it, since most plugins refuse it.
    """
    built = built_sections()
    zero = ds_config.get("zero_optimization", {}) or {}
    user_stage = int(zero.get("stage", 0))
    stages = sorted({user_stage} | ({0, 1, 2} if world_size > 1 else set()))
    dims: list[list[Option]] = [[Option(f"zero{s}", ds={"zero_optimization": {"stage": s}}) for s in stages]]
    if micro_batches:
        dims.append([Option(f"mb{m}", ds={"train_micro_batch_size_per_gpu": m}) for m in micro_batches])
    if "optimizer_states" in built:
        states = [Option("")]
        states.append(Option("int8_states", {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]}},
                             lossy=True))
        states.append(Option("int4_states", {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int4"}]}},
                             lossy=True))
        dims.append(states)
    if "grad_release" in built:
        release = [Option(""), Option("grad_release", {"grad_release": {"enabled": True}})]
        if (ds_config.get("bf16") or {}).get("enabled") in (True, "true"):  # 8-bit remainders, no master: bf16 only
            release.append(Option("grad_release_masters_8bit",
                                  {"grad_release": {"enabled": True, "masters": "remainders_8bit"}}, lossy=True))
            release.append(Option("grad_release_no_master", {"grad_release": {"enabled": True, "masters": "none"}},
                                  lossy=True))
        dims.append(release)
    if "precision" in built and _low_precision(ds_config):
        dims.append([Option(""), Option("precision", {"precision": {"enabled": True}})])
    if "activations" in built:
        dims.append([Option(""), Option("act_lossless", {"activations": {"enabled": True}})])
    if lossless_only:
        dims = [[o for o in d if not o.lossy] for d in dims]
    return dims


def _low_precision(ds_config: dict) -> bool:
    return any((ds_config.get(k) or {}).get("enabled") in (True, "true") for k in ("bf16", "fp16"))


def base_config(ds_config: dict, budget: int) -> dict:
    """The user's ds_config with the searched sections cleared, adaptive buffers on and the budget
    written into the block (the activation planner and the monitor read it)."""
    out = copy.deepcopy(ds_config)
    block = dict(out.get(BLOCK_KEY, {}) or {})
    block.pop("preset", None)
    # searched sections are the tuner's; the monitor and profiler stay out of trials (an action
    # such as halve_micro_batch would change what is measured) and come back in the output
    for name in SEARCHED + ("autotune", "monitor", "profiler"):
        block.pop(name, None)
    if "comm_buffers" in built_sections():
        block["comm_buffers"] = deep_merge({"enabled": True}, block.get("comm_buffers", {}) or {})
    block["memory_budget"] = int(budget)
    out[BLOCK_KEY] = block
    return out


def candidates(ds_config: dict, dims: list[list[Option]]) -> list[Candidate]:
    base = base_config(ds_config, ds_config[BLOCK_KEY]["memory_budget"]) if BLOCK_KEY in ds_config else ds_config
    out = []
    for combo in itertools.product(*dims):
        cfg = copy.deepcopy(base)
        for o in combo:
            cfg = deep_merge(cfg, o.ds)
            cfg[BLOCK_KEY] = deep_merge(cfg.get(BLOCK_KEY, {}), o.block)
        out.append(Candidate(tuple(combo), cfg, int(cfg.get("train_micro_batch_size_per_gpu", 1))))
    return out


# ------------------------------------------------------------------------------------------------
# the progress bar
