"""No import cycle among megarl's modules, not even one hidden behind an import inside a function.

tests/unit/test_dependencies.py imports every module first, which catches a
cycle only when it breaks at import time; a cycle closed by an import inside a
function imports fine and still ties two modules into one. This test reads the
imports with ``ast`` (module level, class bodies, functions; not ``if
TYPE_CHECKING:`` blocks, which never run), builds the graph of megarl's modules
and fails naming every cycle it finds.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``package_dir`` (a package is its ``__init__``)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere it runs code; ``from pkg import mod`` counts as
    an import of ``pkg.mod`` when that is a module, else of ``pkg``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {m for m in found if m in modules and modules[m] != path}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as one cycle through it, in order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_one_cycle(graph, comp) for comp in components]


def _one_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A path from the component's first module back to itself, inside the component (breadth first)."""
    start = min(comp)
    came_from = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(comp)} is strongly connected but has no cycle through {start}")


def module_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = module_names(package_dir)
    return {name: imported_modules(path, modules) for name, path in modules.items()}


def test_megarl_has_no_import_cycle():
    graph = module_graph(ROOT / "megarl")
    assert len(graph) > 100
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles (move what both sides need into a module of its own):\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_a_cycle_behind_an_import_inside_a_function_is_found(tmp_path):
    # the negative control: the shape of a cycle that imports fine at runtime
    pkg = _package(tmp_path, {"a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
                              "b.py": "def g():\n    from pkg.a import f\n    return f\n",
                              "c.py": "import pkg.a\n"})
    assert import_cycles(module_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_a_longer_cycle_is_listed_in_order_and_from_imports_of_submodules_count(tmp_path):
    pkg = _package(tmp_path, {"a.py": "from pkg import b\n", "b.py": "from pkg.sub.c import x\n",
                              "sub/__init__.py": "", "sub/c.py": "class K:\n    def m(self):\n        import pkg.a\n"})
    assert import_cycles(module_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_type_checking_imports_and_one_way_imports_are_no_cycle(tmp_path):
    pkg = _package(tmp_path, {"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import g\n",
                              "b.py": "import pkg.a\n", "c.py": "import pkg.a\nimport pkg.b\n"})
    assert import_cycles(module_graph(pkg)) == []
