"""What a layer's backward holds beside what the plan keeps (`plugins/activations/trace_plan.py`): its temporaries,
net of the saved tensors it frees where the plan holds them all until it ends, alone where they come back one by
one (`layer_temporaries.measure`, `_past_heads`), or each saved storage back from the node that first reads it
(`measure(restored=True)`, `MemoryTracker.record_backward_uses`), what runs between the heads and the first layer
(`Timeline.lead`), and ZeRO 1 and 2's reduction buckets, made at backward's first gradient (`Trace.layer_buffers`). Known answers; the runs that check them end to end are
`tests/activations/test_plan_before_run.py`'s (gpt-tiny, micro-batch 16, where both had put the run over its
budget) and `benchmarks/estimate_budgeted.py`."""
import torch

from xirang_ds.memory.categories import ACTIVATIONS
from xirang_ds.memory.run_shape import RunShape
from xirang_ds.memory.tracker import MemoryTracker
from xirang_ds.memory.trace import trace_model
from xirang_ds.models import BUILTIN_SPECS, build_model
from xirang_ds.plugins.activations.layer_temporaries import Timeline, measure
from xirang_ds.plugins.activations.planner import Choice
from xirang_ds.plugins.activations.trace_plan import _past_heads, on_demand


def test_temporaries_net_of_the_saved_tensors_freed_or_alone():
    # the layer saved 600 + 400 bytes; its backward frees the 600 at clock 6 and makes a 500-byte temporary from 5
    # to 9 and a 300-byte one from 7 to 10: 800 at most (clock 7), 200 of it net of the 600 freed by then
    line = Timeline(records=[(1, 6, 600, True), (1, 20, 400, True), (5, 9, 500, False), (7, 10, 300, False)],
                    spans=[(4, 12, "layer")])
    assert measure(line) == {"layer": 500}  # clock 5: the 500 beside all it saved (the planner counts them all)
    assert measure(line, net_of_saved=False) == {"layer": 800}


def test_a_module_whose_saved_tensors_come_back_one_by_one_takes_the_lesser_bound():
    own, alone, saved = {"a": 500, "b": 500}, {"a": 800, "b": 800}, {"a": 1000, "b": 1000}
    choices = {"a": Choice("keep", 1000, 0.0, 0), "b": Choice("offload", 0, 0.0, 600)}
    held = _past_heads(choices, frozenset(), own, alone, on_demand(False), saved)
    assert held["a"].transient_bytes == 500  # kept: its temporaries net of what it frees, beside all it saved
    assert held["b"].transient_bytes == min(600 + 800, 1000 + 500)  # what comes back at its most, beside them all
    # brought back a little at a time: its temporaries alone beside the most it brings back at once
    held = _past_heads({"b": Choice("compress", 100, 0.0, 200)}, frozenset(), own, alone, on_demand(False), saved)
    assert held["b"].transient_bytes == 200 + 800
    # a copy stream fetches an offloaded module whole, ahead: all it saved, and what it frees is taken off
    held = _past_heads({"b": Choice("offload", 0, 0.0, 2000)}, frozenset(), own, alone, on_demand(True), saved)
    assert held["b"].transient_bytes == 2000 + 500
    assert on_demand(True) == {"compress", "quantize", "sparsify"} and "offload" in on_demand(False)


def test_saved_storages_come_back_each_from_the_first_node_that_reads_them():
    # temporaries of 500 bytes (clocks 5 to 9) and 300 (12 to 16); the module saved A (400 bytes, read by the node
    # started at 6, freed at 8), B (600, read at 10, freed at 11) and C (200, read at 13 and by a node of the next
    # module's backward at 25, freed at 28)
    line = Timeline(records=[(1, 8, 400, True), (1, 11, 600, True), (1, 28, 200, True), (5, 9, 500, False),
                             (12, 16, 300, False)],
                    spans=[(4, 20, "layer"), (20, 30, "next")],
                    returns=[((6,), 8, 400), ((10,), 11, 600), ((13, 25), 28, 200)])
    # A beside the 500 at clock 6: 900; B alone at 10 (the 500 freed at 9); C and the 300 from 13: 500
    assert measure(line, restored=True) == {"layer": 900, "next": 200}  # C back again for the next module's node
    # the bounds it is taken beside: the temporaries alone (500) beside the most that comes back at once (600)
    assert measure(line, net_of_saved=False)["layer"] + 600 == 1100
    own, alone, saved = measure(line), measure(line, net_of_saved=False), {"layer": 1200}
    held = _past_heads({"layer": Choice("offload", 0, 0.0, 600)}, frozenset(), own, alone, on_demand(False), saved,
                       measure(line, restored=True))
    assert held["layer"].transient_bytes == 900
    # fetched whole, ahead (a copy stream): not one by one, so not this figure
    held = _past_heads({"layer": Choice("offload", 0, 0.0, 1200)}, frozenset(), own, alone, on_demand(True), saved,
                       measure(line, restored=True))
    assert held["layer"].transient_bytes == 1200 + own["layer"]


def test_what_runs_between_the_head_and_the_first_layer_counts_as_the_first_layers():
    # the layer saved 1000 bytes (alive to 30); a final norm outside every candidate saved 300 (freed at 8) and
    # makes a 500-byte temporary from 6 to 12; the head's backward ends at 4, the layer's starts at 10
    line = Timeline(records=[(1, 30, 1000, True), (1, 8, 300, True), (6, 12, 500, False)],
                    spans=[(10, 30, "layer")], lead=(4, 10, ("layer",)))
    # clock 6: the norm's 300 and its 500 beside all the layer keeps (the planner counts those, not the norm's)
    assert measure(line) == measure(line, net_of_saved=False) == measure(line, restored=True) == {"layer": 800}
    # with the gradients held: 200 from clock 7 on, when the head's arrived
    assert measure(line, lambda c: 200 * (c > 7), [7]) == {"layer": 1000}
    assert measure(Timeline(records=line.records, spans=line.spans)) == {"layer": 500}  # the layer's own backward


def test_the_tracker_records_when_the_node_reading_a_saved_storage_starts():
    tracker = MemoryTracker("cpu")
    tracker.record_backward_uses = True
    w = torch.randn(64, 64, requires_grad=True)
    with tracker:
        tracker.set_phase("forward")
        x = torch.randn(32, 64) @ w  # saved by the GELU
        y = torch.nn.functional.gelu(x).sum()
        tracker.set_phase("backward")
        y.backward()
        tracker.set_phase("idle")
    saved = {r.op.split(".")[1]: r for r in tracker.records if r.resolved_category() == ACTIVATIONS}
    made = {r.op.split(".")[1]: r for r in tracker.records if r.phase == "backward"}
    # GeluBackward reads the product as it starts: nothing is made between that node's start and its gradient;
    # MmBackward reads the random input after that gradient (then it makes w's)
    assert saved["mm"].backward_uses == [made["gelu_backward"].created - 1]
    assert saved["randn"].backward_uses == [made["gelu_backward"].created]
    assert made["mm"].created == made["gelu_backward"].created + 1
    assert tracker._node_running is None  # no autograd node held past backward


def _trace(stage: int, bucket: int):
    spec = BUILTIN_SPECS["gpt-tiny"]
    config = {"train_micro_batch_size_per_gpu": 16, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}}
    return trace_model(lambda: build_model(spec), RunShape.from_ds_config(config, 2), seq=spec.seq,
                       vocab=spec.vocab)


def test_the_trace_records_the_reduction_buckets_a_layers_backward_holds():
    numel = sum(p.numel() for p in build_model(BUILTIN_SPECS["gpt-tiny"]).parameters())
    # ZeRO 2 with buckets larger than the model: one bf16 bucket (no overlap_comm), made at the first gradient,
    # after backward's worst point with every activation kept (at micro-batch 16: the loss's gradient)
    trace = _trace(2, 4 * numel)
    assert trace.layer_buffers == 2 * 4 * numel
    assert trace.backward_by_category["comm_buffers"] == 0
    assert _trace(0, 4 * numel).layer_buffers == 0  # ZeRO 0 reduces at the boundary, after backward
