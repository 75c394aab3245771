"""What the estimate predicted for each bench side of a GPU check, beside what the side measured: every GPU
run checks the device profile and the estimator (issue 57).

`summarize.py` calls `predict` on this machine after the results came back (the estimate runs on fake
tensors: no GPU needed). Each side's own ds_config (its record's; the 2026-12-04 layout's bench.json has the
plain side's) is estimated on one rank for the device the record names (`profile_for`: the GPU's name in the
run's env record), and the predicted step time and peak stand beside the measured median and the
allocator's peak, with the error of each.
"""
from __future__ import annotations

from typing import Any, Optional


def predict(sides: dict[str, dict], configs: dict[str, tuple[str, dict]], device_name: Optional[str],
            cuda: bool) -> dict[str, dict]:
    """``{side: {predicted_step_time_s, measured_step_time_s, step_time_error, predicted_peak_bytes,
    measured_peak_bytes, peak_error, profile}}`` for each side of ``sides`` with a config in ``configs``
    (``{side: (model, ds_config)}``) and a measured step; a side the estimate fails on gets ``error``."""
    from xirang_ds.memory.device_profile import profile_for
    from xirang_ds.planning.spec import estimate_spec

    profile, how = profile_for("cuda" if cuda else "cpu", device_name)
    out: dict[str, dict] = {}
    for name, side in sides.items():
        if name not in configs or not side.get("step_time_median_s"):
            continue
        model, ds_config = configs[name]
        try:
            est = estimate_spec(model, ds_config, 1, "cuda" if cuda else "cpu", device_profile=profile)
        except Exception as e:  # the estimate's own failure is a result of the check, not the end of it
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        row: dict[str, Any] = {"profile": how, "predicted_peak_bytes": est.predicted_peak_bytes,
                               "measured_peak_bytes": side.get("peak_bytes"),
                               "predicted_step_time_s": est.step_time.seconds if est.step_time else None,
                               "measured_step_time_s": side["step_time_median_s"],
                               "step_time_parts_s": dict(est.step_time.parts) if est.step_time else {}}
        if row["predicted_step_time_s"]:
            row["step_time_error"] = row["predicted_step_time_s"] / row["measured_step_time_s"] - 1
        if row["measured_peak_bytes"]:
            row["peak_error"] = row["predicted_peak_bytes"] / row["measured_peak_bytes"] - 1
        out[name] = row
    return out


__all__ = ["predict"]
