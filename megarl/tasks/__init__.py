"""Built-in synthetic tasks: prompt generators with a verifiable reward.

A task module exposes ``make_prompt(rng) -> (prompt_ids, meta)``,
``reward(response_ids, meta) -> float``, ``MAX_PROMPT_LEN`` (the longest
prompt it can generate, so a dataset can check ``max_prompt_len`` before the
run) and ``STOP_TOKEN_IDS`` (the tokens that end an answer).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from megarl.errors import ConfigError

# task name -> module; modules are imported on first use.
TASKS: dict[str, str] = {
    "reverse_digits": "megarl.tasks.reverse_digits",
}


def get_task(name: str) -> ModuleType:
    """The module of built-in task ``name``."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    return importlib.import_module(TASKS[name])
