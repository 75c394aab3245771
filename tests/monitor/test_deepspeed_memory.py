"""``engine.xirang.memory()``: the run's peak and its breakdown for a user's own script, and the profiler's
report of the same: the user's ZeRO stage, the host apart from the device breakdown, activations per module."""
import json
import os

import pytest

from tests.harness.engine_runs import data_iter, ds_config
from xirang_ds.launch import run_ranks

# grad_release runs DeepSpeed at stage 0 underneath a ZeRO-2 run; offload puts the blocks' activations on the host
BLOCK = {"monitor": {"enabled": True}, "grad_release": {"enabled": True},
         "activations": {"enabled": True, "planner": False, "offload": ["blocks.*"]}}


def _run(rank, world, out_dir, block, measure=True):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-tiny"]
    model = build_model(spec)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage=2, micro=2, xirang=block))
    data = data_iter(2, spec.seq, rank, world)
    reports = []
    for _ in range(3):
        x, y = next(data)
        engine.backward(engine(x, y))
        engine.step()
        if measure:
            reports.append(engine.xirang.memory())
    monitor = engine.xirang.plugin("monitor")
    names = {name or type(module).__name__ for name, module in model.named_modules()}  # as the tracker names them
    return reports, [h["peak_bytes"] for h in monitor.history], names


def test_memory_returns_the_runs_peak_and_its_breakdown(tmp_path):
    reports, checks, _ = run_ranks(_run, 1, str(tmp_path), BLOCK)[0]
    last = reports[-1]
    assert last.peak_bytes == max(checks) and last.step == 1 + checks.index(max(checks))
    assert [r.peak_bytes for r in reports] == [max(checks[:i + 1]) for i in range(3)]  # the highest so far
    assert sum(last.by_category.values()) == last.peak_bytes and "host" not in last.by_category
    assert last.by_category["parameters"] > 0 and last.host_bytes > 0  # the offloaded activations, apart
    assert last.phase in ("forward", "backward", "optimizer_step") and last.budget_bytes > 0
    assert last.as_dict()["peak_bytes"] == last.peak_bytes


def _without_monitor(rank, world):
    import xirang_ds
    from xirang_ds.models import BUILTIN_SPECS, build_model

    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage=0, xirang={"monitor": {"enabled": False},
                                                                        "grad_release": {"enabled": True}}))
    try:
        engine.xirang.memory()
    except xirang_ds.XirangConfigError as e:
        return str(e)


def test_memory_without_the_monitor_names_the_key_and_the_fix(tmp_path):
    message = run_ranks(_without_monitor, 1)[0]
    assert "xirang.monitor.enabled" in message and '"monitor": {"enabled": true}' in message


def test_profiler_report_shows_the_users_stage_the_host_apart_and_modules_only(tmp_path):
    out = str(tmp_path / "trace")
    block = {**BLOCK, "profiler": {"enabled": True, "step": 2, "output_dir": out, "formats": ["json", "html"]}}
    _, _, names = run_ranks(_run, 1, str(tmp_path), block, False)[0]
    from xirang_ds.memory.report import breakdown_table
    from xirang_ds.memory.timeline import Timeline
    from xirang_ds.memory.tracker import PeakReport

    timeline = Timeline.load(os.path.join(out, "timeline_rank0.json"))
    assert timeline.meta["zero_stage"] == 2
    peak = timeline.peak
    device = {c: b for c, b in peak["peak_by_category"].items() if c != "host"}
    assert sum(device.values()) == peak["peak_bytes"] and peak["peak_by_category"]["host"] > 0
    html = open(os.path.join(out, "timeline_rank0.html"), encoding="utf-8").read()
    table = html.split('id="by-category"', 1)[1].split("</table>", 1)[0]
    cells = [cell.split("<", 1)[0] for cell in table.split("<td class=n>")[1:]]
    assert abs(sum(float(c.rstrip("%")) for c in cells if c.endswith("%")) - 100.0) < 0.5, table
    assert ">host<" not in table and 'id="host-bytes"' in html
    rows = timeline.activations_by_module()
    assert rows and all(module in names for module, _ in rows), rows
    text = breakdown_table(PeakReport(peak["peak_bytes"], peak["peak_by_category"], peak["peak_phase"],
                                      peak["phase_peaks"]))
    lines = text.splitlines()
    shares = [float(line.split()[-1].rstrip("%")) for line in lines if line.split()[0] in device]
    assert abs(sum(shares) - 100.0) < 0.5, text
    assert lines[-1].startswith("host (off the device)"), text
