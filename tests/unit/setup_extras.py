"""The extras setup.py declares (read from its source: importing setup.py would run setuptools)."""
from __future__ import annotations

import ast
from pathlib import Path

SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def names() -> set[str]:
    for node in ast.walk(ast.parse(SETUP.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return {k.value for k in node.value.keys}
    raise AssertionError("setup.py declares no extras_require")
