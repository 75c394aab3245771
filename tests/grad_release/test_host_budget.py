"""``host_memory_budget`` before the run: the estimate counts what grad_release's host tiers hold (its states with
``states: host``, exact clipping's stash) to the byte as the run's host ledger counts them, says ``fits: false``
where they exceed the budget, and ``initialize`` refuses such a block with the same figure, naming the key and the
fix, before the first step."""
import copy
import json

import pytest

from tests.harness import engine_runs
from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks
from xirang_ds.planning.spec import estimate_spec


def _config(host_budget="auto", quantized=False):
    xirang = {"grad_release": {"enabled": True, "bucket_size_numel": 20_000, "states": "host", "exact_method": "host"},
              "host_memory_budget": host_budget}
    if quantized:
        xirang["optimizer_states"] = {"enabled": True, "schedule": [{"dtype": "int8"}], "min_numel": 0}
    return ds_config(stage=2, dtype="bf16", micro=2, gas=1, clip=0.05, xirang=xirang)


def _held(rank, world, config):
    import xirang_ds
    from xirang_ds.config.validate import XirangConfigError
    from xirang_ds.memory.host_ledger import ledger
    from xirang_ds.models import BUILTIN_SPECS, build_model

    spec = BUILTIN_SPECS["gpt-tiny"]
    model = build_model(spec, seed=0)
    try:
        engine, *_ = xirang_ds.initialize(model=model, model_parameters=model.parameters(),
                                          config=copy.deepcopy(config))
    except XirangConfigError as e:
        return {"refused": str(e)}
    data = engine_runs.data_iter(2, spec.seq, rank, world)
    for _ in range(2):
        x, y = next(data)
        engine.backward(engine(x, y))
        engine.step()
    return {"held": ledger().held_bytes, "tiers": dict(ledger().by_tier)}


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32 states", "int8 states"])
def test_the_estimate_counts_the_host_tiers_as_the_ledger_does_and_initialize_refuses_an_over_budget(quantized):
    est = estimate_spec("gpt-tiny", _config(quantized=quantized), 2)
    ranks = run_ranks(_held, 2, _config(quantized=quantized))
    held = max(r["held"] for r in ranks)
    assert held > 0 and set(ranks[0]["tiers"]) == {"grad_release"}
    assert est.host_peak_bytes == held, (est.host_peak_bytes, held)  # on the CPU: plain bytes, exact
    assert est.as_dict()["host_peak_bytes"] == held

    over = _config(held - 1, quantized)
    est = estimate_spec("gpt-tiny", over, 2)
    assert est.fits is False and any(n.startswith("host_memory_budget:") and f"{held:,}" in n for n in est.notes)
    for r in run_ranks(_held, 2, over):  # refused at initialize, before any step
        assert "xirang.host_memory_budget" in r["refused"] and f"at least {held:,}" in r["refused"]

    assert estimate_spec("gpt-tiny", _config(held, quantized), 2).fits is not False


def test_states_auto_that_would_take_the_host_over_its_budget_does_not_fit():
    config = _config()
    config["xirang"]["grad_release"]["states"] = "auto"
    on_device = estimate_spec("gpt-tiny", config, 2)
    config["xirang"]["memory_budget"] = int(0.9 * on_device.predicted_peak_bytes)  # the states go to the host
    on_host = estimate_spec("gpt-tiny", config, 2)
    assert on_host.fits and on_host.host_peak_bytes > on_device.host_peak_bytes  # the stash alone, then the states
    config["xirang"]["host_memory_budget"] = on_host.host_peak_bytes - 1
    over = estimate_spec("gpt-tiny", config, 2)
    assert over.fits is False and any(n.startswith("host_memory_budget:") and "a larger memory_budget" in n
                                      for n in over.notes)


def test_the_cli_says_the_host_tiers_do_not_fit_and_validate_refuses_with_the_same_figure(tmp_path, capsys):
    from xirang_ds.cli import main

    held = estimate_spec("gpt-tiny", _config(), 2).host_peak_bytes
    path, out = tmp_path / "c.json", tmp_path / "e.json"
    path.write_text(json.dumps(_config(held // 2)))
    assert main(["estimate", "--model", "gpt-tiny", "--ds-config", str(path), "--world-size", "2",
                 "--json", str(out)]) == 0
    est, printed = json.loads(out.read_text()), capsys.readouterr().out
    assert est["fits"] is False and est["host_peak_bytes"] == held and "suggestion" not in est  # no budget helps
    assert "does not fit in host_memory_budget" in printed
    assert f"at least {held:,}, or keep the optimizer states on the device" in printed  # states "host" as written
    assert main(["validate", str(path), "--model", "gpt-tiny", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "xirang.host_memory_budget" in err and f"at least {held:,}" in err and "xirang.memory_budget:" not in err


def test_pinned_buffers_are_counted_at_their_allocator_blocks():
    from xirang_ds.plugins.grad_release.estimate import host_bytes

    buckets = [(1024, [4000, 4000, 96, 96]), (3000, [12000, 12000])]  # two pieces' fp32 moments, then one's
    assert host_bytes(buckets, 4, False) == 4 * 1024 + 8 * 1024 + 4 * 3000 + 8 * 3000
    assert host_bytes(buckets, 4, True) == 4096 + 2 * (4096 + 128) + 16384 + 2 * 16384
    assert host_bytes(buckets, 2, True) == 2048 + 2 * (4096 + 128) + 8192 + 2 * 16384  # a bf16 stash
    assert host_bytes([(1024, []), (3000, [])], 0, True) == 0


def test_only_an_accelerator_or_a_gpus_profile_pins():
    from xirang_ds.memory.device_profile import PROFILES, measure_cpu_profile
    from xirang_ds.memory.host_ledger import pins

    assert pins(True) and pins(False, PROFILES["h100"])
    assert not pins(False) and not pins(False, PROFILES["cpu"])
    assert not pins(False, measure_cpu_profile(repeats=1))  # "cpu-measured"
