"""The import structure of `elastic` and `providers`: no import cycles, and no module imports another
module's private names.

Every module under the package directories is parsed with `ast` (not imported), so this is fast
and sees every import: module-level and function-level (a lazy import is still an edge), absolute
and relative. `from pkg import mod` where `pkg.mod` is a module is an edge to `pkg.mod`; a package's
`__init__` is a node like any module (importing `pkg.mod` is not counted as an edge to `pkg`, so a
package whose `__init__` imports its own modules is no cycle). The directories are walked, so modules moved into
subpackages are covered without changing this file.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("elastic", "providers")

# Import cycles already known and being removed elsewhere, with the private names their modules
# import from each other; delete the line when they are gone.
KNOWN_TANGLES: list[frozenset[str]] = []


def _modules() -> dict[str, Path]:
    """Dotted module name -> its source file, for every module under PACKAGES."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _package_of(name: str, path: Path) -> str:
    """The package a module's relative imports are resolved against."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, path: Path, modules: dict) -> list[tuple[str, int, str | None]]:
    """(imported module, line, imported attribute or None) for every import in one module whose
    target is one of `modules`. The attribute is the name a `from m import attr` takes from
    module `m`; None when the import names a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in modules:  # `import a.b.c` where c is not ours
                    target = target.rpartition(".")[0]
                if target:
                    out.append((target, node.lineno, None))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(name, path)
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            if source not in modules:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:
                    out.append((sub, node.lineno, None))
                else:
                    out.append((source, node.lineno, alias.name))
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (within PACKAGES), self-imports left out."""
    modules = _modules()
    return {name: {target for target, _, _ in _imports(name, path, modules) if target != name}
            for name, path in modules.items()}


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
            out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest import cycle through the first module of `component`, start repeated at the end."""
    start, members = component[0], set(component)
    paths, seen = {start: [start]}, {start}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in seen:
                    seen.add(w)
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not a cycle")


def import_cycles() -> list[str]:
    """One import cycle per strongly connected component of more than one module, as `a -> b -> a`
    (and the component's other modules, when it has more), known tangles left out."""
    graph = _graph()
    out = []
    for component in _components(graph):
        if len(component) > 1 and frozenset(component) not in KNOWN_TANGLES:
            cycle = _cycle(graph, component)
            others = sorted(set(component) - set(cycle))
            out.append(" -> ".join(cycle) + (f" (tangled with {', '.join(others)})" if others else ""))
    return out


def private_imports() -> list[str]:
    """Every `from m import _name` where `m` is another module, as `file:line: from m import _name`,
    known tangles left out."""
    modules = _modules()
    out = []
    for name, path in modules.items():
        for target, line, attr in _imports(name, path, modules):
            if (attr and attr.startswith("_") and not attr.endswith("__") and target != name
                    and not any({name, target} <= t for t in KNOWN_TANGLES)):
                out.append(f"{path.relative_to(ROOT)}:{line}: from {target} import {attr}")
    return out


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_names_imported_across_modules():
    found = private_imports()
    assert not found, "private names imported from another module:\n" + "\n".join(found)


def test_the_checks_see_cycles_and_private_imports(tmp_path, monkeypatch):
    """The checks find a cycle through a relative, a function-level and a `from pkg import mod`
    import, and a private name imported from a sibling."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\nfrom pkg.b import _helper\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGES", ("pkg",))
    assert import_cycles() == ["pkg.a -> pkg.b -> pkg.sub.c -> pkg.a"]
    assert private_imports() == ["pkg/sub/c.py:2: from pkg.b import _helper"]
