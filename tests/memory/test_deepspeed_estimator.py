"""The estimator against measured peaks of real DeepSpeed runs (a subset of the matrix; the bench
covers the rest: docs/observability.md)."""
import re

import pytest

from tests.harness.engine_runs import ds_config
from xirang_ds.bench import bench_rank
from xirang_ds.launch import run_ranks
from xirang_ds.memory.model_states import offloaded_optimizer_host, offloaded_params_host
from xirang_ds.planning.estimator import EstimateError, RunShape, korthikanti_activations
from xirang_ds.planning.spec import estimate_spec
from xirang_ds.models import ModelSpecError, build_model, parse_model_spec

INT8 = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}], "min_numel": 0}}
GRAD_RELEASE = {"grad_release": {"enabled": True, "exact_method": "host"}}
"""Exact clipping with the host stash, the method these cases were measured with (the default was ``host``
until issue 58 made it ``hold``: the estimate of ``hold`` is `HOLD`'s case)."""
HOLD = {"grad_release": {"enabled": True}}
HOST_STATES = {"grad_release": {"enabled": True, "states": "host", "exact_method": "host"}}
NO_MASTER = {"grad_release": {"enabled": True, "masters": "none", "exact_method": "host"}}
AHEAD = {"grad_release": {**HOST_STATES["grad_release"], "prefetch_states": True}}
PREVIOUS_STEP = {"grad_release": {"enabled": True, "clipping": "previous_step"}}
"""Clipping by the previous step's norm (`test_estimate_within_ten_percent_of_measured` clips at 1.0): no held pass."""
"""The next bucket's states fetched ahead: two buckets' at the update (early and synchronous on the CPU)."""
ON_DEMAND = {"precision": {"enabled": True, "weight_copies": "on_demand"}}  # DeepSpeed in fp32, masters shared
PRECISION = {"precision": {"enabled": True}}  # auto: persistent copies (DeepSpeed's bf16) on 2 ranks at ZeRO 1/2
CHUNK = {"activations": {"enabled": True, "planner": False, "chunk": ["lm_head"], "chunk_tokens": 64}}
"""The head and its loss chunked: the trace runs them chunked (`plugins/activations/estimate.py`)."""
VOCAB = "gpt:layers=2,hidden=64,heads=4,seq=64,vocab=2048"  # the loss's logits are most of the activations
CASES = [  # model, stage, dtype, micro, world, bucket, xirang block
    ("gpt-tiny", 0, "bf16", 4, 1, 1e6, None),
    ("gpt-tiny", 2, "fp32", 4, 2, 1e6, None),
    ("llama-tiny", 1, "bf16", 8, 2, 1e5, None),
    ("gpt-tiny", 3, "bf16", 4, 2, 1e6, None),
    ("gpt-tiny", 2, "bf16", 4, 2, 1e6, INT8),
    ("gpt-small", 2, "bf16", 1, 2, 1e6, GRAD_RELEASE),
    # exact_method hold (the default): the held shard at the end of backward, no gradient whole there (the
    # update runs after backward); 7.7% over before issue 57, 2.4% then (30,149,728 bytes against 29,430,460),
    # 1.1% with the bucket's Adam on torch's multi-tensor path as the run steps it (29,760,096)
    ("gpt-small", 2, "bf16", 1, 2, 1e6, HOLD),
    ("gpt-small", 2, "bf16", 1, 2, 1e6, NO_MASTER),
    ("gpt-small", 2, "bf16", 1, 2, 1e6, HOST_STATES),  # measured 16,107,352 bytes; 29,400,920 on the device
    ("gpt-small", 2, "bf16", 1, 2, 1e6, AHEAD),  # 16,107,352 too: two buckets' states after backward stay below it
    # each bucket updates in backward as it is reduced, the activations still alive: the estimate had priced the
    # updates at its end only (-5.5%, and -15.8% with the states in host memory: 16,108,136 of 19,133,032)
    ("gpt-small", 2, "bf16", 1, 2, 1e6, PREVIOUS_STEP),
    ("gpt-small", 2, "bf16", 1, 2, 1e6, {"grad_release": {**PREVIOUS_STEP["grad_release"], "states": "host"}}),
    ("gpt-small", 2, "bf16", 1, 2, 1e6, {**NO_MASTER, **INT8}),  # in place: no widened shard, chunks
    ("gpt-small", 0, "bf16", 4, 1, 1e6, GRAD_RELEASE),
    # the head's whole gradient at the start of backward beside the loss's temporaries: DeepSpeed holds none
    # there yet, nor does grad_release (the estimate counted its buckets there: +5.8%, above plain's)
    ("gpt:layers=4,hidden=128,heads=4,seq=128,vocab=8192", 2, "bf16", 4, 2, 1e6, GRAD_RELEASE),
    ("gpt-tiny", 2, "bf16", 4, 2, 1e6, ON_DEMAND),  # the trace runs under precision's kernels and autocast
    ("llama-tiny", 1, "bf16", 4, 2, 1e6, PRECISION),
    (VOCAB, 2, "bf16", 4, 2, 1e6, CHUNK),  # plain: 10,356,344 bytes measured, chunked: 6,327,032
    (VOCAB, 3, "fp32", 4, 2, 1e6, CHUNK),
    (VOCAB, 2, "fp32", 4, 2, 1e6, {"activations": {**CHUNK["activations"], "planner": True}}),  # profiled chunked
]
STEP_BOUND = "gpt:layers=2,hidden=256,heads=4,seq=16,vocab=512"
"""Model states dominate (benchmarks/masters_step_bound.py). Its forward at ZeRO-3 holds DeepSpeed's
all-gather flat buffers beside the gathered weights (at micro-batch 1 and 1e6 buckets, 20,824,396 bytes estimated
before the fetches were replayed, 22,855,108 since, against 22,855,012 measured);
`test_zero3_step_estimate_follows_the_sub_groups` checks its optimizer step."""


@pytest.mark.distributed
@pytest.mark.parametrize("model, stage, dtype, micro, world, bucket, xirang", CASES)
def test_estimate_within_ten_percent_of_measured(model, stage, dtype, micro, world, bucket, xirang):
    clip = 1.0 if xirang is not None and (xirang.get("grad_release") or {}).get("clipping") == "previous_step" else 0.0
    config = ds_config(stage=stage, dtype=dtype, micro=micro, bucket=bucket, xirang=xirang, clip=clip)
    measured = max(r["peak_bytes"] for r in run_ranks(bench_rank, world, model, config, 3, None, 0,
                                                      xirang is not None))
    predicted = estimate_spec(model, config, world).predicted_peak_bytes
    # DeepSpeed is modelled buffer by buffer; grad_release's backward by two points (its start and end)
    tolerance = 0.03 if "grad_release" in (xirang or {}) else 0.01
    assert abs(predicted - measured) / measured <= tolerance, (predicted, measured)


def test_grad_release_estimate_takes_the_largest_gradients_by_rows(monkeypatch):
    """The chunked head's and the embedding's weights (2048 x 64 each, alone in their buckets) give their
    gradients by rows. Under accumulation each round goes into the fp32 accumulator as it comes: at a
    backward point where the traced run has made gradients, they are the accumulator and one round of 1/8
    shard per rank (2 x 8,192) with its reduced part (8,192), 49,152 bf16 bytes more, where the head's whole
    gradient was 262,144. At this model's traced points DeepSpeed has made none in this micro-step yet (it
    holds only those carried from the one before): the accumulator alone."""
    from xirang_ds.memory.categories import GRADIENTS
    from xirang_ds.planning.estimator import BACKWARD_START
    from xirang_ds.plugins.grad_release.plugin import GradReleasePlugin

    config = ds_config(stage=2, dtype="bf16", micro=4, gas=2, xirang={**CHUNK, **GRAD_RELEASE})
    accumulator = estimate_spec(VOCAB, config, 2).phases["forward"]["gradients"]  # fp32, this rank's shard
    assert accumulator == 4 * sum(-(-p.numel() // 2) for p in build_model(parse_model_spec(VOCAB)).parameters())
    assert estimate_spec(VOCAB, config, 2).phases["backward"]["gradients"] == accumulator
    adjust = GradReleasePlugin.adjust_estimate

    def made_there(self, phases, shape, numels):  # traced points past the first gradients of this micro-step
        made = {name: {**phases[name], GRADIENTS: phases[name].get(GRADIENTS, 0) + 10 ** 7}
                for name in ("backward", BACKWARD_START)}
        return adjust(self, {**phases, **made}, shape, numels)

    monkeypatch.setattr(GradReleasePlugin, "adjust_estimate", made_there)
    assert estimate_spec(VOCAB, config, 2).phases["backward"]["gradients"] == accumulator + 49_152
    monkeypatch.setattr(GradReleasePlugin, "_rows_numels", lambda self, world, bucket: [])
    assert estimate_spec(VOCAB, config, 2).phases["backward"]["gradients"] == accumulator + 262_144


def fused_bench_rank(rank: int, world: int, *args):
    """`bench_rank` with DeepSpeed's FusedAdam (which needs a GPU or a JIT build) replaced by torch's
    fused AdamW, which the engine takes for it (``FP16_Optimizer`` at ZeRO 0 in 16 bits): no step
    temporaries, so the wrapper's gradient preparation is the step's peak."""
    from tests.harness.engine_runs import fused_adam_stand_in

    fused_adam_stand_in(kernel=True)
    return bench_rank(rank, world, *args)


PREPARE_CASES = [  # stage, micro, world, bucket, gas, fused: where the step's preparation or accumulation peaks
    (0, 2, 1, 5e5, 1, True),  # FP16_Optimizer: every gradient upcast, then flattened
    (1, 2, 2, 5e5, 1, True),  # the partition flattened, then upcast, before the update
    (1, 1, 1, 3e7, 4, False),  # ZeRO 1 keeps its bucket between micro-steps
    (2, 1, 1, 3e7, 4, False),  # ZeRO 2 accumulates into new tensors until the epilogue
]


@pytest.mark.distributed
@pytest.mark.parametrize("stage, micro, world, bucket, gas, fused", PREPARE_CASES)
def test_estimate_step_preparation_and_accumulation(stage, micro, world, bucket, gas, fused):
    config = ds_config(stage=stage, dtype="bf16", micro=micro, gas=gas, bucket=bucket)
    if fused:
        del config["optimizer"]["params"]["torch_adam"]
        config["zero_allow_untested_optimizer"] = True  # the stand-in is not FusedAdam's class
    rank_fn = fused_bench_rank if fused else bench_rank
    runs = run_ranks(rank_fn, world, "gpt-tiny", config, 3, None, 0, False)
    worst = max(runs, key=lambda r: r["peak_bytes"])
    est = estimate_spec("gpt-tiny", config, world)
    assert abs(est.predicted_peak_bytes - worst["peak_bytes"]) / worst["peak_bytes"] <= 0.01, \
        (est.predicted_peak_bytes, worst["peak_bytes"])
    assert est.peak_phase == worst["peak_phase"]


def test_estimate_breakdown_and_phases():
    est = estimate_spec("gpt-tiny", ds_config(stage=2, dtype="bf16", micro=4, bucket=5e8), 2)
    # the default 5e8-element bucket dominates, in backward, as measured (notes/cpu-runtime.md)
    assert est.peak_phase == "backward"
    assert est.by_category["comm_buffers"] == 2 * int(5e8)
    assert est.as_dict()["predicted_peak_bytes"] == est.predicted_peak_bytes
    assert est.korthikanti_activations == korthikanti_activations(2, 64, 4, 64, 4)


def test_micro_batch_from_train_batch_size_and_errors():
    shape = RunShape.from_ds_config({"train_batch_size": 32, "gradient_accumulation_steps": 2}, world_size=2)
    assert shape.micro_batch == 8
    with pytest.raises(EstimateError, match="neither"):
        RunShape.from_ds_config({})


@pytest.mark.parametrize("text, fragment", [
    ("gpt:layers=2,hidden=65,heads=4,seq=8,vocab=16", "heads (4) must divide hidden (65)"),
    ("gpt:layers=2,hidden=64", "missing heads, seq, vocab"),
    ("gpt:layers=2,hidden=64,heads=4,seq=8,vocab=16,depth=3", "'depth' is unknown"),
    ("resnet", "unknown model"),
    ("nosuch.module:factory", "cannot load model factory"),
])
def test_bad_model_specs(text, fragment):
    with pytest.raises(ModelSpecError, match=re.escape(fragment)):
        parse_model_spec(text)


def test_a_factory_that_does_not_load_and_lacks_its_flags_is_told_both_at_once():
    with pytest.raises(ModelSpecError) as e:
        parse_model_spec("nosuch.module:factory")
    assert "cannot load model factory" in str(e.value) and "pass --seq and --vocab" in str(e.value)


def test_cli_estimate_json(tmp_path, capsys):
    import json

    from xirang_ds.cli import main

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(ds_config(stage=1, micro=2)))
    out = tmp_path / "e.json"
    assert main(["estimate", "--model", "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256",
                 "--ds-config", str(cfg), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["predicted_peak_bytes"] > 0 and set(data["by_category"]) >= {"parameters", "activations"}
    assert main(["estimate", "--model", "gpt:layers=2,hidden=65,heads=4,seq=8,vocab=16",
                 "--ds-config", str(cfg)]) == 2
    assert "must divide hidden" in capsys.readouterr().err


def test_planner_keeping_everything_is_modelled_and_fixed_plans_are_not():
    """The activations planner keeps every saved tensor when the run fits (no added time): the estimate
    is the plain one. A budget no plan meets is planned and refused (`trace_plan`); a module fixed to
    recompute is not modelled; a head fixed to chunk is."""
    plain = estimate_spec("gpt-tiny", ds_config(stage=2, micro=4), 1)
    for block in ({"activations": {"enabled": True}}, {"memory_pool": {"enabled": True}},
                  {"activations": {"enabled": True}, "memory_pool": {"enabled": True}}):
        est = estimate_spec("gpt-tiny", ds_config(stage=2, micro=4, xirang=block), 1)
        assert est.predicted_peak_bytes == plain.predicted_peak_bytes
        assert not [n for n in est.notes if "not modelled" in n], est.notes
    fixed = estimate_spec("gpt-tiny", ds_config(stage=2, micro=4, xirang={
        "activations": {"enabled": True, "recompute": ["blocks.*"]}}), 1)
    tight = estimate_spec("gpt-tiny", ds_config(stage=2, micro=4, xirang={
        "activations": {"enabled": True, "budget": 1024}}), 1)
    sized = estimate_spec("gpt-tiny", ds_config(stage=2, micro=4, xirang={
        "memory_pool": {"enabled": True, "size": 2**20}}), 1)
    for est, section in ((fixed, "activations"), (sized, "memory_pool")):
        assert any(n.startswith(f"{section}: its effect on memory is not modelled") for n in est.notes), est.notes
    assert tight.fits is False and tight.plans["activations"].least_bytes > 1024
    assert any(n.startswith("activations: no activation plan fits") for n in tight.notes), tight.notes
    # a head fixed to chunk runs chunked in the trace: modelled, and below the plain estimate
    whole = estimate_spec(VOCAB, ds_config(stage=2, micro=4), 1)
    chunked = estimate_spec(VOCAB, ds_config(stage=2, micro=4, xirang=CHUNK), 1)
    assert not [n for n in chunked.notes if "not modelled" in n], chunked.notes
    assert chunked.predicted_peak_bytes < whole.predicted_peak_bytes


def test_zero3_working_set_follows_the_reuse_distance():
    """DeepSpeed keeps a parameter gathered from forward to backward when its reuse comes within
    ``stage3_max_reuse_distance``: the default keeps all of gpt-tiny, 0 keeps none (without a prefetch bucket,
    only the module in use holds its weight gathered at forward's end: measured 5,016,316 bytes at the peak,
    estimated 5,014,156), one rank gathers nothing."""
    def forward_parameters(world: int, **zero) -> int:
        config = ds_config(stage=3, micro=4)
        config["zero_optimization"].update(zero)
        return estimate_spec("gpt-tiny", config, world).phases["forward"]["parameters"]

    from xirang_ds.models import build_model

    numels = [p.numel() for p in build_model(parse_model_spec("gpt-tiny")).parameters()]
    model, largest = sum(numels), max(numels)
    part = -(-model // 4) * 4 // 2  # ZeRO's padded partition on 2 ranks
    kept = forward_parameters(2, stage3_prefetch_bucket_size=0)
    released = forward_parameters(2, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    assert kept == 6 * part + 2 * model  # 16-bit and fp32 partitions, and the whole model gathered
    assert released == 6 * part + 2 * largest  # the module in use (the head)
    assert forward_parameters(1) == 6 * model


def numels_of(model: str) -> list[int]:
    return [p.numel() for p in build_model(parse_model_spec(model)).parameters()]


def _offloaded(config: dict) -> dict:
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return config


@pytest.mark.distributed
@pytest.mark.parametrize("model, stage, dtype, gas, world", [("gpt-tiny", 2, "bf16", 2, 2),
                                                           ("llama-tiny", 1, "fp32", 1, 1),
                                                           ("gpt-tiny", 3, "bf16", 1, 2)])
def test_an_offloaded_optimizer_is_estimated_on_the_device_and_in_host_memory(model, stage, dtype, gas, world):
    """``offload_optimizer``: the fp32 partition, its gradient, the states and at ZeRO 1/2 the staging buffers and,
    under accumulation, the carried 16-bit gradients in host memory (the tracker counts DeepSpeed's host buffers
    and its update's temporaries as ``host``, as a GPU's allocator would not see them); the device keeps the 16-bit
    model, its buckets and one staging buffer of the largest gradient (ZeRO 3: its 16-bit partition, the gathered
    weights, the gradient partition and the bucket, as without the offload). Measured and estimated, the device peak
    to 1% and the host bytes at it exactly (gpt-tiny, ZeRO-2 bf16, 2 ranks, accumulation 2: 3,571,060 bytes
    measured, 3,601,928 estimated, against 4,525,944 measured with the optimizer on the device)."""
    config = _offloaded(ds_config(stage=stage, dtype=dtype, micro=4, gas=gas))
    runs = run_ranks(bench_rank, world, model, config, 3, None, 0, False)
    measured = max(runs, key=lambda r: r["peak_bytes"])
    est = estimate_spec(model, config, world)
    assert abs(est.predicted_peak_bytes - measured["peak_bytes"]) / measured["peak_bytes"] <= 0.01
    assert measured["peak_by_category"]["optimizer_states"] == est.by_category["optimizer_states"] == 0
    # the fullest rank's host bytes (under accumulation each rank carries its partition's parameters whole), apart
    # from the block's host tiers (none here); the update's temporaries come on top at the step
    resident, at_update = offloaded_optimizer_host(RunShape.from_ds_config(config, world), numels_of(model))
    assert max(r["peak_by_category"]["host"] for r in runs) == resident > 0 and est.phases["backward"]["host"] == 0
    assert est.deepspeed_host_bytes == at_update > resident
    assert not any("offload" in n for n in est.notes)
    on_device = estimate_spec(model, ds_config(stage=stage, dtype=dtype, micro=4, gas=gas), world)
    assert est.predicted_peak_bytes < on_device.predicted_peak_bytes - est.phases["backward"]["host"] // 2


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer_too, gas, world, phase", [(False, 1, 2, "forward"), (True, 2, 2, "forward"),
                                                              (True, 2, 1, "backward")])
def test_zero3_offload_param_keeps_the_16_bit_partitions_in_host_memory(optimizer_too, gas, world, phase):
    """``offload_param`` to the CPU at ZeRO 3 (gpt-small): the 16-bit partitions, every weight's, live in
    DeepSpeed's flat host buffers; the device holds the gathered weights alone. On 2 ranks without the optimizer
    offload 54,550,252 bytes measured on the device (57,873,644 with the partitions there, as the estimate kept them
    before); with it and accumulation 2, 35,819,236; on one rank 27,618,516 (where a GPU copies each weight in whole
    as its module takes it, a CPU's copy is the host partition itself). Each within 0.1%, the host bytes exact."""
    config = ds_config(stage=3, micro=4, gas=gas, clip=1.0)
    for key in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
        config["zero_optimization"].pop(key)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if optimizer_too:
        _offloaded(config)
    runs = run_ranks(bench_rank, world, "gpt-small", config, 3, None, 0, False)
    worst = max(runs, key=lambda r: r["peak_bytes"])
    est = estimate_spec("gpt-small", config, world)
    assert abs(est.predicted_peak_bytes - worst["peak_bytes"]) / worst["peak_bytes"] <= 0.001
    assert worst["peak_phase"] == est.peak_phase == phase
    shape, numels = RunShape.from_ds_config(config, world), numels_of("gpt-small")
    partitions = offloaded_params_host(shape, numels)
    assert partitions == 2 * sum(numels) // world  # bf16, the rank's share of the model
    # under accumulation the peak comes in the first step, before the offloaded optimizer made its states
    resident = offloaded_optimizer_host(shape, numels)[0]
    host = worst["peak_by_category"]["host"]
    assert host == partitions + resident if gas == 1 or world == 1 else partitions < host < partitions + resident
    assert est.deepspeed_host_bytes == partitions + offloaded_optimizer_host(shape, numels)[1]
    assert not any("not modelled" in n for n in est.notes)
    # every weight gathered once in forward and kept to backward (DeepSpeed's defaults), each micro-step
    partitioned = 2 * sum(x for x in numels if x > 1e5) // world
    assert est.step_time.counts["param_copies_bytes"] == gas * partitioned + (0 if optimizer_too else partitions)
    assert not any("not priced" in n for n in est.step_time.notes)


def test_the_offloads_not_modelled_are_named():
    params = _offloaded(ds_config(stage=3, micro=2))
    params["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": "/tmp"}
    notes = estimate_spec("gpt-tiny", params, 1).notes
    for section in ("offload_optimizer", "offload_param"):  # the parameters on NVMe: neither is modelled
        assert any(n.startswith(f"zero_optimization.{section}: host offload is not modelled") for n in notes)
    params["zero_optimization"]["offload_param"] = {"device": "cpu"}  # modelled on one rank and on several
    assert not any("not modelled" in n for w in (1, 2) for n in estimate_spec("gpt-tiny", params, w).notes)
    for offload in ({"device": "nvme", "nvme_path": "/tmp"}, {"device": "cpu", "ratio": 0.5}):
        config = ds_config(stage=3, micro=2)
        config["zero_optimization"]["offload_optimizer"] = offload
        notes = estimate_spec("gpt-tiny", config, 1).notes
        assert any("offload_optimizer: host offload is not modelled" in n for n in notes)
    for stage in (1, 2, 3):
        notes = estimate_spec("gpt-tiny", _offloaded(ds_config(stage=stage, micro=2)), 1).notes
        assert not any("offload" in n for n in notes)
    assert not any("offload" in n for n in estimate_spec("gpt-tiny", ds_config(stage=2, micro=2), 1).notes)


def test_zero3_reuse_distance_comm_buffers_sets_is_the_one_estimated():
    """comm_buffers holds ZeRO-3's kept gathered weights to its share of the budget (its reuse distance
    in the ds_config DeepSpeed gets): the estimate reads that distance, not the user's default."""
    def forward_parameters(xirang) -> int:
        config = ds_config(stage=3, micro=4, xirang=xirang)
        config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        return estimate_spec("gpt-tiny", config, 2).phases["forward"]["parameters"]

    budget = {"memory_budget": "2MB", "monitor": {"enabled": True}}
    whole = forward_parameters(budget)
    held = forward_parameters({**budget, "comm_buffers": {"enabled": True}})
    config = ds_config(stage=3, micro=4)
    config["zero_optimization"].update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=2 * 50_000)
    assert held == estimate_spec("gpt-tiny", config, 2).phases["forward"]["parameters"] < whole


@pytest.mark.distributed
@pytest.mark.parametrize("xirang, sub_group_size", [(INT8, None), (None, 115_392), (None, None)])
def test_zero3_step_estimate_follows_the_sub_groups(xirang, sub_group_size):
    """ZeRO-3's step upcasts and updates one sub-group at a time: with sub-groups of 1/8 of the
    partition (set by optimizer_states parking masters, or in the ds_config) and with DeepSpeed's one,
    the estimate's optimizer step is the measured one within 1%."""
    config = ds_config(stage=3, dtype="bf16", micro=1, bucket=1e6, xirang=xirang)
    if sub_group_size:
        config["zero_optimization"]["sub_group_size"] = sub_group_size
    measured = max(r["phase_peaks"]["optimizer_step"]
                   for r in run_ranks(bench_rank, 2, STEP_BOUND, config, 3, None, 0, xirang is not None))
    predicted = estimate_spec(STEP_BOUND, config, 2).phases["optimizer_step"]["total"]
    assert abs(predicted - measured) / measured <= 0.01, (predicted, measured)


@pytest.mark.distributed
@pytest.mark.parametrize("zero3, gas, phase", [
    ({}, 1, "forward"),
    ({"stage3_prefetch_bucket_size": 250_000, "stage3_max_reuse_distance": 0}, 1, "backward"),
    ({"offload_optimizer": {"device": "cpu"}}, 2, "forward")])
def test_zero3_replays_deepspeeds_fetches_over_the_traced_modules(zero3, gas, phase):
    """ZeRO 3's fetches replayed as DeepSpeed's coordinator makes them, on gpt-small:

    - At DeepSpeed's defaults (a 5e7-element prefetch bucket, larger than the model; a 1e5-element persistence
      threshold): the first module's prefetch all-gathers every later partitioned weight into one flat buffer that
      lives beside the copies DeepSpeed makes of them, late into forward, where the step peaks (5,767,168 bytes;
      57,873,644 measured, 54,201,484 estimated before the replay).
    - A 250,000-element bucket and no reuse distance: the prefetches walk ahead through backward's uses, so the
      coordinator keeps those weights gathered to backward although the reuse distance would release them
      (54,205,692 measured, 49,482,892 estimated before: -8.7%).
    - The optimizer offloaded, accumulation 2: the device holds no optimizer states, so forward peaks in the first
      step's second micro-batch, whose fetches take the persistent weights too, and whose flat buffer lives to
      forward's end as it holds the last of them (39,142,628 measured, 37,929,088 estimated on the steady step alone:
      -3.1%).

    Each is predicted within 0.1%, its peak in the phase measured."""
    config = ds_config(stage=3, micro=4, gas=gas, clip=1.0)
    for key in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
        config["zero_optimization"].pop(key)
    config["zero_optimization"].update(zero3)
    est = estimate_spec("gpt-small", config, 2)
    if not zero3:
        held = 2 * sum(x for x in numels_of("gpt-small") if x > 1e5)  # the embeddings stay gathered (persistent)
        assert any(f"({held:,} bytes) of flat buffers alive at forward's worst point" in n for n in est.notes)
    if gas > 1:  # all but the two embeddings, which the first micro-batch's backward does not release
        held = 2 * (sum(numels_of("gpt-small")) - 256 * 256 - 128 * 256)
        assert any(f"({held:,} bytes) of flat buffers alive at its worst point" in n for n in est.notes)
    worst = max(run_ranks(bench_rank, 2, "gpt-small", config, 3, None, 0, False), key=lambda r: r["peak_bytes"])
    assert worst["peak_phase"] == est.peak_phase == phase
    assert abs(est.predicted_peak_bytes - worst["peak_bytes"]) / worst["peak_bytes"] <= 0.001
