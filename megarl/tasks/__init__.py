"""Generators of the text datasets the CPU demo and tests use, and their rewards.

Each task module writes JSONL rows ``{"id", "prompt", "answer"}`` (the same
format users bring, see megarl/data.py) and defines a reward on decoded text
(megarl/rewards/__init__.py) or uses a built-in one; the files under
``configs/data/`` were written by ``python -m megarl.tasks.<task> OUT.jsonl --n N --seed S``.
"""
from __future__ import annotations

import argparse
import functools
import json
import random
from pathlib import Path
from typing import Any, Callable

MakeRow = Callable[[random.Random], dict]


def write_rows(path: str | Path, n: int, seed: int, task: str, make_row: MakeRow) -> None:
    """Write ``n`` rows ``{"id", **make_row(rng)}``; row i depends only on (task, seed, i)."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            row = make_row(random.Random(f"{task}/{seed}/{i}"))
            f.write(json.dumps({"id": f"{task}/{seed}/{i}", **row}) + "\n")


def main(task: str, make_row: MakeRow, description: str, argv: list[str] | None = None,
         options: dict[str, tuple[Any, str]] | None = None) -> None:
    """``python -m megarl.tasks.<task> OUT.jsonl --n N [--seed S] [--option VALUE ...]``.

    ``options`` maps a keyword of ``make_row`` to (default, help); each becomes ``--keyword-with-dashes``
    of the default's type, and rows are made by ``make_row(rng, **options)``.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("output")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    for name, (default, help_) in (options or {}).items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=type(default), default=default, help=help_)
    args = p.parse_args(argv)
    kwargs = {name: getattr(args, name) for name in options or {}}
    write_rows(args.output, args.n, args.seed, task, functools.partial(make_row, **kwargs))
