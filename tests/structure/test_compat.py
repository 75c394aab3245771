"""One compat layer: every private name of torch, DeepSpeed, Megatron-core and Apex is reached through
``xirang_ds/compat/``, and every name listed there still exists in the installed packages."""
import ast
import importlib
import importlib.util
import pathlib

import pytest
import torch

from xirang_ds.compat import resolve

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("xirang_ds", "plugins")
COMPAT = ROOT / "xirang_ds" / "compat"
NAME_CALLS = {"getattr", "setattr", "hasattr", "delattr", "wrap_method"}
"""Calls whose second argument names an attribute."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources() -> dict[pathlib.Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path))
            for folder in PACKAGE_DIRS for path in sorted((ROOT / folder).rglob("*.py"))}


def _own_names(trees) -> set[str]:
    """Private names xirang_ds defines: functions, classes, module variables, arguments, attributes it
    assigns on ``self`` or ``cls``, and ``_xirang*`` tags."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
    return {n for n in own if _private(n)}


def _ours(name: str, own: set[str]) -> bool:
    """``_xirang*`` names are tags xirang_ds sets on other packages' objects."""
    return name in own or name.startswith("_xirang")


def _suffix_tuples(tree: ast.Module) -> set[int]:
    """``id`` of the tuples passed to ``str.endswith``/``startswith`` (suffixes, not attribute names)."""
    return {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("endswith", "startswith") for arg in node.args}


def foreign_private_accesses(sources: dict[pathlib.Path, ast.Module]) -> list[str]:
    """``path:line: what`` for every private name of another package reached outside the compat folder; a
    name in a literal tuple, list or set counts (attribute names read in a loop), ATen operator names and
    suffixes aside."""
    own = _own_names(sources.values())
    found = []
    for path, tree in sources.items():
        if COMPAT in path.parents:
            continue
        where = path.relative_to(ROOT)
        suffixes = _suffix_tuples(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in suffixes:
                found += [f"{where}:{node.lineno}: {e.value!r} in a literal" for e in node.elts
                          if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value.isidentifier()
                          and _private(e.value) and not _ours(e.value, own) and not hasattr(torch.ops.aten, e.value)]
            if isinstance(node, ast.Attribute) and _private(node.attr) and not _ours(node.attr, own):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                          if any(_private(part) for part in a.name.split("."))]
            elif isinstance(node, ast.ImportFrom) and not node.level and not node.module.startswith("xirang_ds"):
                names = node.module.split(".") + [a.name for a in node.names]
                if any(_private(n) for n in names):
                    found.append(f"{where}:{node.lineno}: from {node.module} import "
                                 + ", ".join(a.name for a in node.names))
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in NAME_CALLS and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value) and not _ours(node.args[1].value, own)):
                found.append(f"{where}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_private_access_outside_compat():
    found = foreign_private_accesses(_sources())
    assert not found, ("private names of torch/DeepSpeed/Megatron/Apex reached outside xirang_ds/compat/ "
                       "(move each behind a named function there):\n" + "\n".join(found))


def test_the_scan_finds_each_kind_of_access(tmp_path):
    """The scan is not vacuous: each way of reaching a private name is reported."""
    code = ("import torch._dynamo\nfrom torch.utils._pytree import tree_map\nfrom torch._C import _nn\n"
            "x = t._version\ny = getattr(engine, '_config')\nwrap_method(engine, '_take_model_step', f)\n"
            "NAMES = ('averaged_gradients', '_link_all_hp_params')\nok = ('_convolution', '_xirang_tag')\n"
            "x.endswith(('_codes',))\nclass A:\n    def __init__(self):\n        self._mine = 1\n    def f(self):\n        return self._mine\n")
    path = ROOT / "plugins" / "probe.py"
    found = foreign_private_accesses({path: ast.parse(code)})
    assert sorted(line.split(": ", 1)[1] for line in found) == sorted([
        "import torch._dynamo", "from torch.utils._pytree import tree_map", "from torch._C import _nn", "t._version", "getattr(..., '_config')",
        "wrap_method(..., '_take_model_step')", "'_link_all_hp_params' in a literal"])


@pytest.mark.parametrize("module", ["torch", "deepspeed", "megatron", "apex", "accelerate", "transformers"])
def test_every_listed_upstream_name_resolves(module):
    """``UPSTREAM_NAMES`` of each compat module: dotted paths resolve in the installed package; for a file
    of the installed package (``"deepspeed/runtime/engine.py"``), each listed line is in it."""
    pytest.importorskip({"torch": "torch", "deepspeed": "deepspeed", "megatron": "megatron.core",
                         "apex": "apex.amp", "accelerate": "accelerate", "transformers": "transformers"}[module])
    names = importlib.import_module(f"xirang_ds.compat.{module}").UPSTREAM_NAMES
    assert names, f"xirang_ds.compat.{module} lists no upstream names"
    missing = []
    for key, needles in names.items():
        if key.endswith(".py"):
            top = importlib.util.find_spec(key.split("/")[0]).submodule_search_locations[0]
            text = (pathlib.Path(top).parent / key).read_text()
            missing += [f"{key}: {needle!r} is gone" for needle in needles if needle not in text]
            continue
        try:
            resolve(key)
        except (ImportError, AttributeError) as e:
            missing.append(f"{key}: {e}")
    assert not missing, "\n".join(missing)
