"""The HTML timeline in a real headless browser (Debian's chromium): it renders, the SVG plot has the
category areas and the peak marker. Skipped where chromium is not installed (docs/observability.md
describes the manual check)."""
import shutil
import subprocess

import pytest
import torch

from xirang_ds.memory.categories import PARAMETERS
from xirang_ds.memory.timeline import Timeline
from xirang_ds.memory.tracker import MemoryTracker

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")
def test_html_renders_in_headless_chromium(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    t = MemoryTracker("cpu")
    t.seed(model.parameters(), PARAMETERS)
    with t:
        t.set_phase("forward")
        loss = model(torch.randn(32, 64)).sum()
        t.set_phase("backward")
        loss.backward()
    html = tmp_path / "t.html"
    Timeline.from_tracker(t, meta={"step": 1}).save_html(str(html))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", html.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert 'id="peak-bytes"' in dom and "<polygon" in dom and 'id="peak-marker"' in dom
    shot = tmp_path / "t.png"
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1000,900", html.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
