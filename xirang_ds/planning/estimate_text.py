"""The estimate said: `format_estimate`'s table for ``xirang-ds estimate``, and `recalibrate`'s comparison with a
measured peak (``xirang-ds estimate --measure``)."""
from __future__ import annotations

from typing import Any

from xirang_ds.config.types import format_bytes
from xirang_ds.memory.categories import CATEGORIES


def recalibrate(estimate: Any, measured_by_category: dict[str, int], measured_peak: int) -> dict:
    """Compare with a measured peak: the error and a factor per category (measured / predicted)."""
    factors = {}
    for c in CATEGORIES:
        p = estimate.by_category.get(c, 0)
        m = measured_by_category.get(c, 0)
        if p:
            factors[c] = m / p
    return {"predicted_peak_bytes": estimate.predicted_peak_bytes, "measured_peak_bytes": measured_peak,
            "error": (estimate.predicted_peak_bytes - measured_peak) / measured_peak, "factors": factors}


def format_estimate(est: Any) -> str:
    """The estimate as a table: each phase's total and the breakdown at the predicted peak."""
    lines = ["predicted per-rank peak: " + format_bytes(est.predicted_peak_bytes) +
             f" ({est.predicted_peak_bytes:,} bytes) in {est.peak_phase}"]
    if est.bound_peak_bytes is not None:
        lines[0] += (f"; at most {format_bytes(est.bound_peak_bytes)} ({est.bound_peak_bytes:,} bytes) where a size "
                     "only the data decide stays at its bound (the plan and fits stand on that)")
    if est.fits is not None:
        host = " in host_memory_budget" if est.device_fits is not False and not est.fits else ""
        lines.append(("fits" if est.fits else f"does not fit{host}") + f"; the least memory_budget the block meets: "
                     f"{format_bytes(est.least_budget_bytes)} ({est.least_budget_bytes:,} bytes)")
    if est.host_peak_bytes:
        lines.append(f"host tiers: {format_bytes(est.host_peak_bytes)} ({est.host_peak_bytes:,} bytes) held")
    if est.deepspeed_host_bytes:
        lines.append(f"DeepSpeed's offload: {format_bytes(est.deepspeed_host_bytes)} "
                     f"({est.deepspeed_host_bytes:,} bytes) in host memory at most")
    if est.step_time is not None:
        st, plain = est.step_time, est.plain_step_time
        beside = f" (plain DeepSpeed {plain.seconds * 1e3:.1f} ms)" if plain is not None and plain is not st else ""
        lines.append(f"predicted step: {st.seconds * 1e3:.1f} ms on the {st.profile} profile{beside}: " +
                     ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in st.parts.items()) +
                     f"; {st.counts['kernels']:,} kernels and {st.counts['host_syncs']} host syncs counted" +
                     "".join(f"; {n}" for n in st.notes))
    lines += ["  " + n for n in est.notes]
    lines.append(f"{'category':<18}{'forward':>12}{'backward':>12}{'optimizer_step':>16}")
    for c in CATEGORIES:
        vals = [est.phases[p].get(c, 0) for p in ("forward", "backward", "optimizer_step")]
        if any(vals):
            lines.append(f"{c:<18}" + "".join(f"{format_bytes(v):>{w}}" for v, w in zip(vals, (12, 12, 16))))
    totals = [est.phases[p]["total"] for p in ("forward", "backward", "optimizer_step")]
    lines.append(f"{'total':<18}" + "".join(f"{format_bytes(v):>{w}}" for v, w in zip(totals, (12, 12, 16))))
    if est.korthikanti_activations is not None:
        lines.append(f"(Korthikanti et al. formula for 16-bit activations of a standard transformer: "
                     f"{format_bytes(est.korthikanti_activations)}; the trace measured this model's own)")
    return "\n".join(lines)


__all__ = ["format_estimate", "recalibrate"]
