"""The import structure of the package: no circle, few imports inside functions, no borrowed private names.

STYLE.md: layers point one way (compat → memory → config → plugins → session → planning → integration →
cli), and a circle closed by a function-level import is a circle. So every import counts as an edge here,
wherever it stands (module level, inside a function, under ``TYPE_CHECKING``). An import inside a function
is kept for an optional or heavy dependency (deepspeed, megatron, matplotlib, a plugin loaded on demand by
the registry), not to hide a circle; the share of them is bounded. A module's ``_private`` name stays in
that module: another module that needs it imports a public name.

Run as a script (``python tests/structure/test_imports.py``) to print the figures.
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = {"xirang_ds": ROOT / "xirang_ds", "xirang_ds.plugins": ROOT / "plugins"}
"""Package name → folder: the built-in plugins are installed as ``xirang_ds.plugins`` (setup.py)."""
MAX_FUNCTION_LEVEL_SHARE = 0.20
"""Issue 56: function-level imports at most 20% of the internal imports."""


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    names: tuple[str, ...]
    in_function: bool
    line: int


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _resolve(modules: dict[str, pathlib.Path], source: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = source if modules[source].name == "__init__.py" else source.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _known(modules: dict[str, pathlib.Path], name: str) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports_of(modules: dict[str, pathlib.Path], source: str) -> list[Import]:
    tree = ast.parse(modules[source].read_text(), str(modules[source]))
    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    target = _known(modules, alias.name)
                    if target and alias.name.startswith("xirang_ds"):
                        out.append(Import(source, target, (), in_function, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(modules, source, child)
                if not base.startswith("xirang_ds"):
                    continue
                plain: list[str] = []
                for alias in child.names:
                    if f"{base}.{alias.name}" in modules:  # a submodule
                        out.append(Import(source, f"{base}.{alias.name}", (), in_function, child.lineno))
                    else:
                        plain.append(alias.name)
                target = _known(modules, base)
                if plain and target:
                    out.append(Import(source, target, tuple(plain), in_function, child.lineno))
            visit(child, inner)

    visit(tree, False)
    return [i for i in out if i.target != source]


def all_imports() -> list[Import]:
    modules = _modules()
    return [i for source in modules for i in _imports_of(modules, source)]


def circles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        graph.setdefault(i.source, set()).add(i.target)
        graph.setdefault(i.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        # iterative Tarjan: the graph is small, but recursion depth is not worth the risk
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def function_level_share(imports: list[Import]) -> float:
    return sum(i.in_function for i in imports) / max(len(imports), 1)


def private_imports(imports: list[Import]) -> list[str]:
    return [f"{i.source}:{i.line} takes {name} from {i.target}" for i in imports for name in i.names
            if name.startswith("_") and not name.startswith("__")]


def test_the_scan_sees_the_package():
    imports = all_imports()
    assert len(imports) > 300
    assert any(i.target == "xirang_ds.registry" for i in imports)


def test_no_import_circle():
    found = circles(all_imports())
    assert not found, "import circles (every import counts, wherever it stands):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_function_level_imports_are_the_exception():
    imports = all_imports()
    share = function_level_share(imports)
    assert share <= MAX_FUNCTION_LEVEL_SHARE, (
        f"{share:.1%} of {len(imports)} internal imports sit inside functions (at most "
        f"{MAX_FUNCTION_LEVEL_SHARE:.0%}): import at the top of the module, or break the circle that forced it")


def test_no_module_takes_another_modules_private_names():
    taken = private_imports(all_imports())
    assert not taken, "private names taken across modules (make them public or keep them home):\n" + "\n".join(taken)


if __name__ == "__main__":
    imports = all_imports()
    found = circles(imports)
    print(f"internal imports: {len(imports)}, inside functions: {sum(i.in_function for i in imports)} "
          f"({function_level_share(imports):.1%})")
    print(f"circles: {len(found)}")
    for c in found:
        print("  ", " ".join(c))
    taken = private_imports(imports)
    print(f"private names taken: {len(taken)}")
    for t in taken:
        print("  ", t)
