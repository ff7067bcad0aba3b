"""The code blocks of README.md and docs/guide.md and how each one is checked.

A block is what a CommonMark reader shows as code: a fenced block, or lines indented four spaces past the
paragraph they follow (inside a numbered step, four past the step's text). Each is named by a marker comment,
``<!-- doc-test: NAME -->``, on the line before it (blank lines between are allowed). ``CHECKS`` says, by name,
how each block is checked:

- ``run``: a test runs the block's text as written (taken from the doc, so an edit is what runs);
- ``same``: the block is a long command (the demo, the whole suite) and a test checks that it is exactly the
  command that CI or a shorter test runs;
- ``checked``: the block needs a cluster or minutes of CPU; a test runs it as far as a CPU allows (its config
  and overrides load, its paths exist);
- ``not-runnable``: nothing here can run it (an output listing); the reason, and the sha256 of the text it was
  classed on, so an edited block is looked at again.

``by`` names the test that does it (``path::function``); that function names the block in its source.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/guide.md")
MARKER = re.compile(r"^\s*<!-- doc-test: ([\w-]+) -->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
HOWS = ("run", "same", "checked", "not-runnable")
UNIT = "tests/unit/test_doc_blocks.py"


@dataclass(frozen=True)
class Block:
    doc: str  #: path relative to the repository
    line: int  #: 1-based line of the block's first line of code
    name: str | None  #: from the marker comment before it
    text: str  #: the code, dedented to the block's indentation
    info: str = ""  #: a fenced block's language

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def sha(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:12]

    def commands(self) -> list[str]:
        """The block's shell commands, one per entry: lines ending in a backslash joined with the next."""
        out, current = [], ""
        for line in self.text.splitlines():
            current += line.strip()
            if current.endswith("\\"):
                current = current[:-1].rstrip() + " "
                continue
            if current:
                out.append(current)
            current = ""
        return out


@dataclass(frozen=True)
class Check:
    how: str  #: one of HOWS
    by: str  #: ``path::function`` of the test, or for not-runnable blocks why nothing runs them
    sha: str = ""  #: not-runnable blocks: Block.sha of the text they were classed on


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def extract(doc: str, root: Path = ROOT) -> list[Block]:
    """Every code block of ``doc`` in order of appearance."""
    lines = (root / doc).read_text().splitlines()
    blocks: list[Block] = []
    base, after_blank, i = 0, True, 0  # base: indentation of the text the next indented block would sit in

    def name_before(k: int) -> str | None:
        k -= 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        m = MARKER.match(lines[k]) if k >= 0 else None
        return m.group(1) if m else None

    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence and _indent(line) < base + 4:
            close = re.compile(rf"^\s*{re.escape(fence.group(2)[0])}{{{len(fence.group(2))},}}\s*$")
            j = i + 1
            while j < len(lines) and not close.match(lines[j]):
                j += 1
            cut = _indent(line)  # a fence's own indentation is removed from its lines, as far as they have it
            body = [x[min(cut, _indent(x)):] for x in lines[i + 1:j]]
            blocks.append(Block(doc, i + 2, name_before(i), "\n".join(body) + "\n", fence.group(3).strip()))
            i, after_blank = j + 1, False
            continue
        if line.strip() and after_blank and _indent(line) >= base + 4:
            start, depth, j = i, _indent(line), i
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) >= depth):
                j += 1
            while not lines[j - 1].strip():  # trailing blank lines belong to no block
                j -= 1
            body = [x[depth:] for x in lines[start:j]]
            blocks.append(Block(doc, start + 1, name_before(start), "\n".join(body) + "\n"))
            i, after_blank = j, False
            continue
        if MARKER.match(line):  # an HTML comment ends the paragraph before it: an indented block may follow
            after_blank = True
        elif line.strip():
            base, after_blank = _indent(line), False
        else:
            after_blank = True
        i += 1
    return blocks


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for doc in DOCS for b in extract(doc, root)]


def block(name: str) -> Block:
    """The block marked ``name`` (KeyError naming the markers there are)."""
    found = {b.name: b for b in all_blocks()}
    if name not in found:
        raise KeyError(f"no block marked <!-- doc-test: {name} --> in {', '.join(DOCS)}; marked: {sorted(found)}")
    return found[name]


def problems(blocks: list[Block], checks: dict[str, Check], root: Path = ROOT) -> list[str]:
    """Why the listing is not complete: one line per block without a check (naming its file and line), per
    check without a block, per check whose test does not exist or does not name its block, and per
    not-runnable block whose text changed since it was classed."""
    out, seen = [], set()
    for b in blocks:
        if b.name is None:
            out.append(f"{b.where}: a code block without a <!-- doc-test: NAME --> marker on the line before it; "
                       f"mark it and say in tests/doc_blocks.py CHECKS how it is checked")
            continue
        if b.name in seen:
            out.append(f"{b.where}: the marker name {b.name!r} is used twice")
        seen.add(b.name)
        check = checks.get(b.name)
        if check is None:
            out.append(f"{b.where}: block {b.name!r} is not in tests/doc_blocks.py CHECKS: add how it is checked")
        elif check.how not in HOWS:
            out.append(f"{b.where}: block {b.name!r}: how={check.how!r} is not one of {HOWS}")
        elif check.how == "not-runnable":
            if check.sha != b.sha:
                out.append(f"{b.where}: block {b.name!r} changed since it was classed not runnable ({check.by}); "
                           f"check that it still cannot run here, then set sha={b.sha!r}")
        else:
            out.extend(f"{b.where}: block {b.name!r}: {p}" for p in _test_names(check.by, b.name, root))
    out.extend(f"tests/doc_blocks.py CHECKS: {n!r} names no block in the docs" for n in sorted(set(checks) - seen))
    return out


def _test_names(by: str, name: str, root: Path) -> list[str]:
    """Nothing when ``by`` (``path::function``) exists and its source names the block ``name`` in quotes."""
    import ast

    path, _, func = by.partition("::")
    if not (root / path).is_file():
        return [f"its test file {path} does not exist"]
    tree = ast.parse((root / path).read_text())
    fn = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and n.name == func), None)
    if fn is None:
        return [f"{path} has no function {func!r}"]
    if not any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(fn)):
        return [f"{by} does not name the block {name!r}: it cannot be the test that runs it"]
    return []


#: how each marked block is checked, by marker name
CHECKS: dict[str, Check] = {
    # README.md
    "demo": Check("same", f"{UNIT}::test_the_demo_is_the_train_command_the_e2e_run_starts"),
    "tests": Check("same", f"{UNIT}::test_ci_runs_exactly_the_readme_test_command"),
    **{name: Check("run", f"{UNIT}::test_the_gpu_quick_start_blocks_are_what_its_test_runs")
       for name in ("gpu-install", "gpu-check", "gpu-download", "gpu-data-check", "gpu-plan", "gpu-plan-30b",
                    "gpu-submit")},
    "data-rows": Check("run", f"{UNIT}::test_the_data_rows_load_as_rows"),
    "prepare-data": Check("run", f"{UNIT}::test_prepare_data_runs_as_written"),
    "train-strategies": Check("run", "tests/e2e/test_train.py::readme_train"),
    "agent-fn": Check("run", f"{UNIT}::test_the_agent_function_example_runs_an_episode_with_its_tool"),
    "agent-http": Check("run", f"{UNIT}::test_the_agent_command_example_runs_an_episode"),
    # docs/guide.md
    "guide-dry-run": Check("run", f"{UNIT}::test_the_guides_dry_run_runs_as_written"),
    "guide-ranks": Check("same", f"{UNIT}::test_the_guides_two_rank_commands_are_what_the_distributed_test_runs"),
    "guide-advise": Check("checked", f"{UNIT}::test_the_guides_advise_command_loads_its_config"),
    "guide-layout": Check("checked", f"{UNIT}::test_every_path_of_the_guides_layout_exists"),
}
