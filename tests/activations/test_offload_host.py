"""The host bytes an activation plan's offloads hold (`trace_plan.offload_host_bytes`), counted before the run
from the profile (each offloaded storage's packed part in its pool buffer), equal to what the run's host ledger
counts for the offload pool, and in the estimate's ``host_peak_bytes``; over ``host_memory_budget`` the estimate
says the block does not fit and the run refuses it at its first forward, before any step, unless a plan
without offloads fits the device: then the estimate and the run take that one."""
from tests.activations.test_deepspeed import _train
from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks
from xirang_ds.planning.spec import estimate_spec


def _config(budget="auto", host="auto", options=("keep", "offload")):
    return ds_config(stage=2, xirang={"host_memory_budget": host, "activations": {
        "enabled": True, "budget": budget, "options": list(options)}})


def _held(rank, world, config):
    from xirang_ds.memory.host_ledger import ledger

    from xirang_ds.config.validate import XirangConfigError

    seen = {}

    def after_step(engine, step):
        seen["offload"] = ledger().by_tier.get("activations offload", 0)

    try:
        out = _train(rank, world, config, 2, engine_hook=after_step)
    except XirangConfigError as e:
        return {"refused": str(e), **seen}
    return {"plan": out["plan"], **seen}


def test_the_plans_offload_host_bytes_are_what_the_pool_holds():
    keep = estimate_spec("gpt-tiny", _config(), 2).plans["activations"].keep_bytes
    est = estimate_spec("gpt-tiny", _config(keep // 2), 2)
    plan = est.plans["activations"]
    assert "offload" in plan.plan.values() and plan.host_bytes > 0
    assert est.host_peak_bytes == plan.host_bytes == plan.as_dict()["host_bytes"]
    for r in run_ranks(_held, 2, _config(keep // 2)):
        assert r["plan"] == plan.plan
        assert r["offload"] == plan.host_bytes, (r["offload"], plan.host_bytes)

    over = estimate_spec("gpt-tiny", _config(keep // 2, plan.host_bytes - 1), 2)
    assert over.fits is False and over.device_fits is not False
    for r in run_ranks(_held, 2, _config(keep // 2, plan.host_bytes - 1)):
        assert "xirang.host_memory_budget" in r["refused"] and f"at least {plan.host_bytes:,}" in r["refused"]
        assert "offload" not in r  # before any step


def test_a_host_budget_the_offloads_do_not_fit_takes_the_plan_without_them_where_it_fits():
    options = ("keep", "offload", "recompute")
    keep = estimate_spec("gpt-tiny", _config(options=options), 2).plans["activations"].keep_bytes
    offloading = estimate_spec("gpt-tiny", _config(keep // 2, options=options), 2).plans["activations"]
    assert "offload" in offloading.plan.values()
    est = estimate_spec("gpt-tiny", _config(keep // 2, offloading.host_bytes - 1, options), 2)
    plan = est.plans["activations"]
    assert est.fits and plan.fits and plan.host_bytes == 0 and "offload" not in plan.plan.values()
    assert any(f"would take {offloading.host_bytes:,} bytes of host memory" in n for n in est.notes)
    for r in run_ranks(_held, 2, _config(keep // 2, offloading.host_bytes - 1, options)):
        assert r["plan"] == plan.plan and r["offload"] == 0


def test_offload_host_bytes_by_option_plain_and_pinned():
    from xirang_ds.plugins.activations.profile import ModuleProfile
    from xirang_ds.plugins.activations.trace_plan import offload_host_bytes

    profiles = {"a": ModuleProfile("a", host_bytes=5120, pinned_host_bytes=8192, input_host_bytes=4096,
                                   input_pinned_host_bytes=4096),
                "b": ModuleProfile("b", host_bytes=10240, pinned_host_bytes=16384, input_host_bytes=6144,
                                   input_pinned_host_bytes=8192)}
    assert offload_host_bytes({"a": "offload", "b": "keep"}, profiles, False) == 5120
    assert offload_host_bytes({"a": "offload", "b": "recompute_offload"}, profiles, True) == 8192 + 8192
    assert offload_host_bytes({"a": "recompute_tiled_offload", "b": "quantize"}, profiles, False) == 4096
    assert offload_host_bytes({"a": "recompute", "c": "offload"}, profiles, True) == 0
