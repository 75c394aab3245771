"""The core names no plugin: plugins register what they contribute and the core asks the registry.

STYLE.md: a plugin's folder holds its config, its plugin, its framework adapters, its estimate and its
checkpoint parts, "so a reader finds the whole capability in one place and the core names no plugin". Two
ways the core (``xirang_ds/``) could name one, both caught here wherever they stand (module level, inside a
function, under ``TYPE_CHECKING``):

* an import of ``xirang_ds.plugins.<plugin>`` (or ``plugins.<plugin>``, the checkout's folder); the registry
  loads the built-in plugins by the list their package keeps (``plugins/__init__.py``'s ``BUILTIN``);
* a string that is a built-in plugin's section key (``"grad_release"``), or a key under it
  (``"grad_release.masters"``, ``"xirang.grad_release.masters"``); docstrings and comments may name a plugin
  to explain, code may not decide by one.

`ALLOWED` lists what stays, each with why; a stale entry fails too, so the list only shrinks.

Run as a script (``python tests/structure/test_core_names_no_plugin.py``) to print every hit.
"""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "xirang_ds"


def builtin_sections() -> tuple[str, ...]:
    """The built-in plugins' section keys, read from ``plugins/__init__.py``'s ``BUILTIN`` (not imported)."""
    tree = ast.parse((ROOT / "plugins" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "BUILTIN" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("plugins/__init__.py has no BUILTIN")


_TUNER = ("the tuner's search space lists the options it searches, each as the block keys it sets; moving each "
          "plugin's options beside the plugin (a role the tuner asks) is left for later")
_PRESETS = ("a preset is the block it expands to, written in the block's own keys as the files in configs/ are; "
            "docs/config.md's preset table is generated from it in this order")
_RULES = ("a rule between two sections names both; the one table keeps every row tested both ways and the "
          "problems in a fixed order (moving each row to the plugin whose key it reports on is left for later)")
_MEGATRON = ("Megatron-LM's own flags that clash with a section (its recompute, fp16/bf16, distributed optimizer "
             "and checkpoint format), one message per section; another change owns integration/megatron*")
ALLOWED: dict[tuple[str, str], str] = {
    **{("xirang_ds/memory/categories.py", s): "memory categories, named like the sections whose tensors they "
       "count: a category, not a section" for s in ("optimizer_states", "activations", "comm_buffers", "memory_pool")},
    ("xirang_ds/memory/pool.py", "memory_pool"): "the allocator's `PoolTooSmall` names the key that sizes it "
                                                 "(xirang.memory_pool.size), the fix a user needs",
    **{("xirang_ds/config/presets.py", s): _PRESETS
       for s in ("comm_buffers", "grad_release", "activations", "memory_pool", "monitor", "optimizer_states")},
    **{("xirang_ds/config/rules.py", s): _RULES for s in ("monitor", "activations", "grad_release", "comm_buffers")},
    **{("xirang_ds/integration/megatron_conflicts.py", s): _MEGATRON
       for s in ("activations", "precision", "optimizer_states", "grad_release")},
    **{("xirang_ds/tune/space.py", s): _TUNER for s in ("optimizer_states", "grad_release", "precision",
                                                         "activations", "comm_buffers", "monitor", "profiler")},
    **{("xirang_ds/tune/__init__.py", s): _TUNER for s in ("activations", "monitor", "profiler")},
    ("xirang_ds/step_counts.py", "profiler"): "torch's op namespace of record_function's annotations "
                                               "(``torch.ops.profiler``), which launch no kernel: not the section",
}
"""(module path under xirang_ds/, section) → why the core names that plugin there."""


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
        # attribute docstrings: a string statement right after an assignment
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    out.add(id(stmt.value))
    return out


def hits() -> list[tuple[str, int, str, str]]:
    """``(path, line, section, what)`` for every place the core names a built-in plugin."""
    sections = builtin_sections()
    named = re.compile(r"^(?:xirang\.)?(%s)(?:\.|\[|$)" % "|".join(map(re.escape, sections)))
    out = []
    for path in sorted(CORE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), rel)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for module in modules:
                m = re.match(r"^(?:xirang_ds\.)?plugins\.(\w+)", module)
                if m:
                    out.append((rel, node.lineno, m.group(1), f"imports {module}"))
                    break
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                m = named.match(node.value)
                if m:
                    out.append((rel, node.lineno, m.group(1), f"names {node.value!r}"))
    return out


def test_the_scan_sees_the_sections():
    assert {"grad_release", "optimizer_states", "activations"} <= set(builtin_sections())


def test_the_core_names_no_plugin():
    found = [h for h in hits() if (h[0], h[2]) not in ALLOWED]
    assert not found, ("the core names a plugin (register what the plugin contributes and ask the registry, or "
                       "justify an ALLOWED entry):\n" + "\n".join(f"  {p}:{n}: {what}" for p, n, _, what in found))


def test_every_allowed_entry_is_still_needed():
    seen = {(h[0], h[2]) for h in hits()}
    stale = [key for key in ALLOWED if key not in seen]
    assert not stale, f"ALLOWED entries no longer needed (remove them): {stale}"


if __name__ == "__main__":
    for path, line, section, what in hits():
        mark = " (allowed)" if (path, section) in ALLOWED else ""
        print(f"{path}:{line}: {what}{mark}")
