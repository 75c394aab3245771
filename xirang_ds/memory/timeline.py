"""A per-tensor memory timeline of one step, and its exports.

* JSON (`Timeline.save_json` / `load`): our format, read back by ``xirang-ds report``.
* pickle (`save_memory_viz`): the snapshot format of ``torch.cuda.memory._dump_snapshot``, built
  the way ``torch.cuda._memory_viz._profile_to_snapshot`` builds one from a profile: the window's
  alloc/free events in ``device_traces`` and the blocks alive at the end in ``segments``, so
  https://pytorch.org/memory_viz replays it. On CUDA the profiler dumps the allocator's own
  snapshot instead.
* HTML (`save_html`): one self-contained page (inline SVG, no scripts or network) with the
  stacked area by category over time, the peak marked, and the tables.
* PNG (`save_png`): the same plot with matplotlib.
"""
from __future__ import annotations

import html
import json
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Optional

from xirang_ds.config.types import format_bytes
from xirang_ds.memory.categories import (
    ACTIVATIONS,
    CATEGORIES,
    COMM_BUFFERS,
    DEVICE_CATEGORIES,
    GRADIENTS,
    HOST,
    MEMORY_POOL,
    OPTIMIZER_STATES,
    PARAMETERS,
    TEMPORARIES,
)
from xirang_ds.memory.tracker import MemoryTracker, PeakReport, Record, Window

FORMAT = "xirang-timeline"
VERSION = 1
COLORS = {
    PARAMETERS: "#4e79a7", GRADIENTS: "#f28e2b", OPTIMIZER_STATES: "#e15759", ACTIVATIONS: "#76b7b2",
    COMM_BUFFERS: "#edc948", MEMORY_POOL: "#ff9da7", TEMPORARIES: "#b07aa1", HOST: "#9c9c9c",
}


class TraceError(ValueError):
    """A file that is not a xirang timeline."""


@dataclass
class Timeline:
    """Every storage alive during one window, with its life on the window's event clock.

    Attributes:
        tensors: one dict per storage (``nbytes, category, created, freed, last_used, phase,
            module, op, shape, dtype, addr``); ``freed`` is None for storages alive at the end.
        start, end: event clock at the window's start and end.
        phases: ``[(clock, phase), ...]`` phase changes in the window.
        peak: the window's `PeakReport` as a dict (bytes, by category, phase, top tensors).
        meta: free-form facts (step, rank, device, model, config).
    """

    tensors: list[dict]
    start: int
    end: int
    phases: list[tuple[int, str]]
    peak: dict
    meta: dict = field(default_factory=dict)

    # construction -------------------------------------------------------------------------------
    @classmethod
    def from_tracker(cls, tracker: MemoryTracker, window: Optional[Window] = None, meta: Optional[dict] = None,
                     top: int = 10) -> "Timeline":
        """The records of ``window`` (default: the tracker's default window) up to now."""
        window = window or tracker.default
        report: PeakReport = window.report(top=top)
        peak = report.as_dict()
        peak["clock"] = window.peak_clock
        tensors = [_record_dict(r) for r in tracker.records if r.freed is None or r.freed > window.start_clock]
        return cls(tensors=tensors, start=window.start_clock, end=tracker.clock, phases=window.phases, peak=peak,
                   meta={"device_type": tracker.device_type, **(meta or {})})

    # queries ---------------------------------------------------------------------------------
    def series(self, max_points: int = 1500) -> tuple[list[int], dict[str, list[int]]]:
        """Live bytes per category at each event (device categories; ``host`` separately)."""
        deltas: dict[int, dict[str, int]] = {}
        live = {c: 0 for c in CATEGORIES}
        for t in self.tensors:
            c = t["category"]
            if t["created"] <= self.start:
                live[c] += t["nbytes"]
            else:
                deltas.setdefault(t["created"], {}).setdefault(c, 0)
                deltas[t["created"]][c] += t["nbytes"]
            if t["freed"] is not None:
                deltas.setdefault(t["freed"], {}).setdefault(c, 0)
                deltas[t["freed"]][c] -= t["nbytes"]
        clocks = [self.start]
        values = {c: [live[c]] for c in CATEGORIES}
        for clock in sorted(deltas):
            for c, d in deltas[clock].items():
                live[c] += d
            clocks.append(clock)
            for c in CATEGORIES:
                values[c].append(live[c])
        if len(clocks) > max_points:  # keep every local maximum of the total within each bucket
            keep, bucket = [], max(1, len(clocks) // max_points)
            totals = [sum(values[c][i] for c in CATEGORIES if c != "host") for i in range(len(clocks))]
            for i in range(0, len(clocks), bucket):
                j = max(range(i, min(i + bucket, len(clocks))), key=totals.__getitem__)
                keep.append(j)
            clocks = [clocks[i] for i in keep]
            values = {c: [v[i] for i in keep] for c, v in values.items()}
        return clocks, values

    # JSON ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "meta": self.meta, "start": self.start, "end": self.end,
                "phases": [list(p) for p in self.phases], "peak": self.peak, "tensors": self.tensors}

    def save_json(self, path: str) -> str:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f)
        return path

    @classmethod
    def load(cls, path: str) -> "Timeline":
        """Read a timeline JSON written by `save_json`.

        Raises:
            TraceError: the file is missing, not JSON, or not a xirang timeline.
        """
        if not os.path.isfile(path):
            raise TraceError(f"trace file not found: {path!r}")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TraceError(f"{path} is not a xirang timeline (not JSON: {e}); pass the timeline_*.json "
                             "file the profiler wrote") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TraceError(f"{path} is not a xirang timeline (no \"format\": \"{FORMAT}\"); pass the "
                             "timeline_*.json file the profiler wrote")
        if data.get("version") != VERSION:
            raise TraceError(f"{path} is timeline version {data.get('version')}; this xirang_ds reads {VERSION}")
        return cls(tensors=data["tensors"], start=data["start"], end=data["end"],
                   phases=[tuple(p) for p in data["phases"]], peak=data["peak"], meta=data["meta"])

    # memory_viz ---------------------------------------------------------------------------------
    def memory_viz_snapshot(self) -> dict:
        """The window as a ``torch.cuda.memory._snapshot()``-style dict (device 0)."""
        trace: list[dict] = []
        events = []
        for t in self.tensors:
            frames = [{"filename": t["category"], "line": 0, "name": _creator(t)}]
            if t["created"] > self.start:
                events.append((t["created"], 0, {"action": "alloc", "addr": t["addr"], "size": t["nbytes"],
                                                 "stream": 0, "frames": frames, "category": t["category"]}))
            if t["freed"] is not None:
                for order, action in ((1, "free_requested"), (2, "free_completed")):
                    events.append((t["freed"], order, {"action": action, "addr": t["addr"], "size": t["nbytes"],
                                                       "stream": 0, "frames": frames}))
        for clock, _, event in sorted(events, key=lambda e: (e[0], e[1])):
            event["time_us"] = clock
            trace.append(event)
        alive = sorted((t for t in self.tensors if t["freed"] is None), key=lambda t: t["addr"])
        segments = []
        if alive:
            start = min(t["addr"] for t in self.tensors)
            end = max(t["addr"] + t["nbytes"] for t in self.tensors)
            blocks, last = [], start
            for t in alive:
                if t["addr"] > last:
                    blocks.append({"size": t["addr"] - last, "state": "inactive"})
                blocks.append({"size": t["nbytes"], "requested_size": t["nbytes"], "state": "active_allocated",
                               "frames": [{"filename": t["category"], "line": 0, "name": _creator(t)}]})
                last = t["addr"] + t["nbytes"]
            if end > last:
                blocks.append({"size": end - last, "state": "inactive"})
            segments.append({"device": 0, "address": start, "total_size": end - start, "stream": 0,
                             "segment_type": "large", "allocated_size": sum(t["nbytes"] for t in alive),
                             "active_size": sum(t["nbytes"] for t in alive), "requested_size": 0,
                             "blocks": blocks})
        return {"segments": segments, "device_traces": [trace]}

    def save_memory_viz(self, path: str) -> str:
        with open(path, "wb") as f:
            pickle.dump(self.memory_viz_snapshot(), f)
        return path

    # HTML -----------------------------------------------------------------------------------
    def save_html(self, path: str) -> str:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html())
        return path

    def html(self) -> str:
        peak = self.peak
        title = f"xirang memory timeline: {self.meta.get('title', 'step ' + str(self.meta.get('step', '?')))}"
        by_category = peak["peak_by_category"]
        rows = "".join(
            f"<tr><td><span class=sw style='background:{COLORS[c]}'></span>{c}</td>"
            f"<td class=n>{format_bytes(by_category.get(c, 0))}</td>"
            f"<td class=n>{by_category.get(c, 0) / peak['peak_bytes']:.1%}</td></tr>"
            for c in DEVICE_CATEGORIES) if peak["peak_bytes"] else ""
        host = by_category.get(HOST, 0)
        host_line = (f"<p id=\"host-bytes\">Besides the device peak: {format_bytes(host)} in host memory at that moment "
                     "(what plugins moved off the device).</p>" if host else "")
        phase_rows = "".join(f"<tr><td>{html.escape(p)}</td><td class=n>{format_bytes(b)}</td></tr>"
                             for p, b in peak["phase_peaks"].items())
        top_rows = "".join(
            f"<tr><td class=n>{format_bytes(t['nbytes'])}</td><td>{t['category']}</td>"
            f"<td>{html.escape(str(t['shape']))}</td><td>{t['dtype']}</td><td>{t['phase']}</td>"
            f"<td>{html.escape(_creator(t))}</td></tr>" for t in peak["top_tensors"])
        module_rows = "".join(f"<tr><td>{html.escape(m)}</td><td class=n>{format_bytes(b)}</td></tr>"
                              for m, b in self.activations_by_module()[:20])
        meta = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                       for k, v in self.meta.items())
        return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:24px;color:#222}} h1{{font-size:20px}} h2{{font-size:16px;margin-top:28px}}
table{{border-collapse:collapse;font-size:13px}} td,th{{border-bottom:1px solid #ddd;padding:3px 10px;text-align:left}}
td.n{{text-align:right;font-variant-numeric:tabular-nums}} .sw{{display:inline-block;width:10px;height:10px;margin-right:6px}}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>Peak <b id="peak-bytes">{format_bytes(peak['peak_bytes'])}</b> ({peak['peak_bytes']} bytes) in phase
<b id="peak-phase">{html.escape(peak['peak_phase'])}</b>; {len(self.tensors)} storages in the window.</p>
{self.svg()}
<h2>At the peak, by category</h2><table id="by-category"><tr><th>category</th><th>bytes</th><th>share</th></tr>{rows}</table>
{host_line}
<h2>Peak per phase</h2><table><tr><th>phase</th><th>peak</th></tr>{phase_rows}</table>
<h2>Largest tensors at the peak</h2><table><tr><th>bytes</th><th>category</th><th>shape</th><th>dtype</th>
<th>created in</th><th>created by</th></tr>{top_rows}</table>
<h2>Activations created per module (whole window)</h2><table><tr><th>module</th><th>bytes</th></tr>{module_rows}</table>
<h2>Run</h2><table>{meta}</table>
</body></html>
"""

    def activations_by_module(self) -> list[tuple[str, int]]:
        """Bytes of activations each module's forward created (its recomputation in backward included),
        largest first; what no module created (autograd nodes, code outside the modules) is left out."""
        out: dict[str, int] = {}
        for t in self.tensors:
            if t["category"] == ACTIVATIONS and t["module"]:
                out[t["module"]] = out.get(t["module"], 0) + t["nbytes"]
        return sorted(out.items(), key=lambda kv: -kv[1])

    def svg(self, width: int = 900, height: int = 320) -> str:
        clocks, values = self.series()
        device = [c for c in CATEGORIES if c != "host" and any(values[c])]
        pad_l, pad_b, pad_t = 70, 30, 10
        w, h = width - pad_l - 10, height - pad_b - pad_t
        top = max((sum(values[c][i] for c in device) for i in range(len(clocks))), default=1) or 1
        span = max(1, clocks[-1] - clocks[0]) if clocks else 1

        def x(clock: int) -> float:
            return pad_l + (clock - clocks[0]) / span * w

        def y(b: float) -> float:
            return pad_t + h - b / top * h

        parts = []
        base = [0] * len(clocks)
        for c in device:
            upper = [base[i] + values[c][i] for i in range(len(clocks))]
            pts = [(x(clocks[i]), y(upper[i])) for i in range(len(clocks))]
            pts += [(x(clocks[i]), y(base[i])) for i in reversed(range(len(clocks)))]
            d = " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)
            parts.append(f"<polygon points='{d}' fill='{COLORS[c]}' fill-opacity='0.85'><title>{c}</title></polygon>")
            base = upper
        for clock, phase in self.phases:
            if clocks and clocks[0] <= clock <= clocks[-1]:
                parts.append(f"<line x1='{x(clock):.1f}' x2='{x(clock):.1f}' y1='{pad_t}' y2='{pad_t + h}' "
                             f"stroke='#999' stroke-dasharray='3,3'/><text x='{x(clock) + 3:.1f}' y='{pad_t + 12}' "
                             f"font-size='10' fill='#666'>{html.escape(phase)}</text>")
        pc = self.peak.get("clock")
        if pc is not None and clocks:
            px = x(min(max(pc, clocks[0]), clocks[-1]))
            parts.append(f"<line id='peak-marker' x1='{px:.1f}' x2='{px:.1f}' y1='{pad_t}' y2='{pad_t + h}' "
                         f"stroke='#c00' stroke-width='2'/><text x='{px + 4:.1f}' y='{pad_t + 26}' font-size='11' "
                         f"fill='#c00'>peak {format_bytes(self.peak['peak_bytes'])}</text>")
        for i in range(5):
            b = top * i / 4
            parts.append(f"<text x='{pad_l - 6}' y='{y(b) + 4:.1f}' font-size='10' text-anchor='end'>"
                         f"{format_bytes(b)}</text><line x1='{pad_l}' x2='{pad_l + w}' y1='{y(b):.1f}' "
                         f"y2='{y(b):.1f}' stroke='#eee'/>")
        legend = "".join(f"<span style='margin-right:12px'><span class=sw style='background:{COLORS[c]}'></span>{c}"
                         f"</span>" for c in device)
        return (f"<svg id='timeline' xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>"
                f"{''.join(parts)}<text x='{pad_l + w / 2}' y='{height - 8}' font-size='11' text-anchor='middle'>"
                f"allocation events (time order)</text></svg><div>{legend}</div>")

    # PNG ------------------------------------------------------------------------------------
    def save_png(self, path: str) -> str:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise TraceError("PNG output needs matplotlib: pip install 'xirang_ds[plots]'") from None
        clocks, values = self.series()
        device = [c for c in CATEGORIES if c != "host" and any(values[c])]
        fig, ax = plt.subplots(figsize=(10, 4), dpi=110)
        ax.stackplot(clocks, [[v / 2**20 for v in values[c]] for c in device], labels=device,
                     colors=[COLORS[c] for c in device], step="post", alpha=0.9)
        pc = self.peak.get("clock")
        if pc is not None:
            ax.axvline(pc, color="#c00", lw=1.5)
            ax.annotate(f"peak {format_bytes(self.peak['peak_bytes'])} ({self.peak['peak_phase']})",
                        xy=(pc, self.peak["peak_bytes"] / 2**20), xytext=(5, -12), textcoords="offset points",
                        color="#c00", fontsize=9)
        for clock, phase in self.phases:
            ax.axvline(clock, color="#999", lw=0.6, ls="--")
            ax.text(clock, ax.get_ylim()[1] * 0.97, phase, fontsize=7, color="#555", va="top")
        ax.set_xlabel("allocation events (time order)")
        ax.set_ylabel("MiB")
        ax.set_title(f"xirang memory timeline: step {self.meta.get('step', '?')}")
        ax.legend(loc="upper left", fontsize=8, ncol=3)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path


def _creator(t: dict) -> str:
    """What created a tensor of the JSON: its module, else its autograd node, else its op."""
    return t["module"] or t.get("node", "") or t["op"]


def _record_dict(r: Record) -> dict:
    return {"nbytes": r.nbytes, "category": "host" if r.host else r.resolved_category(), "created": r.created,
            "freed": r.freed, "last_used": r.last_used, "phase": r.phase, "module": r.module, "node": r.node,
            "op": r.op,
            "shape": list(r.shape), "dtype": r.dtype, "addr": r.ptr}


def export(timeline: Timeline, out_dir: str, stem: str, formats: Any) -> dict[str, str]:
    """Write the requested formats; returns format → path."""
    os.makedirs(out_dir, exist_ok=True)
    writers = {"json": (timeline.save_json, ".json"), "pickle": (timeline.save_memory_viz, ".pickle"),
               "html": (timeline.save_html, ".html"), "png": (timeline.save_png, ".png")}
    return {fmt: writers[fmt][0](os.path.join(out_dir, stem + writers[fmt][1])) for fmt in formats}
