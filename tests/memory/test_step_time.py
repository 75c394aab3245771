"""The predicted step time (`xirang_ds.planning.step_time`): counts taken from the fake trace and DeepSpeed's step
on fake tensors, exact and the same on every machine; only the device profile turns them into seconds."""
import copy

import pytest
import torch

from xirang_ds.compat.torch import fake_tensor_mode
from xirang_ds.memory.device_profile import PROFILES, measure_cpu_profile
from xirang_ds.memory.run_shape import RunShape, partition_numel
from xirang_ds.planning.spec import estimate_spec
from xirang_ds.planning.step_time import communication_bytes, optimizer_ops, tallied

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def _tally(fn):
    with fake_tensor_mode():
        return tallied(fn)


def test_an_op_is_counted_by_its_arithmetic_and_bytes_and_views_and_allocations_launch_nothing():
    def work():
        a, b = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(32, 16, dtype=torch.bfloat16)
        (a @ b).t().reshape(16, 64)[0]
        q = torch.empty(2, 4, 128, 64)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)

    tally = _tally(work)
    # mm: 2*64*32*16 FLOPs, reads 64*32 + 32*16 and writes 64*16 bf16 elements; attention: 4*b*h*s*s*d (the
    # CPU's own flash kernel, which PyTorch's table leaves out, counted as the flash kernel it equals)
    assert tally.ops[(2 * 64 * 32 * 16, 2 * (64 * 32 + 32 * 16 + 64 * 16), True)] == 1
    assert tally.flops == 2 * 64 * 32 * 16 + 4 * 2 * 4 * 128 * 128 * 64
    assert tally.launches == 2  # empty, t and view launch nothing
    h200 = PROFILES["h200"]
    assert tally.seconds(h200) == sum(h200.op_seconds(f, b, low) * n for (f, b, low), n in tally.ops.items())


def test_the_optimizer_step_launches_the_same_number_of_kernels_at_any_size_and_moves_bytes_in_proportion():
    small, large = (RunShape.from_ds_config(CONFIG, 2, "cuda") for _ in range(2))
    a, b = optimizer_ops(small, [1000, 3000]), optimizer_ops(large, [13000, 39000])
    assert a.launches == b.launches > 0  # one flat partition per group, foreach: no per-element work
    assert b.bytes_moved == pytest.approx(13 * a.bytes_moved, rel=0.01)
    unclipped = optimizer_ops(RunShape.from_ds_config({**CONFIG, "gradient_clipping": 0.0}, 2, "cuda"), [1000, 3000])
    assert unclipped.launches < a.launches  # the norm only where clipping needs it


@pytest.mark.parametrize("stage,expected", [(0, 2), (1, 2), (2, 1 + 2), (3, 3 * 2)])
def test_communication_is_what_a_ring_moves_per_rank(stage, expected):
    config = {**CONFIG, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage}}
    shape = RunShape.from_ds_config(config, 4, "cuda")
    ring = 3 / 4 * 2 * 1000  # one reduce-scatter or all-gather of 1000 bf16 elements over 4 ranks
    assert communication_bytes(shape, 1000) == int(expected * ring)
    assert communication_bytes(RunShape.from_ds_config(config, 1, "cuda"), 1000) == 0


def test_the_estimate_prices_the_same_counts_on_every_profile_and_against_plain_deepspeed():
    a = estimate_spec("gpt-tiny", {**CONFIG, "xirang": {"preset": "conservative"}}, 2, "cuda",
                      device_profile=PROFILES["h100"], plain=True)
    b = estimate_spec("gpt-tiny", {**CONFIG, "xirang": {"preset": "conservative"}}, 2, "cuda",
                      device_profile=PROFILES["a100"])
    assert a.step_time.counts == b.step_time.counts  # machine-independent
    assert a.step_time.seconds < b.step_time.seconds and a.step_time.profile == "h100"
    assert a.step_time.seconds == pytest.approx(sum(a.step_time.parts.values()))
    plain = estimate_spec("gpt-tiny", CONFIG, 2, "cuda", device_profile=PROFILES["h100"])  # no block: itself
    assert a.plain_step_time.as_dict() == plain.step_time.as_dict() == plain.plain_step_time.as_dict()
    assert a.as_dict()["predicted_step_time_s"] == a.step_time.seconds
    assert a.as_dict()["plain_step_time_s"] == plain.step_time.seconds


def test_what_the_block_adds_is_priced_by_its_plugins():
    """Under a budget the plan offloads (the plan's own seconds, every micro-step) and grad_release keeps the
    optimizer states in host memory (their bytes there and back over the host link, on the compute stream with
    ``prefetch_states: false``; fetched ahead on a side stream, the default on a GPU, only the first bucket's
    fetch is on it and the rest runs beside the compute: the step is the larger of the two, the link's whole time
    beside); exact clipping's stashed shards the same way; what a plugin cannot price is named."""
    block = {"preset": "conservative", "memory_budget": 2_000_000}
    config = {**CONFIG, "gradient_accumulation_steps": 2}
    link = PROFILES["h100"].host_link_bytes_per_s
    serial = {**block, "grad_release": {"prefetch_states": False}}
    est = estimate_spec("gpt-tiny", {**config, "xirang": serial}, 2, "cuda", device_profile=PROFILES["h100"])
    plan = est.plans["activations"]
    assert est.fits and est.step_time.parts["activations"] == pytest.approx(2 * plan.added_s) and plan.added_s > 0
    assert est.plans["grad_release"]["states"] == "host"
    state_bytes = est.step_time.parts["grad_release"] * link
    assert state_bytes >= 2 * 8 * sum(p.numel() for p in _gpt_tiny().parameters()) // 2
    assert est.step_time.notes == []  # every plugin of the preset prices itself or adds no time
    assert est.step_time.seconds == pytest.approx(sum(est.step_time.parts.values()))
    ahead = estimate_spec("gpt-tiny", {**config, "xirang": block}, 2, "cuda", device_profile=PROFILES["h100"])
    states, first = (ahead.plans["grad_release"][k] for k in ("state_bytes", "first_bucket_state_bytes"))
    assert 0 < first < states and est.plans["grad_release"]["first_bucket_state_bytes"] is None
    beside = (2 * states - first) / link
    plan = ahead.plans["grad_release"]  # exact clipping's stash, on the side stream too
    assert plan["stashes_shard"]
    shards = partition_numel(sum(p.numel() for p in _gpt_tiny().parameters()), 2)  # this rank's of 2
    assert 0 < plan["first_bucket_stash_numel"] < shards and est.plans["grad_release"]["first_bucket_stash_numel"] \
        is None
    beside += plan["stash_bytes"] * (2 * shards - plan["first_bucket_stash_numel"]) / link
    assert ahead.step_time.parts["grad_release"] == pytest.approx(est.step_time.parts["grad_release"] - beside)
    # the link carries the compute stream's copies too: beside them, its whole time
    assert ahead.step_time.counts["beside_compute_s"] == pytest.approx(est.step_time.parts["grad_release"])
    assert ahead.step_time.seconds == pytest.approx(max(sum(ahead.step_time.parts.values()),
                                                        ahead.step_time.counts["beside_compute_s"]))
    assert ahead.step_time.seconds < est.step_time.seconds


def test_low_bit_states_price_their_own_update_compiled_per_tensor_on_a_gpu_and_chunk_by_chunk_on_the_cpu():
    """int8 states for the matrices, fp32 for norms and biases (kept), under DeepSpeed's ZeRO-2 step (one flat
    partition per group). On a GPU profile the int8 partition is one compiled kernel whatever its size and the kept
    fp32 one torch's fused Adam kernel; the CPU's eager path runs chunk by chunk."""
    states = {"enabled": True, "schedule": [{"dtype": "int8"}], "keep_fp32_embeddings_and_norms": "measured"}
    config = {**CONFIG, "xirang": {"optimizer_states": states}}
    small, wide = ("gpt:layers=2,hidden=64,heads=2,seq=32,vocab=256", "gpt:layers=2,hidden=256,heads=2,seq=32,vocab=256")
    gpu = [estimate_spec(m, config, 2, "cuda", device_profile=PROFILES["h100"]) for m in (small, wide)]
    assert all("optimizer_update" in e.step_time.counts and e.step_time.notes == [] for e in gpu)
    a, b = (e.step_time.counts["optimizer_update"] for e in gpu)
    assert a["launches"] == b["launches"] and b["bytes_moved"] > 8 * a["bytes_moved"]  # 16x the matrices
    cpu = [estimate_spec(m, config, 2, "cpu") for m in (small, wide)]
    c, d = (e.step_time.counts["optimizer_update"] for e in cpu)
    assert c["launches"] > a["launches"] and d["launches"] >= c["launches"]


def test_grad_release_counts_its_own_step_with_each_buckets_update():
    """balanced: grad_release reduces and steps each bucket itself (its code run on fake tensors,
    `grad_release.step_ops`), so DeepSpeed's ops are not in the step, and each bucket's optimizer step is
    optimizer_states' count of it: on a GPU profile an int8 shard is one kernel whatever its size, and 6 more
    blocks add their matrices' kernels and the copies of their gradients in and weights out."""
    config = {**CONFIG, "xirang": {"preset": "balanced", "grad_release": {"bucket_size_numel": 2**30}}}  # one bucket
    plain = estimate_spec("gpt:layers=2,hidden=64,heads=2,seq=32,vocab=256", CONFIG, 2, "cuda",
                          device_profile=PROFILES["h100"]).step_time
    small, wide, deep = (estimate_spec(m, config, 2, "cuda", device_profile=PROFILES["h100"]).step_time
                         for m in ("gpt:layers=2,hidden=64,heads=2,seq=32,vocab=256",
                                   "gpt:layers=2,hidden=256,heads=2,seq=32,vocab=256",
                                   "gpt:layers=8,hidden=64,heads=2,seq=32,vocab=256"))
    assert small.notes == [] and "optimizer_update" not in small.counts  # in grad_release's own ops
    # the norm read once a step, where DeepSpeed reads its overflow flag and its norm's checks
    assert small.counts["host_syncs"] == 1 < plain.counts["host_syncs"]
    ops = [t.counts["engine_backward"]["launches"] + t.counts["optimizer"]["launches"] for t in (small, wide, deep)]
    assert ops[0] == ops[1]  # 16x the matrices' elements, the same buckets: the same kernels
    assert ops[2] > ops[0] + 6 * 4


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_two_pass_prices_its_norm_only_backward_as_the_traces_backward_once_more(clip):
    """grad_release's ``two_pass`` runs the boundary's backward twice where the step needs its norm first (exact
    clipping): the trace's backward (its own tally, within the micro-step's) once more; without clipping (bf16,
    no global pass) one backward, as ``hold``."""
    model = "gpt:layers=2,hidden=64,heads=2,seq=32,vocab=256"
    config = {**CONFIG, "gradient_clipping": clip, "gradient_accumulation_steps": 2}
    hold, two = (estimate_spec(model, {**config, "xirang": {"grad_release": {"enabled": True, "exact_method": m}}},
                               2, "cuda", device_profile=PROFILES["h100"]).step_time for m in ("hold", "two_pass"))
    assert hold.counts["extra_backwards"] == 0 and two.notes == []
    if not clip:
        assert two.counts == hold.counts and two.parts == hold.parts
        return
    again = two.counts["repeated_backward"]
    assert two.counts["extra_backwards"] == 1 and 0 < again["launches"] < two.counts["forward_backward"]["launches"]
    assert again["flops"] > two.counts["forward_backward"]["flops"] / 2  # backward: about two thirds of a micro-step
    own = [t.counts["engine_backward"]["launches"] + t.counts["optimizer"]["launches"] for t in (hold, two)]
    assert two.counts["kernels"] - own[1] == 2 * two.counts["forward_backward"]["launches"] + again["launches"]
    assert hold.counts["kernels"] - own[0] == 2 * hold.counts["forward_backward"]["launches"]
    assert two.parts["forward_backward"] > hold.parts["forward_backward"]


def test_the_no_master_update_is_priced_as_one_kernel_per_tensor_reading_and_writing_the_bf16_weight():
    """aggressive (grad_release ``masters: none``, int4 states): on a GPU profile the update of a shard is one
    compiled call that also rounds into the bf16 weight (issue 58), the same launches at 16x the matrices;
    masters kept as remainders are rebuilt and split again around every bucket's update, more bytes moved."""
    one = {"bucket_size_numel": 2**30}  # one bucket at either width
    config = {**CONFIG, "xirang": {"preset": "aggressive", "grad_release": one}}
    remainders = {**CONFIG, "xirang": {"preset": "aggressive", "grad_release": {**one, "masters": "remainders"}}}
    small, wide = ("gpt:layers=2,hidden=64,heads=2,seq=32,vocab=256", "gpt:layers=2,hidden=256,heads=2,seq=32,vocab=256")
    a, b = (estimate_spec(m, config, 2, "cuda", device_profile=PROFILES["h100"]).step_time.counts
            for m in (small, wide))
    assert a["optimizer"]["launches"] == b["optimizer"]["launches"]
    kept = estimate_spec(wide, remainders, 2, "cuda", device_profile=PROFILES["h100"]).step_time.counts
    assert kept["optimizer"]["bytes_moved"] - b["optimizer"]["bytes_moved"] >= 4 * 2 * 256 * 256 * 4 // 2 // 2


def _gpt_tiny():
    from xirang_ds.models import BUILTIN_SPECS, build_model

    return build_model(BUILTIN_SPECS["gpt-tiny"])


def test_the_cpu_profile_measured_here_is_a_profile_like_the_named_ones():
    profile = measure_cpu_profile(threads=1, repeats=1)
    assert profile.name == "cpu-measured" and profile.matmul_flops_per_s > 0 and 0 < profile.launch_s < 1e-3
    assert profile.interconnect_bytes_per_s == PROFILES["cpu"].interconnect_bytes_per_s
    assert copy.copy(profile) == profile


def test_an_offloaded_optimizer_is_priced_on_the_host_and_over_the_host_link():
    """ZeRO 2 with ``offload_optimizer``: the update leaves the device's ``optimizer`` part for ``host_optimizer``,
    the host's ops priced by the GPU server's host profile and the copies each way by the host link."""
    from xirang_ds.memory.device_profile import host_profile
    from xirang_ds.models import BUILTIN_SPECS, build_model
    from xirang_ds.planning.deepspeed_ops import host_optimizer_ops

    config = copy.deepcopy(CONFIG)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    h100 = PROFILES["h100"]
    est = estimate_spec("gpt-tiny", config, 2, "cuda", device_profile=h100)
    on_device = estimate_spec("gpt-tiny", CONFIG, 2, "cuda", device_profile=h100).step_time
    st = est.step_time
    numels = [p.numel() for p in build_model(BUILTIN_SPECS["gpt-tiny"]).parameters()]
    host = host_optimizer_ops(RunShape.from_ds_config(config, 2, "cuda"), numels)
    link = (host.to_host_bytes + host.to_device_bytes) / h100.host_link_bytes_per_s
    assert st.parts["host_optimizer"] == pytest.approx(host.host.seconds(host_profile(h100)) + link)
    assert st.counts["host_optimizer"]["to_host_bytes"] == host.to_host_bytes > 0
    assert st.parts["optimizer"] < on_device.parts["optimizer"]  # the update is the host's now
    assert st.seconds > on_device.seconds and not st.notes
    assert host_profile(PROFILES["cpu"]) is PROFILES["cpu"] and host_profile(h100).name.startswith("host")
    # ZeRO 3: the update the host's, sub-group by sub-group, beside the flat stand-in of the device's work
    config["zero_optimization"]["stage"] = 3
    zero3 = estimate_spec("gpt-tiny", config, 2, "cuda", device_profile=h100).step_time
    on_device = estimate_spec("gpt-tiny", {**CONFIG, "zero_optimization": {"stage": 3}}, 2, "cuda",
                              device_profile=h100).step_time
    assert zero3.parts["host_optimizer"] > 0 and zero3.parts["optimizer"] < on_device.parts["optimizer"]
    assert zero3.counts["host_optimizer"]["to_host_bytes"] == zero3.counts["host_optimizer"]["to_device_bytes"]


def test_offload_param_prices_each_fetchs_partitions_and_the_update_coming_back_over_the_host_link():
    """gpt-small at ZeRO 3 on 2 ranks with ``offload_param``: at DeepSpeed's defaults one prefetch gathers every
    partitioned weight in forward and keeps it to backward, so a micro-step copies in this rank's half of them
    (2,883,584 elements above the persistence threshold, in bf16: 2,883,584 bytes); the updated 16-bit partition
    (1,661,696 elements) comes back once a step, unless the optimizer is on the host too."""
    from xirang_ds.models import build_model, parse_model_spec

    numels = [p.numel() for p in build_model(parse_model_spec("gpt-small")).parameters()]
    partitioned = sum(x for x in numels if x > 1e5)
    config = copy.deepcopy(CONFIG)
    config.update(gradient_accumulation_steps=2, zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}})
    h100 = PROFILES["h100"]
    st = estimate_spec("gpt-small", config, 2, "cuda", device_profile=h100).step_time
    assert st.counts["param_copies_bytes"] == 2 * partitioned + 2 * sum(numels) // 2
    assert st.parts["param_copies"] == pytest.approx(st.counts["param_copies_bytes"] / h100.host_link_bytes_per_s)
    assert not any("offload_param" in n for n in st.notes)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    st = estimate_spec("gpt-small", config, 2, "cuda", device_profile=h100).step_time
    assert st.counts["param_copies_bytes"] == 2 * partitioned
    # no reuse distance and a small bucket: backward gathers again those no prefetch walked past (the coordinator
    # keeps the others, `tests/memory/test_zero3_fetch.py`)
    config["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=250_000)
    st = estimate_spec("gpt-small", config, 2, "cuda", device_profile=h100).step_time
    assert 2 * partitioned < st.counts["param_copies_bytes"] < 4 * partitioned
