"""A measured embedding's optimizer states are a size only the data decide (``keep_fp32_embeddings_and_norms:
"measured"``: fp32 until the first update's check lets them go to the policy's format). The estimate makes the plan,
``fits`` and the least budget at their bound, fp32, and predicts the peak with them in the widest format the check
gives (`xirang_ds.roles.PricesAtBound`, `OptimizerStatesPlugin.bound_headroom`): a run whose check passes peaks at
the predicted peak, one whose check fails at the bound, both within the budget (gpt-small, balanced under half of
plain DeepSpeed's peak, ZeRO-2 on 2 gloo ranks)."""
import math

from tests.harness.engine_runs import ds_config
from xirang_ds.config.types import format_bytes
from xirang_ds.launch import run_ranks
from xirang_ds.models import BUILTIN_SPECS
from xirang_ds.planning.estimate_text import format_estimate
from xirang_ds.planning.spec import estimate_spec
from xirang_ds.plugins.optimizer_states.formats import make_format

MODEL = "gpt-small"


def _config(budget, **states):
    block = {"preset": "balanced", "memory_budget": budget}
    return ds_config(stage=2, clip=1.0, xirang={**block, "optimizer_states": states} if states else block)


def _bench(rank, world, config):
    from xirang_ds.bench import bench_rank

    return bench_rank(rank, world, MODEL, config, 3, None, 0, True)["peak_bytes"]


def test_the_plan_stands_at_the_bound_and_the_peak_is_predicted_at_the_format_the_check_gives():
    budget = estimate_spec(MODEL, ds_config(stage=2, clip=1.0), 2).predicted_peak_bytes // 2
    est = estimate_spec(MODEL, _config(budget), 2)
    kept = estimate_spec(MODEL, _config(budget, keep_fp32_embeddings_and_norms=True), 2)  # fp32 whatever the data
    assert est.fits and est.bound_peak_bytes <= budget
    # the plan is the one made with the embeddings' states fp32
    assert est.plans["activations"].plan == kept.plans["activations"].plan
    # what the bound holds more: fp32 against int8 states (codes, and a scale a block) of the embeddings' part
    spec = BUILTIN_SPECS[MODEL]
    part = math.ceil((spec.vocab + spec.seq) * spec.hidden / 2)  # the token and position embeddings, ZeRO's half
    fp32, int8 = make_format("fp32"), make_format("int8")
    assert est.bound_peak_bytes - est.predicted_peak_bytes == fp32.state_bytes(part) - int8.state_bytes(part) > 0
    assert "kept fp32 (the check fails) they hold" in " ".join(est.notes)
    assert f"at most {format_bytes(est.bound_peak_bytes)} ({est.bound_peak_bytes:,} bytes)" in format_estimate(est)
    # the run whose check passes (int8) peaks at the prediction; one whose check fails (fp32) at the bound
    passes, fails = (max(run_ranks(_bench, 2, c)) for c in (_config(budget), _config(budget, measured_max_error=1e-9)))
    assert abs(est.predicted_peak_bytes - passes) <= 1e-4 * passes, (est.predicted_peak_bytes, passes)
    assert abs(est.bound_peak_bytes - fails) <= 1e-4 * fails, (est.bound_peak_bytes, fails)
    assert passes < fails <= budget
    assert est.as_dict()["bound_peak_bytes"] == est.bound_peak_bytes
