"""Text tables of memory figures for the console."""
from __future__ import annotations

from typing import Optional, Sequence

from xirang_ds.config.types import format_bytes
from xirang_ds.memory.categories import DEVICE_CATEGORIES, HOST
from xirang_ds.memory.tracker import PeakReport


def breakdown_table(report: PeakReport, compare: Optional[PeakReport] = None,
                    labels: Sequence[str] = ("bytes", "")) -> str:
    """The device peak by category (shares of the peak, adding up to 100%); with ``compare``, two columns
    and their ratio. Host memory plugins hold is a row of its own after the peak, outside it.

    Example output::

        category            baseline       xirang   ratio
        parameters         19.02 MiB    19.02 MiB   1.00
        ...
        peak (optimizer_step)  73.91 MiB  40.10 MiB  0.54
        host (off the device)        0 B   8.00 MiB      -
    """
    rows = []
    reports = [report] + ([compare] if compare is not None else [])
    host = [r.by_category.get(HOST, 0) for r in reports]
    if compare is None:
        rows.append(("category", labels[0], "share"))
        for c in DEVICE_CATEGORIES:
            b = report.by_category.get(c, 0)
            rows.append((c, format_bytes(b), f"{b / report.peak_bytes:.1%}" if report.peak_bytes else "-"))
        rows.append((f"peak ({report.phase})", format_bytes(report.peak_bytes), "100.0%"))
        host_row = ("host (off the device)", format_bytes(host[0]), "")
    else:
        rows.append(("category", labels[0], labels[1], "ratio"))
        for c in DEVICE_CATEGORIES:
            a, b = report.by_category.get(c, 0), compare.by_category.get(c, 0)
            rows.append((c, format_bytes(a), format_bytes(b), f"{b / a:.2f}" if a else "-"))
        rows.append(("peak", f"{format_bytes(report.peak_bytes)} ({report.phase})",
                     f"{format_bytes(compare.peak_bytes)} ({compare.phase})",
                     f"{compare.peak_bytes / report.peak_bytes:.2f}" if report.peak_bytes else "-"))
        host_row = ("host (off the device)", format_bytes(host[0]), format_bytes(host[1]),
                    f"{host[1] / host[0]:.2f}" if host[0] else "-")
    peak_row = len(rows) - 1
    if any(host):
        rows.append(host_row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        if i == peak_row:
            lines.append("  ".join("-" * w for w in widths))
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def top_tensors_table(report: PeakReport) -> str:
    """The largest live tensors at the peak."""
    lines = [f"{'bytes':>12}  {'category':<16} {'shape':<20} {'dtype':<9} {'phase':<15} created by"]
    for r in report.top:
        lines.append(f"{format_bytes(r.nbytes):>12}  {r.resolved_category():<16} {str(list(r.shape)):<20} "
                     f"{r.dtype:<9} {r.phase:<15} {r.creator()}")
    return "\n".join(lines)
