"""Import layering of the project, read from the source with ``ast`` (nothing is imported):

(a) ``sdfast`` and ``kernels`` never import ``server`` or ``benchmarks`` at module import (top-level statements,
    including those inside top-level ``if`` / ``try`` / ``with`` blocks and class bodies; not inside functions, not
    under ``if TYPE_CHECKING:``): the library runs without the service and the benchmarks;
(b) ``kernels`` never imports ``sdfast``, at any level: the kernels are the bottom layer;
(c) the module-level imports among the project's own modules have no cycle (relative imports resolved,
    ``from pkg import mod`` resolved to the module ``pkg.mod``).

The checks take a source root, so the planted-violation tests below run them on a small tree in ``tmp_path``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sdfast", "kernels", "server", "benchmarks")
LIBRARY = ("sdfast", "kernels")
UPPER = ("server", "benchmarks")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            out[_module_name(root, path)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(body: list[ast.stmt]):
    """The import statements that run when the module is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            yield from _module_level_imports(node.body)
            for handler in node.handlers:
                yield from _module_level_imports(handler.body)
            yield from _module_level_imports(node.orelse)
            yield from _module_level_imports(node.finalbody)
        elif isinstance(node, (ast.With, ast.For, ast.While, ast.ClassDef)):
            yield from _module_level_imports(node.body)
            yield from _module_level_imports(getattr(node, "orelse", []))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict) -> list[str]:
    """The dotted names one import statement imports (project modules resolved; others as written)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level > 1:
            base = base[: len(base) - (node.level - 1)]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{pkg}.{alias.name}"
        out.append(sub if sub in modules else pkg)
    return out


def import_graph(root: Path, *, module_level: bool) -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported dotted name, line)], module-level imports only or every import."""
    modules = project_modules(root)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        nodes = _module_level_imports(tree.body) if module_level else (
            n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        is_package = path.name == "__init__.py"
        graph[name] = [(t, n.lineno) for n in nodes for t in _targets(n, name, is_package, modules)]
    return graph


def _top(name: str) -> str:
    return name.split(".")[0]


def upward_imports(root: Path) -> list[str]:
    """(a): module-level imports from sdfast/kernels into server/benchmarks."""
    return [f"{m} (line {line}) imports {t}" for m, edges in import_graph(root, module_level=True).items()
            if _top(m) in LIBRARY for t, line in edges if _top(t) in UPPER]


def kernels_importing_sdfast(root: Path) -> list[str]:
    """(b): any import of sdfast from kernels, at any level."""
    return [f"{m} (line {line}) imports {t}" for m, edges in import_graph(root, module_level=False).items()
            if _top(m) == "kernels" for t, line in edges if _top(t) == "sdfast"]


def import_cycles(root: Path) -> list[list[str]]:
    """(c): one cycle (as its list of modules, first repeated at the end) per strongly connected component of the
    module-level import graph among project modules."""
    modules = project_modules(root)
    graph = {m: sorted({t for t, _ in edges if t in modules}) for m, edges in import_graph(root, module_level=True).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for comp in components:
        members, start = set(comp), comp[0]
        path, seen = [start], {start}
        while True:  # walk inside the component until the path closes
            nxt = next((w for w in graph[path[-1]] if w in members and (w == start or w not in seen)), None)
            if nxt is None or nxt == start:
                cycles.append(path + [start])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


# ------------------------------------------------------------------------------------------------
# the project
# ------------------------------------------------------------------------------------------------
def test_the_scan_sees_the_project():
    modules = project_modules(ROOT)
    assert {"sdfast", "sdfast.cli", "kernels", "server.app", "benchmarks.bench_txt2img"} <= set(modules)
    every = import_graph(ROOT, module_level=False)
    # sdfast.cli reaches the service and the benchmark inside its commands: seen at function level only
    assert any(_top(t) == "server" for t, _ in every["sdfast.cli"])


def test_library_does_not_import_server_or_benchmarks_at_import():
    found = upward_imports(ROOT)
    assert found == [], "\n".join(found)


def test_kernels_never_import_sdfast():
    found = kernels_importing_sdfast(ROOT)
    assert found == [], "\n".join(found)


def test_no_import_cycles():
    cycles = import_cycles(ROOT)
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


# ------------------------------------------------------------------------------------------------
# the checks fail on planted violations
# ------------------------------------------------------------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_planted_upward_import_is_found(tmp_path):
    root = _tree(tmp_path, {
        "sdfast/a.py": "import server.app\n",
        "sdfast/b.py": "try:\n    from benchmarks import bench\nexcept ImportError:\n    pass\n",
        "kernels/c.py": "import sys\nif sys.platform:\n    from benchmarks.bench import x\n",
        "sdfast/ok.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import server\n"
                         "def f():\n    import server\n"),
        "server/app.py": "", "benchmarks/bench.py": "import sdfast.a\n",
    })
    found = upward_imports(root)
    assert sorted(f.split(" ")[0] for f in found) == ["kernels.c", "sdfast.a", "sdfast.b"], found


def test_planted_kernels_to_sdfast_import_is_found_at_any_level(tmp_path):
    root = _tree(tmp_path, {"kernels/k.py": "def f():\n    from sdfast import config\n", "sdfast/config.py": ""})
    assert kernels_importing_sdfast(root) == ["kernels.k (line 2) imports sdfast.config"]


def test_planted_cycle_is_reported_as_its_modules(tmp_path):
    root = _tree(tmp_path, {
        "kernels/x/__init__.py": "from . import y\n",  # relative, `from pkg import mod`
        "kernels/x/y.py": "from ..z import f\n",
        "kernels/z.py": "from kernels.x import y\n",
        "sdfast/lazy.py": "def f():\n    import sdfast.lazy2\n", "sdfast/lazy2.py": "import sdfast.lazy\n",
    })
    assert import_cycles(root) == [["kernels.x.y", "kernels.z", "kernels.x.y"]]


@pytest.mark.parametrize("module,level,name,want", [
    ("kernels.norm.group_norm", 1, "dispatch", "kernels.norm.dispatch"),
    ("kernels.norm", 2, "dispatch", "kernels.dispatch"),
])
def test_relative_imports_resolve(tmp_path, module, level, name, want):
    root = _tree(tmp_path, {"kernels/norm/__init__.py": "", "kernels/norm/group_norm.py": "",
                            "kernels/dispatch.py": "", "kernels/norm/dispatch.py": ""})
    node = ast.ImportFrom(module=None, names=[ast.alias(name=name)], level=level)
    assert _targets(node, module, module == "kernels.norm", project_modules(root)) == [want]
