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
    assert long == {}, (f"split these modules by responsibility, one job a module, not by moving lines between "
                       f"neighbours (at most {MAX_MODULE_LINES} lines each): {long}")


# -- the direction of imports between megarl's parts ---------------------------------------------------------------
#: megarl's parts (a package of megarl, or a module at its top) from the bottom up. A part imports only parts of
#: lower layers, apart from the few imports of UPWARD; docs/design.md's map of the code draws the same table.
LAYERS = [
    ("errors", "routes"),
    ("types", "platform", "isolation", "cli"),
    ("stop_protocol", "failure_causes"),
    ("losses", "tokenizer"),
    ("config",),
    ("data",),
    ("models",),
    ("workers",),
    ("rewards",),
    ("tasks",),
    ("agents",),
    ("workflows",),
    ("rollout",),
    ("trainer",),
    ("checkpoint",),
    ("loop",),
    ("launch",),
    ("preflight",),
    ("builder",),
    ("train",),
    ("verify", "bench"),
    ("advise",),
    ("commands",),
]
#: the imports that run back up (importer -> imported module), each with why it stays
UPWARD = {
    ("megarl.launch.cost_table", "megarl.builder"): "the strategies' config classes, read inside a function",
    ("megarl.models.bridge", "megarl.trainer.parallel"): "the rank that converts, from the trainer's world",
    ("megarl.rollout.publish", "megarl.launch.roles"): "which role this process plays in a launched job",
    ("megarl.trainer.world_store", "megarl.launch.listen_check"): "the address check every launched role runs",
    ("megarl.workers.process", "megarl.rewards"): "a reward worker process resolves reward.fn itself",
}
MAX_UPWARD = 5


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def upward_imports(root: Path, layers: list[tuple[str, ...]]) -> tuple[set[tuple[str, str]], set[str]]:
    """(importer, imported) pairs of megarl modules under ``root`` whose part sits in a higher layer than the
    importer's (or in the same layer, another part), and the parts no layer names."""
    level = {part: i for i, parts in enumerate(layers) for part in parts}
    up, unplaced = set(), set()
    for path in sorted((root / "megarl").rglob("*.py")):
        importer = _module_under(root, path)
        src = _part(importer)
        if src == "megarl":
            continue
        unplaced |= {src} - set(level)
        for name in _imported(path):
            if not name.startswith("megarl.") or _part(name) == src:
                continue
            dst = _part(name)
            target = name if _is_module(root, name) else name.rpartition(".")[0]
            if dst not in level:
                unplaced.add(dst)
            elif src in level and level[dst] >= level[src]:
                up.add((importer, target))
    return up, unplaced


def _module_under(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(root: Path, name: str) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def test_imports_run_down_the_layers():
    up, unplaced = upward_imports(ROOT, LAYERS)
    assert unplaced == set(), f"place these parts of megarl in LAYERS (and in docs/design.md's map): {unplaced}"
    assert up <= set(UPWARD), f"imports that run back up, not in UPWARD: {sorted(up - set(UPWARD))}"
    assert set(UPWARD) <= up, f"UPWARD lists imports that no longer exist: {sorted(set(UPWARD) - up)}"
    assert len(UPWARD) <= MAX_UPWARD


def test_the_layer_check_sees_a_wrong_import(tmp_path):
    # a trainer module that reaches up into the loop, and one inside a function, are both found
    for rel, text in {"megarl/__init__.py": "", "megarl/trainer/__init__.py": "", "megarl/loop/__init__.py": "",
                      "megarl/loop/controller.py": "X = 1\n",
                      "megarl/trainer/step.py": "from megarl.loop.controller import X\n",
                      "megarl/trainer/late.py": "def f():\n    import megarl.loop.controller\n",
                      "megarl/trainer/ok.py": "from megarl.trainer.step import X\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    up, unplaced = upward_imports(tmp_path, [("loop",), ("trainer",)])
    assert up == set() and unplaced == set()
    up, unplaced = upward_imports(tmp_path, [("trainer",), ("loop",)])
    assert up == {("megarl.trainer.step", "megarl.loop.controller"), ("megarl.trainer.late", "megarl.loop.controller")}
    assert upward_imports(tmp_path, [("loop",)])[1] == {"trainer"}


def test_the_top_level_keeps_entry_points_and_what_everything_shares():
    top = sorted(p.stem for p in (ROOT / "megarl").glob("*.py") if p.stem != "__init__")
    assert top == ["builder", "cli", "data", "errors", "failure_causes", "preflight", "routes", "stop_protocol",
                   "tokenizer", "train", "types"]


def test_the_launcher_imports_no_torch():
    # megarl/launch runs on a login node before any environment is set up: its import, and the light modules it
    # builds on (core lists, roles), must not load torch. platform/__init__.py once imported it for everyone
    out = subprocess.run([sys.executable, "-c", "import sys, megarl.launch, megarl.platform.cpu_affinity, "
                          "megarl.isolation.secret_env; print(sorted(m for m in ('torch', 'megatron', 'vllm') "
                          "if m in sys.modules))"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
