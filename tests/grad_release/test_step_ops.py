"""grad_release's own ops as the predicted step counts them (`grad_release.step_ops`: its buckets, pipeline and policy
run on fake tensors), against the real engine: the kernels of rank 0's counted step that grad_release and DeepSpeed
launched, on this CPU's program (torch's single-tensor AdamW under each bucket, the eager rounding)."""
import pytest

from tests.harness.engine_runs import ds_config

BUCKETS = 3  # gpt-tiny's buckets of at most 65,536 elements (the run's summary says so)


@pytest.mark.distributed
@pytest.mark.parametrize("stage,gas,clip,section", [
    (2, 1, 1.0, {}),                                            # exact clipping: held, then every update
    (2, 2, 1.0, {"clipping": "previous_step"}),                 # updates in backward, accumulation
    (1, 1, 0.5, {"masters": "none"}),                           # bf16 weights rounded stochastically
    (0, 1, 1.0, {"masters": "fp32"}),                           # replicated, fp32 masters
])
def test_grad_releases_own_kernels_per_step_are_its_code_run_on_fake_tensors(stage, gas, clip, section):
    from xirang_ds.bench import run_side
    from xirang_ds.planning.spec import estimate_spec

    config = ds_config(stage=stage, dtype="bf16", micro=2, gas=gas, clip=clip, bucket=20_000,
                       xirang={"grad_release": {"enabled": True, **section}})
    counts = run_side("gpt-tiny", config, 1, 2, None, 0, True).counts
    step = estimate_spec("gpt-tiny", config, 2, "cpu").step_time
    assert step.notes == []
    predicted = step.counts["engine_backward"]["launches"] + step.counts["optimizer"]["launches"]
    by_source = counts["kernels_by_source_per_step"]
    counted = by_source["grad_release"] + by_source.get("deepspeed", 0)
    # gloo's collectives are not NCCL's: a reduce-scatter's wait copies its result out, and some collectives
    # reach the dispatcher as other ops; at most two launches a bucket apart
    assert abs(predicted - counted) <= 2 * BUCKETS, (predicted, counted, by_source)
    assert step.counts["host_syncs"] == 1  # the norm read once a step
