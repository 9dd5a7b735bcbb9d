"""The import rules of docs/DESIGN ("Which part may import which"), read off the source: flashgen/api uses
only the public names of flashgen.kernels (the package itself, never a family module), and no two flashgen
modules import each other in a circle (imports inside functions count; a package's ``__init__`` re-exports
count as edges from the package)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import flashgen

ROOT = Path(flashgen.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _bound(package: str, modules: dict[str, Path]) -> set[str]:
    """The names a package's ``__init__`` binds at its top level (imports, definitions, assignments)."""
    path = modules.get(package)
    if path is None or path.name != "__init__.py":
        return set()
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The flashgen modules ``name`` imports anywhere in its body: ``from a.b import c`` is an edge to ``a.b.c``
    where that is a module, else to ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import x` names the submodule pkg.x unless pkg's __init__ binds x itself (a re-export)
            targets = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules
                       and alias.name not in _bound(target, modules) else target for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import flashgen.spec.parts as p` -> the module itself
                target = target.rpartition(".")[0]
            if target.startswith("flashgen") and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "flashgen.jit" in graph["flashgen.api.decode"]  # `from ..jit import build` inside a method
    assert "flashgen.kernels" in graph["flashgen.api.decode"]
    assert {"flashgen.kernels.decode", "flashgen.kernels.prefill_sm90"} <= graph["flashgen.kernels"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_api_imports_no_kernels_internals():
    bad = {(name, target) for name, targets in import_graph().items() if name.startswith("flashgen.api")
           for target in targets if target.startswith("flashgen.kernels.")}
    assert not bad, f"flashgen/api imports kernels internals (use flashgen.kernels' exports): {sorted(bad)}"


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, f"flashgen modules import each other in a circle: {found}"


def test_every_family_is_registered_by_the_kernels_package():
    from flashgen.kernels import ops

    assert set(ops()) == {"decode", "prefill", "prefill_sm90", "rope_gather", "merge_states", "append"}
    # a bare ``register(`` call: the kernel registry's (another library's ``X.register(`` is not one)
    registering = [name for name, path in _modules().items()
                   if name.startswith("flashgen.") and re.search(r"(?<![.\w])register\(", path.read_text())
                   and name not in ("flashgen.kernels", "flashgen.kernels.family")]
    assert not registering, f"families registered outside flashgen/kernels/__init__.py: {registering}"


def test_python_files_stay_short():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long or set(long) <= {"plan/split_kv.py"}, f"files over 600 lines: {long}"


def test_plan_imports_spec_only_and_spec_nothing():
    # docs/DESIGN: the planner is pure host code (its native module is built by flashgen.jit_native, which
    # registers itself as the loader), and specs import nothing of flashgen
    graph = import_graph()
    bad = {(name, target) for name, targets in graph.items() for target in targets
           if (name.startswith("flashgen.plan") and not target.startswith(("flashgen.plan", "flashgen.spec")))
           or (name.startswith("flashgen.spec") and not target.startswith("flashgen.spec"))}
    assert not bad, f"plan / spec import outside their layer: {sorted(bad)}"
