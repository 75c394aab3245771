"""A measured embedding's first update: the most bytes the step holds, with the chunked first update
(`plugins/optimizer_states/first_step.py`) and with the whole-fp32 path it replaced (``applies`` forced
false), on an 8192 x 64 embedding, int8 and int4 schedules, the default 131,072-element chunks; the
live-storage tracker around ``opt.step()``.

    .venv/bin/python benchmarks/first_step_memory.py
"""
from __future__ import annotations

import torch

import xirang_ds
from xirang_ds.memory.tracker import MemoryTracker
from xirang_ds.plugins.optimizer_states import first_step
from xirang_ds.plugins.optimizer_states.build import keep_reasons, split_groups
from xirang_ds.plugins.optimizer_states.optimizer import DynamicAdamW


def held(dtype: str) -> tuple[int, int, list]:
    """(bytes the first step holds above what was live, the settled states' bytes, the measurements)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8192, 64))
    config = xirang_ds.load_config({"xirang": {"optimizer_states": {
        "enabled": True, "schedule": [{"dtype": dtype}], "keep_fp32_embeddings_and_norms": "measured",
        "measured_max_error": 0.1}}}).optimizer_states
    opt = DynamicAdamW(split_groups([{"params": list(model.parameters())}], keep_reasons(model, config)), lr=1e-3,
                       states=config)
    model[0].weight.grad = torch.randn(8192, 64, generator=g) * 1e-2
    tracker = MemoryTracker("cpu")
    with tracker:
        window = tracker.open_window()
        base = tracker.live_bytes
        opt.step()
        peak = window.report().peak_bytes - base
    return peak, opt.state_nbytes(model[0].weight), opt.measurements


def main() -> None:
    applies = first_step.applies
    for label, chunked in (("chunked first update", True), ("whole fp32 moments", False)):
        first_step.applies = applies if chunked else (lambda *a: False)
        for dtype in ("int8", "int4"):
            peak, states, measurements = held(dtype)
            print(f"{label}, {dtype} schedule: step holds {peak:,} bytes, settled states {states:,}; "
                  f"measured {[(m[2], round(m[3], 4), m[4]) for m in measurements]}")
    first_step.applies = applies


if __name__ == "__main__":
    main()
