"""The live-storage tracker: exact bytes for known tensor sets, views counted once, categories,
phases, windows and the timeline exports."""
import json
import pickle

import pytest
import torch

from xirang_ds.memory.categories import ACTIVATIONS, GRADIENTS, HOST, OPTIMIZER_STATES, PARAMETERS, TEMPORARIES
from xirang_ds.memory.timeline import Timeline, TraceError, export
from xirang_ds.memory.tracker import MemoryTracker


def test_known_tensor_set_gives_known_bytes():
    with MemoryTracker("cpu") as t:
        a = torch.empty(1024)                   # 4096
        b = torch.empty(256, dtype=torch.bfloat16)  # 512
        assert t.live_bytes == 4608
        del b
        c = torch.empty(10, dtype=torch.float64)    # 80
    assert t.peak_bytes == 4608
    assert t.live_bytes == 4096 + 80
    del a, c


def test_views_and_inplace_count_once():
    with MemoryTracker("cpu") as t:
        flat = torch.zeros(1000)
        views = [flat[i * 100:(i + 1) * 100].view(10, 10) for i in range(10)]
        flat.add_(1)
        flat.t_() if flat.dim() == 2 else None
    assert t.peak_bytes == 4000
    del views


def test_preexisting_storage_seen_through_a_view_is_not_counted():
    big = torch.zeros(10_000)
    with MemoryTracker("cpu") as t:
        v = big[:10]
        w = v + 1  # 40 new bytes
    assert t.peak_bytes == 40
    del w


def test_seed_mark_and_priority():
    p = torch.zeros(100)
    t = MemoryTracker("cpu")
    assert t.seed([p], PARAMETERS) == 400
    assert t.seed([p], PARAMETERS) == 0  # already known
    t.mark([p], ACTIVATIONS)  # weaker role does not override
    assert t.report().by_category[PARAMETERS] == 400


def test_forward_survivors_are_activations_and_scopes_apply():
    lin = torch.nn.Linear(64, 64)
    t = MemoryTracker("cpu")
    t.seed(lin.parameters(), PARAMETERS)
    x = torch.randn(32, 64, requires_grad=False)
    with t:
        t.set_phase("forward")
        y = torch.relu(lin(x))        # 8192 bytes; relu's result is saved for backward
        tmp = y * 2                    # freed inside forward -> temporary
        del tmp
        with t.scope(OPTIMIZER_STATES):
            s = torch.zeros(10)
        t.set_phase("backward")
        y.sum().backward()
        t.mark([p.grad for p in lin.parameters()], GRADIENTS)
    r = t.report()
    assert r.by_category[PARAMETERS] == (64 * 64 + 64) * 4
    assert r.by_category[GRADIENTS] == (64 * 64 + 64) * 4
    assert r.by_category[OPTIMIZER_STATES] == 40
    assert r.by_category[ACTIVATIONS] >= 8192
    del y, s


def test_host_tier_is_not_device_memory():
    with MemoryTracker("cpu") as t:
        with t.host_tier():
            h = torch.empty(1024)
        d = torch.empty(256)
    assert t.live_bytes == 1024 and t.host_bytes == 4096
    assert t.report().by_category[HOST] == 4096
    del d, h


def test_windows_are_independent():
    with MemoryTracker("cpu") as t:
        w = t.open_window()
        a = torch.empty(1000)
        del a
        t.reset_peak()  # the default window restarts; w keeps its peak
        b = torch.empty(10)
    assert w.peak_bytes == 4000 and t.peak_bytes == 40
    del b


def _train_step(model, opt, tracker):
    x = torch.randn(16, 32)
    tracker.set_phase("forward")
    loss = model(x).pow(2).mean()
    tracker.set_phase("backward")
    loss.backward()
    tracker.mark([p.grad for p in model.parameters()], GRADIENTS)
    tracker.set_phase("optimizer_step")
    opt.step()
    tracker.mark(opt.state, OPTIMIZER_STATES)
    opt.zero_grad()


def test_same_peak_to_the_byte_run_after_run():
    peaks = []
    for _ in range(3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
        opt = torch.optim.AdamW(model.parameters())
        t = MemoryTracker("cpu")
        t.seed(model.parameters(), PARAMETERS)
        with t:
            for _ in range(3):
                _train_step(model, opt, t)
        r = t.report()
        peaks.append((r.peak_bytes, r.phase, tuple(sorted(r.by_category.items()))))
    assert peaks[0] == peaks[1] == peaks[2]
    params = (32 * 128 + 128 + 128 * 32 + 32) * 4
    assert dict(peaks[0][2])[OPTIMIZER_STATES] == 2 * params + 4 * 4  # exp_avg, exp_avg_sq + 4 step scalars


def test_timeline_exports(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = MemoryTracker("cpu", record_uses=True)
    t.seed(model.parameters(), PARAMETERS)
    t.watch_module(model)
    with t:
        _train_step(model, opt, t)
    tl = Timeline.from_tracker(t, meta={"step": 1})
    files = export(tl, str(tmp_path), "tl", ["json", "pickle", "html", "png"])
    back = Timeline.load(files["json"])
    assert back.peak == json.loads(json.dumps(tl.peak))
    assert {x["category"] for x in back.tensors} >= {PARAMETERS, GRADIENTS, ACTIVATIONS}
    assert any(x["module"] == "0" for x in back.tensors)  # the first Linear
    # the pickle is what torch's memory_viz tooling parses
    from torch.cuda import _memory_viz

    snap = pickle.load(open(files["pickle"], "rb"))
    assert _memory_viz.segsum(snap)
    assert _memory_viz.trace(snap)
    html = open(files["html"]).read()
    assert "id='timeline'" in html and "id=\"peak-bytes\"" in html
    assert not any(ref in html for ref in ("<script", "src=", "href=", "@import"))  # self-contained
    assert open(files["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_not_a_trace(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(TraceError, match="not a xirang timeline"):
        Timeline.load(str(bad))
    with pytest.raises(TraceError, match="not found"):
        Timeline.load(str(tmp_path / "missing.json"))


def test_fake_tensors_trace_exact_bytes_without_memory():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run(fake):
        mode = FakeTensorMode() if fake else None
        if mode:
            mode.__enter__()
        try:
            torch.manual_seed(0)
            lin = torch.nn.Linear(256, 512)
            x = torch.randn(64, 256)
            t = MemoryTracker("cpu", fake=fake)
            t.seed(lin.parameters(), PARAMETERS)
            with t:
                t.set_phase("forward")
                loss = torch.nn.functional.gelu(lin(x)).sum()
                t.set_phase("backward")
                loss.backward()
            return t.report().peak_bytes
        finally:
            if mode:
                mode.__exit__(None, None, None)

    assert run(True) == run(False)


def test_wrapper_subclass_tensors_count_their_inner_storages():
    """torchao's quantized optimizer states are wrapper subclasses: their bytes are the inner tensors'."""
    pytest.importorskip("torchao")
    from torchao.optim.subclass_8bit import OptimState8bit

    from xirang_ds.memory.tracker import MemoryTracker

    tracker = MemoryTracker("cpu")
    with tracker:
        state = OptimState8bit.zeros((4096,), signed=True, block_size=256, device="cpu")
    inner = sum(getattr(state, n).untyped_storage().nbytes() for n in state.__tensor_flatten__()[0])
    assert tracker.live_bytes >= 4096  # the int8 codes at least (the shared qmap may predate tracking)
    tracker.mark([{"exp_avg": state}], "optimizer_states")
    assert tracker.by_category(tracker.live_records())["optimizer_states"] == inner


def test_the_peak_besides_activations_leaves_out_activation_bytes_at_every_moment():
    t = MemoryTracker("cpu")
    with t:
        w = t.open_window()
        with t.scope(ACTIVATIONS):
            saved = torch.empty(1024)            # 4096 activation bytes
        temp = torch.empty(512)                  # 2048 others: 2048 besides activations
        del temp
        later = torch.empty(768)                 # 3072 others, a role given afterwards
        assert (t.activations_live, w.besides_activations_peak) == (4096, 3072)
        t.mark([later], ACTIVATIONS)
        assert t.activations_live == 4096 + 3072
        t.mark([later], HOST)                    # a stronger role moves it off the device
        assert t.activations_live == 4096
        del saved
        assert t.activations_live == 0 and w.peak_bytes == 4096 + 3072
        w.reset()
        assert w.besides_activations_peak == t.live_bytes
    del later
