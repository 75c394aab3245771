"""`Plugin` holds only the seams every plugin has; what some plugins do is a role of `xirang_ds.roles`
(issue 56: torchtitan's one small protocol per role)."""
import inspect

import pytest

from xirang_ds import load_config
from xirang_ds.registry import Plugin, plugins_for
from xirang_ds.roles import ROLES, Estimates
from xirang_ds.session import Session

PLUGIN_METHODS = {"__init__", "path_class", "path", "prepare_model", "prepare_optimizer", "attach", "remove",
                  "describe", "check_framework", "keep"}
"""Issue 56 item 4: 25 methods before, the seams every plugin has after."""
ALL_ON = {"grad_release": {"enabled": True}, "optimizer_states": {"enabled": True},
          "memory_pool": {"enabled": True}, "activations": {"enabled": True, "options": ["keep", "compress"]},
          "comm_buffers": {"enabled": True}, "monitor": {"enabled": True}, "precision": {"enabled": True},
          "profiler": {"enabled": True}}


def _builtin_plugin_classes() -> list[type[Plugin]]:
    return [cls for cls, _ in plugins_for(load_config({"xirang": ALL_ON}))]


def _methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items()
            if inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod, property))}


def test_plugin_keeps_only_the_seams_every_plugin_has():
    assert _methods(Plugin) == PLUGIN_METHODS
    assert len(_methods(Plugin)) == 10


def test_no_role_method_is_left_on_plugin():
    for role in ROLES:
        for name in {n for n in _methods(role) if not n.startswith("_")}:
            assert not hasattr(Plugin, name), (role.__name__, name)


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.__name__)
def test_each_role_has_a_builtin_player(role):
    assert [cls.section for cls in _builtin_plugin_classes() if issubclass(cls, role)] != []


def test_a_plugin_without_a_role_keeps_the_old_defaults():
    session = Session(load_config({"xirang": {"profiler": {"enabled": True}}}), {"train_batch_size": 2})
    (profiler,) = session.plugins
    assert not any(isinstance(profiler, role) for role in ROLES)
    assert session.plugins_with(Estimates) == []
    assert session.state_dict() == {"profiler": {}}
    assert session.figures() == {}
    assert session.storage_lender() is None
