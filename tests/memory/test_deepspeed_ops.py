"""DeepSpeed's own ops as the predicted step counts them (`xirang_ds.planning.deepspeed_ops`), against the real engine:
the kernels of rank 0's counted step that DeepSpeed launched (`xirang_ds.step_counts`' ``deepspeed`` source: its
gradient handling, overflow check, norm, clipping, torch's AdamW under it, the cast back), on this CPU's program
(torch's single-tensor AdamW, as the estimate for a CPU run counts it)."""
import pytest

from tests.harness.engine_runs import ds_config
from xirang_ds.memory.run_shape import RunShape, fullest_rank, partition_pieces
from xirang_ds.models import BUILTIN_SPECS, build_model
from xirang_ds.planning.deepspeed_ops import emulated, engine_ops

NUMELS = [p.numel() for p in build_model(BUILTIN_SPECS["gpt-tiny"]).parameters()]


@pytest.mark.distributed
@pytest.mark.parametrize("stage,dtype,gas,clip", [(2, "bf16", 2, 1.0), (1, "bf16", 1, 0.5), (2, "fp32", 1, 1.0),
                                                  (0, "bf16", 1, 1.0), (0, "fp32", 2, 1.0)])
def test_deepspeeds_own_kernels_per_step_are_counted_op_for_op(stage, dtype, gas, clip):
    from xirang_ds.bench import run_side

    config = ds_config(stage=stage, dtype=dtype, micro=2, gas=gas, clip=clip, bucket=20_000)
    counts = run_side("gpt-tiny", config, 1, 2, None, 0, False).counts  # one step, then one counted; 2 ranks
    backward, step = engine_ops(RunShape.from_ds_config(config, 2, "cpu"), NUMELS, rank=0)
    predicted = backward.launches + step.launches
    counted = counts["kernels_by_source_per_step"]["deepspeed"]
    # ZeRO 1 copies a bucket's reduced part back once where ZeRO 2 does per run of it; ZeRO 0 on a CPU asks
    # oneDNN once whether fp16 is supported
    assert abs(predicted - counted) <= 2, (predicted, counted)
    assert predicted > 5 * len(NUMELS)


def test_the_ops_follow_the_partition_the_buckets_and_the_micro_steps():
    config = ds_config(stage=2, dtype="bf16", micro=2, gas=1, clip=1.0, bucket=20_000)
    shape = RunShape.from_ds_config(config, 2, "cuda")
    rank = fullest_rank(shape, NUMELS).rank
    mine = partition_pieces(shape, NUMELS, rank)[0]
    assert sum(n for _, n in mine) == max(sum(n for _, n in partition_pieces(shape, NUMELS, r)[0]) for r in range(2))
    backward, step = engine_ops(shape, NUMELS)
    twice, _ = engine_ops(RunShape.from_ds_config({**config, "gradient_accumulation_steps": 2}, 2, "cuda"), NUMELS)
    # a micro-step more: its own copies into the buckets and the partition, and the epilogue's additions
    assert twice.launches - backward.launches == backward.launches + len(mine)
    # in 16-bit each piece of the partition is checked for overflow (12 ops and a sum) and its norm taken in fp64
    # (an upcast and a norm); a wider model's partition has more pieces and the same fixed ops
    _, fp32_step = engine_ops(RunShape.from_ds_config({**config, "bf16": {"enabled": False}}, 2, "cuda"), NUMELS)
    # the overflow check: its count made, per piece 12 ops and a sum, the flag cast twice, all-reduced and read;
    # then the partition's upcast
    assert step.launches - fp32_step.launches == 1 + 13 * len(mine) + 2 + 1 + 1 + 1
    assert step.host_syncs == 3 and fp32_step.host_syncs == 2
    # every piece's gradient is read in fp64 for its norm: 8 bytes an element written and read again
    assert step.bytes_moved > 18 * sum(n for _, n in mine)


@pytest.mark.distributed
@pytest.mark.parametrize("stage,dtype,gas,clip", [(2, "bf16", 2, 1.0), (1, "fp32", 1, 0.5)])
def test_an_offloaded_optimizers_kernels_and_host_ops_are_counted_op_for_op(stage, dtype, gas, clip):
    """``offload_optimizer`` at ZeRO 1/2: the device's ops (each gradient piece's norm, overflow check and copy to the
    host, the norm's pieces read one by one, the partition copied back) and the host's (the update, the clipping,
    the cast into the staging buffer) together, against the real engine's count on this CPU, where both run."""
    from xirang_ds.bench import run_side
    from xirang_ds.planning.deepspeed_ops import host_optimizer_ops

    config = ds_config(stage=stage, dtype=dtype, micro=2, gas=gas, clip=clip, bucket=20_000)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    counts = run_side("gpt-tiny", config, 1, 2, None, 0, False).counts
    shape = RunShape.from_ds_config(config, 2, "cpu")
    backward, step = engine_ops(shape, NUMELS, rank=0)
    host = host_optimizer_ops(shape, NUMELS, rank=0)
    predicted = backward.launches + step.launches + host.host.launches
    counted = counts["kernels_by_source_per_step"]["deepspeed"]
    # the CPU makes a tensor from a Python number without a copy, where a GPU copies it to the device: the norm's
    # sum per group and, in 16-bit, the overflow flag (counted here as copies to the device)
    assert 0 <= predicted - counted <= 4, (predicted, counted)
    # every piece of the partition is read on the host twice (its overflow check, its norm)
    pieces = len(partition_pieces(shape, NUMELS, 0)[0])
    assert backward.host_syncs == pieces and step.host_syncs >= pieces


def test_an_offloaded_optimizer_moves_its_gradients_and_parameters_over_the_host_link():
    from xirang_ds.planning.deepspeed_ops import host_optimizer_ops

    config = ds_config(stage=2, dtype="bf16", micro=2, gas=1, clip=1.0, bucket=20_000)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    shape = RunShape.from_ds_config(config, 2, "cuda")
    rank = fullest_rank(shape, NUMELS)
    mine = sum(n for _, n in partition_pieces(shape, NUMELS, rank.rank)[0])
    host = host_optimizer_ops(shape, NUMELS)
    assert host.to_host_bytes == 4 * mine  # each piece upcast on the device, copied to the fp32 gradient
    assert host.to_device_bytes == 2 * mine + 1 + 4  # the 16-bit partition back; the overflow flag, the norm's sum
    twice = host_optimizer_ops(RunShape.from_ds_config({**config, "gradient_accumulation_steps": 2}, 2, "cuda"), NUMELS)
    whole = sum(NUMELS[i] for i in rank.params)  # under accumulation each whole gradient is carried on the host
    assert twice.to_host_bytes - host.to_host_bytes == 2 * 2 * whole
    assert twice.to_device_bytes - host.to_device_bytes == 2 * whole
    # DeepSpeedCPUAdam (no torch_adam): one pass over the partition on the host
    config["optimizer"]["params"]["torch_adam"] = False
    fused = host_optimizer_ops(RunShape.from_ds_config(config, 2, "cuda"), NUMELS)
    assert fused.host.launches < host.host.launches and fused.host.bytes_moved < host.host.bytes_moved
    assert host_optimizer_ops(RunShape.from_ds_config(ds_config(stage=2), 2, "cuda"), NUMELS) is None


def test_paths_not_written_are_left_to_the_flat_stand_in():
    for extra in ({"zero_optimization": {"stage": 3}},
                  {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}):
        shape = RunShape.from_ds_config({**ds_config(stage=2), **extra}, 2, "cuda")
        assert not emulated(shape) and engine_ops(shape, NUMELS) is None
    fused = ds_config(stage=0)
    fused["optimizer"]["params"]["torch_adam"] = False  # DeepSpeed's FusedAdam under its FP16_Optimizer
    assert not emulated(RunShape.from_ds_config(fused, 2, "cuda"))
    assert emulated(RunShape.from_ds_config({**fused, "bf16": {"enabled": False}}, 2, "cuda"))
