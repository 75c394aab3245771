"""The "xirang" block: types, ranges, unknown keys, presets, files, and every problem at once."""
import glob
import json
import os

import pytest

import xirang_ds
from xirang_ds import XirangConfigError, load_config
from xirang_ds.config import to_dict
from xirang_ds.config.presets import PRESETS
from xirang_ds.config.schema import Section, XirangConfig
from xirang_ds.plugins.monitor.config import MonitorConfig
from xirang_ds.config.sections import section_names
from xirang_ds.registry import Plugin, register_plugin, unregister

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def problems(block) -> list[tuple[str, str]]:
    with pytest.raises(XirangConfigError) as info:
        load_config({"xirang": block})
    return info.value.problems


def test_empty_block_is_all_off():
    cfg = load_config({"xirang": {}})
    assert isinstance(cfg, XirangConfig)
    assert cfg.enabled_sections() == {}
    assert set(cfg.sections()) == set(section_names())


def test_no_block_returns_none():
    assert load_config({"train_batch_size": 8}) is None


def test_error_is_value_error_importable_from_package():
    assert issubclass(xirang_ds.XirangConfigError, ValueError)


def test_range_message_names_path_bounds_and_value():
    assert problems({"monitor": {"warn_at": 1.5}}) == [
        ("xirang.monitor.warn_at", "must be between 0 and 1; got 1.5")]


def test_all_problems_reported_at_once_with_paths():
    found = problems({"monitor": {"warn_at": 1.5, "enabeld": True}, "optimizer_state": {},
                      "memory_budget": "40XB", "profiler": {"formats": ["svg"]}})
    paths = [p for p, _ in found]
    assert paths == ["xirang.optimizer_state", "xirang.memory_budget", "xirang.monitor.enabeld",
                     "xirang.monitor.warn_at", "xirang.profiler.formats[0]"]
    messages = dict(found)
    assert "did you mean 'optimizer_states'?" in messages["xirang.optimizer_state"]
    assert "did you mean 'enabled'?" in messages["xirang.monitor.enabeld"]
    assert "'json', 'pickle', 'html', 'png'" in messages["xirang.profiler.formats[0]"]


@pytest.mark.parametrize("block, path, fragment", [
    ({"monitor": {"enabled": "yes"}}, "xirang.monitor.enabled", "must be true or false; got 'yes'"),
    ({"monitor": {"every_steps": 0}}, "xirang.monitor.every_steps", "must be >= 1; got 0"),
    ({"monitor": {"every_steps": 2.5}}, "xirang.monitor.every_steps", "must be an integer"),
    ({"comm_buffers": {"reduce_bucket_size": "autox"}}, "xirang.comm_buffers.reduce_bucket_size",
     "must be an integer (>= 1) or 'auto'; got 'autox'"),
    ({"optimizer_states": {"int8_block_size": 100}}, "xirang.optimizer_states.int8_block_size", "multiple of 32"),
    ({"optimizer_states": {"schedule": [{"dtype": "int3"}]}}, "xirang.optimizer_states.schedule[0].dtype",
     "did you mean 'int8'?"),
    ({"memory_budget": -5}, "xirang.memory_budget", "must be >= 0"),
    ({"monitor": []}, "xirang.monitor", "must be an object"),
    ({"preset": "balanse"}, "xirang.preset", "did you mean 'balanced'?"),
])
def test_bad_values(block, path, fragment):
    found = problems(block)
    assert found[0][0] == path
    assert fragment in found[0][1]


def test_a_misspelt_preset_hides_no_other_problem():
    assert sorted(problems({"preset": "balancd", "monitor": {"warn_at": 1.5}, "optimizer_statez": {}})) == [
        ("xirang.monitor.warn_at", "must be between 0 and 1; got 1.5"),
        ("xirang.optimizer_statez", "unknown key; did you mean 'optimizer_states'? (allowed: activations, autotune, "
                                    "comm_buffers, deepspeed_files, grad_release, host_memory_budget, memory_budget, "
                                    "memory_pool, monitor, optimizer_states, precision, preset, profiler)"),
        ("xirang.preset", "must be one of 'conservative', 'balanced', 'aggressive', 'auto'; got 'balancd'; "
                          "did you mean 'balanced'?"),
    ]


def test_block_that_is_not_an_object():
    assert problems([]) == [("xirang", 'must be an object such as {"preset": "balanced"}; got []')]


def test_cross_field_rules():
    found = dict(problems({"monitor": {"enabled": True, "warn_at": 0.9, "act_at": 0.8,
                                       "actions": ["checkpoint"]}}))
    assert found["xirang.monitor.act_at"] == "must be greater than warn_at (0.9); got 0.8"
    assert found["xirang.monitor.checkpoint_dir"] == 'is required when actions lists "checkpoint"'


def test_schedule_must_be_ordered():
    found = problems({"optimizer_states": {"schedule": [
        {"dtype": "fp32", "until_step": 500}, {"dtype": "int8", "until_step": 100}, {"dtype": "int4"}]}})
    assert found == [("xirang.optimizer_states.schedule[1].until_step",
                      "must be greater than the previous entry's (500); got 100")]


def test_deepspeed_style_numbers_and_units():
    cfg = load_config({"xirang": {"memory_budget": "40GB", "comm_buffers": {"reduce_bucket_size": 5e8}}})
    assert cfg.memory_budget == 40 * 10**9
    assert cfg.comm_buffers.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.comm_buffers.reduce_bucket_size, int)
    assert load_config({"xirang": {"memory_budget": "1.5GiB"}}).memory_budget == int(1.5 * 2**30)
    assert load_config({"xirang": {"memory_budget": 5e8}}).memory_budget == 500_000_000
    assert load_config({"xirang": {"memory_budget": "auto"}}).memory_budget == "auto"


def test_config_is_frozen():
    cfg = load_config({"xirang": {}})
    with pytest.raises(Exception):
        cfg.monitor = MonitorConfig()  # type: ignore[misc]


def test_unbuilt_plugin_is_an_error_not_a_silent_noop(monkeypatch):
    from xirang_ds.config import sections

    # Pretend no plugin registered grad_release's section, whatever this version ships.
    from xirang_ds.plugins.grad_release.config import GradReleaseConfig

    monkeypatch.setattr(sections._SECTIONS, "types",
                        {k: v for k, v in sections._SECTIONS.types.items() if v is not GradReleaseConfig})
    found = problems({"grad_release": {"enabled": True}})
    assert found[0][0] == "xirang.grad_release.enabled"
    assert "not built yet" in found[0][1]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_resolve_and_user_keys_override(name):
    cfg = load_config({"xirang": {"preset": name, "monitor": {"warn_at": 0.5}}})
    assert cfg.preset == name
    assert cfg.monitor.warn_at == 0.5
    resolved = to_dict(cfg)
    assert json.loads(json.dumps(resolved)) == resolved  # plain JSON data
    # the resolved block validates to the same config on its own
    assert load_config({"xirang": resolved}) == cfg


def test_presets_enable_only_built_plugins():
    from xirang_ds.registry import plugin_for

    for name in PRESETS:
        for section in load_config({"xirang": {"preset": name}}).enabled_sections().values():
            assert plugin_for(section) is not None


def test_json_and_yaml_files(tmp_path):
    block = {"train_batch_size": 8, "xirang": {"monitor": {"enabled": True, "warn_at": 0.7}}}
    j = tmp_path / "c.json"
    j.write_text(json.dumps(block))
    y = tmp_path / "c.yaml"
    y.write_text("train_batch_size: 8\nxirang:\n  monitor:\n    enabled: true\n    warn_at: 0.7\n")
    assert load_config(str(j)) == load_config(str(y)) == load_config(block)


@pytest.mark.parametrize("content, suffix, fragment", [
    ('{"xirang": {', ".json", "JSON syntax error at line 1"),
    ("xirang:\n  monitor: {enabled: true\n", ".yaml", "YAML syntax error"),
    ("[1, 2]", ".json", "must be an object at the top level"),
])
def test_bad_files(tmp_path, content, suffix, fragment):
    path = tmp_path / f"c{suffix}"
    path.write_text(content)
    with pytest.raises(XirangConfigError, match=fragment):
        load_config(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(XirangConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.json"))


def test_every_shipped_config_validates():
    files = sorted(glob.glob(os.path.join(ROOT, "configs", "*.json")) +
                   glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert files, "configs/ is empty"
    for path in files:
        cfg = load_config(path)
        assert cfg is not None, f"{path} has no xirang block"


def test_third_party_section_registers_and_validates():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class EchoConfig(Section):
        """A third-party section."""

        word: str = "hi"
        """What to say."""

    @register_plugin(EchoConfig, section="echo", order=70)
    class EchoPlugin(Plugin):
        pass

    try:
        cfg = load_config({"xirang": {"echo": {"enabled": True, "word": "yo"}}})
        assert cfg.extensions["echo"] == EchoConfig(enabled=True, word="yo")
        assert "echo" in cfg.enabled_sections()
        found = problems({"echo": {"wrod": "x"}})
        assert found[0][0] == "xirang.echo.wrod"
    finally:
        unregister("echo")
    found = problems({"echo": {}})
    assert found[0][0] == "xirang.echo" and "unknown key" in found[0][1]


def test_ds_config_as_base64_like_deepspeed():
    """DeepSpeed accepts urlsafe base64 of the JSON (its autotuner passes the config that way)."""
    import base64
    import json as _json

    from xirang_ds.config.loader import read_ds_config

    cfg = {"train_micro_batch_size_per_gpu": 2, "xirang": {"monitor": {"enabled": True}}}
    text = base64.urlsafe_b64encode(_json.dumps(cfg).encode()).decode()
    assert read_ds_config(text) == cfg
    with pytest.raises(XirangConfigError, match="config file not found"):
        read_ds_config("no/such/file.json")


# every cross-section rule, each row both ways (xirang_ds.config.rules) ----------------------------------
_LENDING = {"comm_buffers": {"enabled": True, "lend_to_activations": True}}
_CROSS_SECTION_CASES = [
    # (block that breaks the rule, the same block mended, key, fragment of the message)
    ({"monitor": {"enabled": True, "actions": ["raise_compression"]}},
     {"monitor": {"enabled": True, "actions": ["raise_compression"]}, "activations": {"enabled": True}},
     "xirang.monitor.actions", "'raise_compression' acts through the activations plugin"),
    ({"monitor": {"enabled": True, "actions": ["raise_recompute"]}},
     {"monitor": {"enabled": True, "actions": ["raise_recompute"]}, "activations": {"enabled": True}},
     "xirang.monitor.actions", "'raise_recompute' acts through the activations plugin"),
    ({"monitor": {"enabled": True, "on_oom": "halve_micro_batch"},
      "grad_release": {"enabled": True, "exact_method": "two_pass"}},
     {"monitor": {"enabled": True, "on_oom": "halve_micro_batch"},
      "grad_release": {"enabled": True, "exact_method": "hold"}},
     "xirang.monitor.on_oom", "applies updates during its second backward"),
    ({"grad_release": {"enabled": True, "exact_method": "two_pass"},
      "activations": {"enabled": True, "selective_recompute": ["blocks.0"]}},
     {"grad_release": {"enabled": True, "exact_method": "two_pass"},
      "activations": {"enabled": True, "recompute": ["blocks.0"]}},
     "xirang.grad_release.exact_method", "the modules fixed to activations.selective_recompute allow one backward"),
    ({**_LENDING, "grad_release": {"enabled": True}, "activations": {"enabled": True, "compress": ["blocks.0"]}},
     {**_LENDING, "activations": {"enabled": True, "compress": ["blocks.0"]}},
     "xirang.comm_buffers.lend_to_activations", "grad_release is on and reduces in its own buckets"),
    (dict(_LENDING), {**_LENDING, "activations": {"enabled": True, "compress": ["blocks.0"]}},
     "xirang.comm_buffers.lend_to_activations", "which is off; enable xirang.activations"),
    ({**_LENDING, "activations": {"enabled": True, "options": ["keep", "recompute"]}},
     {**_LENDING, "activations": {"enabled": True, "options": ["keep", "compress"]}},
     "xirang.comm_buffers.lend_to_activations", "has nothing to hold"),
]


def _problems_or_none(block) -> list[tuple[str, str]]:
    try:
        load_config({"xirang": block})
    except XirangConfigError as e:
        return e.problems
    return []


def test_every_cross_section_rule_has_a_case():
    from xirang_ds.config.rules import RULES

    messages = [m for _, _, _, m in _CROSS_SECTION_CASES]
    assert [next(m for m in messages if m in rule.message) for rule in RULES]  # each rule is exercised
    assert len(RULES) == len(_CROSS_SECTION_CASES)


@pytest.mark.parametrize("broken, mended, key, fragment", _CROSS_SECTION_CASES)
def test_cross_section_rule(broken, mended, key, fragment):
    found = [(k, m) for k, m in _problems_or_none(broken) if fragment in m]
    assert [k for k, _ in found] == [key], _problems_or_none(broken)
    assert not [m for _, m in _problems_or_none(mended) if fragment in m], _problems_or_none(mended)
