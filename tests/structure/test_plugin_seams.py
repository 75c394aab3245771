"""The seams plugins meet each other and the frameworks through: named facts, typed accessors, and one
`FrameworkPath` per framework instead of framework branches in shared code."""
import ast
import pathlib

import pytest

from xirang_ds import load_config
from xirang_ds.registry import FACTS, FrameworkPath, Plugin, plugins_for
from xirang_ds.session import Session

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALL_ON = {"grad_release": {"enabled": True}, "optimizer_states": {"enabled": True},
          "memory_pool": {"enabled": True}, "activations": {"enabled": True, "options": ["keep", "compress"]},
          "comm_buffers": {"enabled": True}, "monitor": {"enabled": True}, "precision": {"enabled": True}}


def _session(block: dict) -> Session:
    return Session(load_config({"xirang": block}), {"train_batch_size": 2})


def _builtin_plugin_classes() -> list[type[Plugin]]:
    return [cls for cls, _ in plugins_for(load_config({"xirang": {**ALL_ON, "profiler": {"enabled": True}}}))]


def test_each_fact_has_one_provider_among_the_builtin_plugins():
    classes = _builtin_plugin_classes()
    for cls in classes:
        assert cls.provides <= set(FACTS), (cls.section, cls.provides)
    for fact in FACTS:
        assert [c.section for c in classes if fact in c.provides] != [], fact
        assert len([c for c in classes if fact in c.provides]) == 1, fact


def test_accessors_find_the_plugins_by_what_they_provide():
    session = _session(ALL_ON)
    assert session.stepper is session.plugin("grad_release")
    assert session.state_quantizer is session.plugin("optimizer_states")
    assert session.pool_owner is session.plugin("memory_pool")
    assert session.activation_planner is session.plugin("activations")
    assert session.storage_lender() is None  # nothing lent before attach
    assert session.started_tracker is None
    bare = _session({"monitor": {"enabled": True}})
    assert (bare.stepper, bare.state_quantizer, bare.pool_owner, bare.activation_planner) == (None,) * 4
    assert bare.pool() is None and bare.storage_lender() is None


@pytest.mark.parametrize("framework", ["deepspeed", "megatron"])
def test_each_plugin_names_a_path_class_that_exists(framework):
    for cls in _builtin_plugin_classes():
        path = cls.path_class(framework)
        if framework in cls.paths:
            assert path is not None and issubclass(path, FrameworkPath), (cls.section, framework)
        else:
            assert path is None


def _framework_comparisons(tree: ast.Module) -> list[int]:
    """Lines comparing something called ``framework`` with a string (``framework == "megatron"``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = [node.left, *node.comparators]
            named = any((isinstance(n, ast.Name) and n.id == "framework")
                        or (isinstance(n, ast.Attribute) and n.attr == "framework") for n in names)
            literal = any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in names)
            if named and literal:
                lines.append(node.lineno)
    return lines


def test_no_framework_branch_in_plugins_or_the_session():
    """What differs between DeepSpeed and Megatron-core lives in each plugin's `FrameworkPath`."""
    files = sorted((ROOT / "plugins").rglob("*.py")) + [ROOT / "xirang_ds" / "session.py"]
    found = [f"{path.relative_to(ROOT)}:{line}" for path in files
             for line in _framework_comparisons(ast.parse(path.read_text()))]
    assert not found, ("framework branches (move them into the plugin's deepspeed.py / megatron.py):\n"
                       + "\n".join(found))
    probe = ast.parse('if self.session.framework == "megatron":\n    pass\n')
    assert _framework_comparisons(probe) == [1]  # the scan sees the form it forbids


def _instance_attributes(cls: type) -> set[str]:
    """The class's names and the attributes its methods (or a base's, torch's ``Module`` aside) assign on
    ``self``."""
    import inspect

    names = set(dir(cls))
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "builtins")):
            continue
        for node in ast.walk(ast.parse(inspect.getsource(klass))):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
            elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                  and ast.unparse(node.value) == "self.__dict__" and isinstance(node.slice, ast.Constant)):
                names.add(node.slice.value)  # DeepSpeedEngine: self.__dict__["module"] = model
    return names


@pytest.mark.parametrize("run_class", ["deepspeed.runtime.engine:DeepSpeedEngine",
                                       "xirang_ds.integration.megatron_run:MegatronRun"])
def test_both_runs_offer_what_shared_plugin_code_reads(run_class):
    """The ``engine`` every seam receives satisfies `TrainingRun` under both frameworks."""
    import importlib

    from xirang_ds.registry import TrainingRun

    module, _, name = run_class.partition(":")
    cls = getattr(importlib.import_module(module), name)
    wanted = {n for n in TrainingRun.__annotations__} | {n for n, v in vars(TrainingRun).items()
                                                          if callable(v) and not n.startswith("_")}
    assert wanted >= {"module", "optimizer", "global_steps", "step", "zero_optimization_stage"}
    missing = sorted(wanted - _instance_attributes(cls))
    assert not missing, f"{name} lacks {missing}"
