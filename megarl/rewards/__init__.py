"""Verifiable rewards, addressed by name, scored off the critical path.

A reward function reads text::

    def my_reward(response: str, answer, **info) -> float

``response`` is the decoded response (special tokens such as EOS skipped),
``answer`` the row's ground truth (``data.answer_key``). ``info`` holds
``prompt`` (the decoded prompt, as the model saw it), ``row`` (every other
field of the data row), ``finish_reason`` (``"stop"`` when the response ended
on a stop token, ``"length"`` when it ran out of tokens), ``response_ids``
and ``prompt_ids``. A function receives only the ``info`` keys it names,
or all of them when it takes ``**info``.

It is named by a built-in name (:data:`BUILTIN_REWARDS`) or a dotted path
``"pkg.mod:func"`` / ``"pkg.mod.func"``; :func:`resolve_reward_fn` imports it
and checks its signature at startup, so a typo fails before the run, not at step 1.

:class:`RewardService` (in ``service.py``) runs the chosen function in a pool
of worker processes with time and memory limits.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping

from megarl.errors import ConfigError

RewardFn = Callable[..., float]

#: what ``info`` holds (module docstring)
REWARD_INFO_KEYS = ("prompt", "row", "finish_reason", "response_ids", "prompt_ids")

# built-in name -> dotted path; the workers resolve the same path.
BUILTIN_REWARDS: dict[str, str] = {
    "reverse_digits": "megarl.tasks.reverse_digits:reward",
    "digits": "megarl.rewards.digits:digit_reward",
    "math": "megarl.rewards.math:math_reward",
    "math_strict": "megarl.rewards.math:math_strict_reward",
    "code": "megarl.rewards.code:code_reward",
}


def register_reward(name: str, path: str) -> None:
    """Add a built-in name for the function at dotted ``path`` (duplicates are refused)."""
    if name in BUILTIN_REWARDS:
        raise ConfigError(f"reward {name!r} is already registered as {BUILTIN_REWARDS[name]!r}")
    BUILTIN_REWARDS[name] = path


def _split_path(path: str, what: str = "reward function", builtins: Mapping[str, str] | None = None) -> tuple[str, str]:
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        names = sorted(BUILTIN_REWARDS if builtins is None else builtins)
        raise ConfigError(f"{what} {path!r} is neither a built-in ({names}) "
                          f"nor a dotted path 'pkg.mod:func' / 'pkg.mod.func'")
    return module, attr


def resolve_reward_fn(name: str, what: str = "reward function",
                      builtins: Mapping[str, str] | None = None) -> Callable[..., Any]:
    """The callable named by a built-in name (of ``builtins``, default the built-in rewards) or a dotted path;
    ConfigError (naming it as ``what``) if it cannot be loaded."""
    builtins = BUILTIN_REWARDS if builtins is None else builtins
    path = builtins.get(name, name)
    module_name, attr = _split_path(path, what, builtins)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure of user code is a config problem
        raise ConfigError(f"{what} {name!r}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what} {name!r}: {path!r} is not callable")
    return obj


def reward_kwargs(fn: Callable[..., Any], name: str) -> tuple[str, ...] | None:
    """The ``info`` keys ``fn`` takes (None: all of them, through ``**info``); ConfigError for a bad signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing extra
        return ()
    params = list(sig.parameters.values())
    takes = None if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) else tuple(
        p.name for p in params[2:]
        if p.name in REWARD_INFO_KEYS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    try:
        sig.bind("response", "answer", **{k: None for k in (REWARD_INFO_KEYS if takes is None else takes)})
    except TypeError:
        raise ConfigError(f"reward function {name!r} has signature {sig}; it must take (response: str, answer, "
                          f"**info) -> float, where info keys are {list(REWARD_INFO_KEYS)} "
                          f"(megarl.rewards docstring)") from None
    return takes
