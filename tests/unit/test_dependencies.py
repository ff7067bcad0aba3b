"""Dependencies point one way: ``recovery`` (the strategy plug-ins) imports megarl; of megarl, only the builder
imports ``recovery``. And every module imports on its own, whatever was imported before it, so no import cycle
hides behind an import inside a function."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the one module of megarl that wires the plug-ins in
BUILDER = ROOT / "megarl" / "builder.py"


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere (module level, functions, TYPE_CHECKING blocks)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (megarl imports absolutely)"
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _imports_recovery(path: Path) -> list[str]:
    return sorted(n for n in _imported(path) if n == "recovery" or n.startswith("recovery."))


def test_only_the_builder_imports_recovery():
    offenders = {str(p.relative_to(ROOT)): _imports_recovery(p) for p in _sources("megarl") if p != BUILDER}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert _imports_recovery(BUILDER), "the builder no longer wires the strategies in: update BUILDER"


def test_recovery_builds_on_megarl():
    uses = set().union(*(_imported(p) for p in _sources("recovery")))
    assert any(n.startswith("megarl.") for n in uses)


def test_the_check_sees_imports_inside_functions(tmp_path):
    # the rule above must not be dodged by moving the import into a function
    f = tmp_path / "m.py"
    f.write_text("def build():\n    from recovery.registry import build as b\n    return b\n")
    assert _imports_recovery(f) == ["recovery.registry", "recovery.registry.build"]


_FRESH_IMPORTS = """
import importlib, json, sys
ours = ("megarl", "recovery")
failed = {}
for name in json.loads(sys.argv[1]):
    for m in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
print(json.dumps(failed))
"""


def test_every_module_imports_first():
    """Each module imported with no other megarl or recovery module loaded before it (third-party ones stay
    loaded, which keeps this fast): an import cycle fails here in whichever module enters it first."""
    modules = [_module(p) for pkg in ("megarl", "recovery") for p in _sources(pkg)]
    out = subprocess.run([sys.executable, "-c", _FRESH_IMPORTS, json.dumps(modules)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}
    assert len(modules) > 100


#: the longest a module of megarl or recovery may grow before it is split by job
MAX_MODULE_LINES = 400


def test_no_module_outgrows_one_job():
    long = {str(p.relative_to(ROOT)): n for pkg in ("megarl", "recovery") for p in _sources(pkg)
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"split these modules by job (at most {MAX_MODULE_LINES} lines each): {long}"
