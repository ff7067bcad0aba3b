"""Verifiable rewards, addressed by name, scored off the critical path.

A reward function is ``fn(response_ids: list[int], meta: dict) -> float``.
It is named by a built-in name (:data:`BUILTIN_REWARDS`) or a dotted path
``"pkg.mod:func"`` / ``"pkg.mod.func"``; :func:`resolve_reward_fn` imports it
and is called at startup, so a typo fails before the run, not at step 1.

Text-based rewards (``math``, ``code``) read the decoded response from
``meta["response_text"]``: tiny models have no tokenizer, so decoding is not
the reward's job. Either the workflow puts the text there, or
``RewardService(detokenize="pkg.mod:decode")`` names a ``decode(ids) -> str``
that the reward workers apply when the key is missing.

:class:`RewardService` (in ``service.py``) runs the chosen function in a pool
of worker processes with time and memory limits.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from megarl.errors import ConfigError

RewardFn = Callable[[list[int], dict[str, Any]], float]

# built-in name -> dotted path; the workers resolve the same path.
BUILTIN_REWARDS: dict[str, str] = {
    "reverse_digits": "megarl.tasks.reverse_digits:reward",
    "math": "megarl.rewards.math:math_reward",
    "code": "megarl.rewards.code:code_reward",
}


def register_reward(name: str, path: str) -> None:
    """Add a built-in name for the function at dotted ``path`` (duplicates are refused)."""
    if name in BUILTIN_REWARDS:
        raise ConfigError(f"reward {name!r} is already registered as {BUILTIN_REWARDS[name]!r}")
    BUILTIN_REWARDS[name] = path


def _split_path(path: str) -> tuple[str, str]:
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ConfigError(f"reward function {path!r} is neither a built-in ({sorted(BUILTIN_REWARDS)}) "
                          f"nor a dotted path 'pkg.mod:func' / 'pkg.mod.func'")
    return module, attr


def resolve_reward_fn(name: str) -> Callable[..., Any]:
    """The callable named by a built-in reward name or a dotted path; ConfigError if it cannot be loaded."""
    path = BUILTIN_REWARDS.get(name, name)
    module_name, attr = _split_path(path)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure of user code is a config problem
        raise ConfigError(f"reward function {name!r}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"reward function {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"reward function {name!r}: {path!r} is not callable")
    return obj


def response_text(meta: dict[str, Any]) -> str:
    """The decoded response of a text reward; the error says how to provide it."""
    text = meta.get("response_text")
    if not isinstance(text, str):
        raise ValueError("this reward needs the decoded response in meta['response_text']: put it there "
                         "in the workflow, or start RewardService(detokenize='pkg.mod:decode')")
    return text


def __getattr__(name: str) -> Any:
    # the service pulls in asyncio/multiprocessing; reward workers do not need it
    if name in ("RewardService", "RewardOutcome"):
        from megarl.rewards import service

        return getattr(service, name)
    raise AttributeError(f"module 'megarl.rewards' has no attribute {name!r}")
