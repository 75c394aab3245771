"""The session's calibrated peak prediction (`xirang_ds.memory.calibration`): real engines whose batch
shapes change, and the pieces on their own."""
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks
from xirang_ds.memory.calibration import Calibration, InputSignature, ModelTwin, map_phase

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=128,vocab=256"
LENGTHS = [64, 64, 64, 128, 128, 96, 32, 128]
"""Three steps at one length (the first calibrates), then lengths never seen, then seen again."""


def varying_lengths(rank: int, world: int, config: dict, lengths: list[int], hold_losses: bool = False) -> dict:
    """Train one optimizer step per length; return the calibration, the monitor's history and its warnings.
    ``hold_losses`` keeps every loss with its graph (memory that grows from step to step)."""
    import xirang_ds
    from xirang_ds.models import build_model, parse_model_spec

    spec = parse_model_spec(MODEL)
    model = build_model(spec, seed=0)
    engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage()) if record.levelno >= logging.WARNING else None
    logging.getLogger("xirang_ds").addHandler(handler)
    g = torch.Generator().manual_seed(rank)
    held = []
    for length in lengths:
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randint(0, spec.vocab, (engine.train_micro_batch_size_per_gpu(), length), generator=g)
            x = x.to(engine.device)
            loss = engine(x, x)
            engine.backward(loss, retain_graph=hold_losses)
            engine.step()
            if hold_losses:
                held.append(loss)
    session = engine.xirang
    x = torch.zeros(engine.train_micro_batch_size_per_gpu(), lengths[-1], dtype=torch.long, device=engine.device)
    assert session.calibration.predict_batch(x, x) == session.calibration.checks[-1]["predicted_bytes"]
    out = {"calibration": session.calibration.as_dict(), "summary": session.summary(),
           "history": session.plugin("monitor").history, "warnings": list(warnings),
           "figures": session.figures()["monitor"]["calibration"]["calibrated_at"]}
    hooks = len(engine.module._forward_pre_hooks)
    session.remove()
    out["hooks_removed"] = hooks - len(engine.module._forward_pre_hooks)
    logging.getLogger("xirang_ds").removeHandler(handler)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("stage, gas, block, first", [
    (3, 2, {"monitor": {"enabled": True}}, 2),  # ZeRO-3 records its parameter trace in the first step
    # the activation planner plans before the first forward (on the estimator's trace): the second step is
    # the first whose window starts and ends settled
    # (exact_method host: the estimate of hold, the default, was 7.7% over at the end of backward when this was
    # written, and its unseen lengths then missed by 11%; hold's estimate is a case of
    # tests/memory/test_deepspeed_estimator.py). The embeddings' states are pinned fp32: balanced measures them and
    # switches them to int8 only where the data allow, which no estimate knows (it keeps the fp32 bound), and
    # since the end of backward's rounding noise is counted (16 bytes an element) that bound is where the
    # short lengths peak
    (2, 1, {"preset": "balanced", "grad_release": {"exact_method": "host"},
            "optimizer_states": {"keep_fp32_embeddings_and_norms": True}}, 2),
])
def test_prediction_within_two_percent_when_the_batch_shape_changes(stage, gas, block, first):
    runs = run_ranks(varying_lengths, 2, ds_config(stage=stage, dtype="bf16", micro=2, gas=gas, xirang=block),
                     LENGTHS)
    for run in runs:
        cal = run["calibration"]
        assert cal["calibrated_at"] == first and run["figures"] == first
        checks = cal["checks"]
        assert [c["step"] for c in checks] == list(range(first + 1, len(LENGTHS) + 1))
        for c in checks:  # new lengths from the estimator through the measured ones, known ones exactly
            assert abs(c["error"]) <= 0.02, c
        assert all(c["error"] == 0 for c in checks if c["step"] == len(LENGTHS))  # 128 was measured before
        assert cal["factors"] is not None  # the estimator ran for the unseen lengths
        assert f"since step {first}" in run["summary"]
        assert not run["warnings"]
        assert run["history"][-1]["predicted_bytes"] == checks[-1]["predicted_bytes"]
        assert run["hooks_removed"] >= 1


@pytest.mark.distributed
def test_first_step_states_separated_and_growth_warned():
    """ZeRO-0 in fp32 with torch's Adam makes its states in the first step: the calibration on that step
    adds them to forward and backward, so the second step is predicted to the byte. Losses kept with
    their graph grow every step past the prediction: the monitor warns once."""
    config = ds_config(stage=0, dtype="fp32", micro=2, xirang={"monitor": {"enabled": True}})
    plain, held = run_ranks(varying_lengths, 1, config, [64] * 4)[0], run_ranks(varying_lengths, 1, config, [64] * 6,
                                                                                 True)[0]
    cal = plain["calibration"]
    assert cal["calibrated_at"] == 1
    assert [c["error"] for c in cal["checks"]] == [0.0, 0.0, 0.0]
    assert cal["factors"] is None  # one shape: the estimator never had to run
    grown = [w for w in held["warnings"] if "above the calibrated prediction" in w]
    assert len(grown) == 1, held["warnings"]
    assert held["calibration"]["worst_error"] > 0.02


# the pieces -------------------------------------------------------------------------------------

def test_twin_holds_no_memory_and_keeps_ties():
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    model[1].weight = model[0].weight  # tied, as an LM head and its embedding
    twin = ModelTwin(model)
    params = list(twin.skeleton.parameters())
    assert all(p.device.type == "meta" for p in params) and len(params) == 2  # the tie kept: one weight, one bias
    assert model[0].weight.device.type == "cpu"  # the model itself untouched


def test_signature_keys_by_shape_not_value():
    a = InputSignature((torch.zeros(2, 8, dtype=torch.long),), {"labels": torch.ones(2, 8, dtype=torch.long)})
    b = InputSignature((torch.ones(2, 8, dtype=torch.long),), {"labels": torch.zeros(2, 8, dtype=torch.long)})
    c = InputSignature((torch.zeros(2, 9, dtype=torch.long),), {"labels": torch.ones(2, 9, dtype=torch.long)})
    assert a.key == b.key != c.key
    assert a.describe() == "2x8 int64, 2x8 int64"


def test_estimate_of_a_forward_with_keywords_and_no_loss():
    """A model called with keywords whose output is logits (the loss computed outside): traced with a
    stand-in loss, and the estimate says what it did not see."""
    from xirang_ds.planning.estimator import estimate_run

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(100, 16)
            self.out = torch.nn.Linear(16, 100)

        def forward(self, input_ids=None):
            return {"logits": self.out(self.embed(input_ids))}

    twin = ModelTwin(Head())
    sig = InputSignature((), {"input_ids": torch.zeros(4, 32, dtype=torch.long)})
    est = estimate_run(twin.build, ds_config(stage=0, dtype="fp32", micro=4), inputs=sig.fake)
    assert est.phases["forward"]["activations"] >= 4 * 32 * 100 * 4  # the logits
    assert any("returns no loss" in n for n in est.notes)


def test_map_phase_scales_then_fits_a_line():
    assert map_phase(200.0, [(100.0, 110.0)]) == pytest.approx(220.0)
    # a fixed 10 the estimator misses: two points find it where one scales it
    assert map_phase(50.0, [(100.0, 110.0), (200.0, 210.0)]) == pytest.approx(60.0)
    assert map_phase(150.0, [(100.0, 110.0), (102.0, 112.0)]) == pytest.approx(150.0 * 112 / 102)  # the nearest scales


class _Window:
    """A tracker window's figures: each phase's peak and when, the records alive at the end."""

    def __init__(self, phases: dict, kept: list = ()):
        self.phase_peaks = {p: b for p, (b, _) in phases.items()}
        self.phase_peak_clocks = {p: c for p, (_, c) in phases.items()}
        self.start_clock = 0
        self.tracker = SimpleNamespace(live_records=lambda: list(kept))


def _calibration() -> Calibration:
    session = SimpleNamespace(plugins=[], events=[], engine=SimpleNamespace(global_rank=1, optimizer=None),
                              _tracker=None)
    cal = Calibration(session, torch.nn.Linear(2, 2))
    cal.window_started()
    return cal


def test_states_made_in_the_window_count_in_phases_before_them():
    cal = _calibration()
    cal._record(None, (torch.zeros(2, 4),), {})
    states = SimpleNamespace(host=False, created=30, nbytes=64, resolved_category=lambda: "optimizer_states")
    window = _Window({"forward": (500, 10), "backward": (600, 20), "optimizer_step": (650, 40)}, [states])
    cal.observe(1, 650, window)
    assert cal.steady_phases == {"forward": 564, "backward": 664, "optimizer_step": 650}
    assert cal.predicted_peak_bytes == 664 and cal.predicted_phase == "backward"


def test_memory_events_make_it_stale_until_a_steady_window():
    cal = _calibration()
    flat = _Window({"forward": (100, 1), "backward": (120, 2)})
    cal._record(None, (torch.zeros(2, 4),), {})
    cal.observe(1, 120, flat)
    cal.session.events.append({"kind": "monitor_action", "action": "halve_micro_batch"})
    cal._record(None, (torch.zeros(1, 4),), {})
    record = cal.observe(2, 90, _Window({"forward": (80, 1), "backward": (90, 2)}))
    assert cal._stale and "calibrated" not in record  # the action happened inside this window
    cal.window_started()
    cal._record(None, (torch.zeros(1, 4),), {})
    record = cal.observe(3, 90, _Window({"forward": (80, 1), "backward": (90, 2)}))
    assert record.get("calibrated") and cal.calibrated_at == 3 and cal.predicted_peak_bytes == 90
    cal.window_started()
    cal._record(None, (torch.zeros(1, 4),), {})
    assert cal.observe(4, 90, _Window({"forward": (80, 1), "backward": (90, 2)}))["error"] == 0


def test_on_an_accelerator_one_factor_from_a_window_that_did_not_grow():
    cal = _calibration()
    cal.on_accelerator = True
    cal._record(None, (torch.zeros(2, 4),), {})
    grew = SimpleNamespace(baseline_bytes=100 << 20, live_bytes=140 << 20)  # the first step made its states
    assert "calibrated" not in cal.observe(1, 300 << 20, grew)
    cal.window_started()
    cal._record(None, (torch.zeros(2, 4),), {})
    flat = SimpleNamespace(baseline_bytes=140 << 20, live_bytes=140 << 20)
    assert cal.observe(2, 340 << 20, flat)["calibrated"]
    assert cal.steady_phases == {"peak": 340 << 20} and cal.predicted_peak_bytes == 340 << 20


@pytest.mark.gpu
def test_prediction_on_cuda_from_the_allocator():
    """On CUDA the calibration has the allocator's totals only: one factor, from a window whose allocated
    bytes did not grow; every later check within 2%."""
    (run,) = run_ranks(varying_lengths, 1, ds_config(stage=2, dtype="bf16", micro=2,
                                                     xirang={"monitor": {"enabled": True}}), LENGTHS)
    cal = run["calibration"]
    assert cal["calibrated_at"] is not None and "peak" in cal["steady_phases"]
    assert cal["checks"] and all(abs(c["error"]) <= 0.02 for c in cal["checks"]), cal["checks"]
