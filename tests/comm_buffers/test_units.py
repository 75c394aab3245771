"""comm_buffers without an engine: the bucket sizing rule, and the DeepSpeed seam lending relies on
(engines: test_deepspeed.py and test_deepspeed_lending.py; CUDA: test_gpu.py)."""
from xirang_ds.plugins.comm_buffers import auto_bucket_numel, gathered_limits


GIB = 2**30


def test_the_installed_deepspeed_reduces_on_the_stream_lending_orders_after(monkeypatch):
    """Lending orders each forward's first lease after DeepSpeed's ``reduction_stream``; this fails when
    a DeepSpeed release moves the reduction off that stream, and lending is then refused with the
    reason (not silently unsafe)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from xirang_ds.plugins.comm_buffers.arena import reductions_ordered

    assert reductions_ordered() is None

    def average_tensor(self, tensor, communication_data_type):  # a release that reduces elsewhere
        return tensor

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "average_tensor", average_tensor)
    assert "no longer reduces buckets on DeepSpeedZeroOptimizer.reduction_stream" in reductions_ordered()


def test_rule_efficiency_floor_cap_and_model():
    # gloo: 9 * 50us * 2 GB/s = 900 KB -> 450k bf16 elements
    assert auto_bucket_numel(1000, 10**9, 2, 1, 80 * GIB, 0.05, 50e-6, 2e9)[0] == 450_000
    # a ring over p ranks pays p latencies: the efficient size grows with p, up to 8 ranks
    assert auto_bucket_numel(1000, 10**9, 2, 1, 80 * GIB, 0.05, 50e-6, 2e9, ranks=2)[0] == 900_000
    assert auto_bucket_numel(1000, 10**9, 2, 1, 80 * GIB, 0.05, 50e-6, 2e9, ranks=64)[0] == 3_600_000
    # the largest parameter wins when bigger
    n, why = auto_bucket_numel(2_000_000, 10**9, 2, 1, 80 * GIB, 0.05, 50e-6, 2e9)
    assert n == 2_000_000 and "largest parameter" in why
    # a small model: no bigger than the model
    assert auto_bucket_numel(1000, 5000, 2, 1, 80 * GIB, 0.05, 50e-6, 2e9)[0] == 5000
    # the budget cap over both overlap buffers
    n, why = auto_bucket_numel(1000, 10**9, 2, 2, 10**6, 0.05, 30e-6, 100e9)
    assert n == int(0.05 * 10**6 / 4) and "cap" in why


def test_gathered_limits_hold_the_kept_weights_to_the_budget_share():
    # 5% of 100 MB in bf16: 2.5M elements kept at the turn, twice that as the reuse distance
    limits = gathered_limits(2, 100 * 10**6, 0.05, prefetch=1_000_000)
    assert limits["stage3_max_reuse_distance"][0] == 5_000_000
    assert limits["stage3_max_live_parameters"][0] == 3_500_000
    assert "gathered again in backward" in limits["stage3_max_reuse_distance"][1]
    # a budget whose share exceeds what DeepSpeed keeps: its defaults, never more
    limits = gathered_limits(2, 80 * GIB, 0.05, prefetch=1_000_000)
    assert {k: v for k, (v, _) in limits.items()} == {"stage3_max_reuse_distance": 10**9,
                                                      "stage3_max_live_parameters": 10**9}
