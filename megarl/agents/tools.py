"""Tools an agent may call: Python code execution in the sandbox, and user functions by dotted path.

A tool is a plain function ``fn(**arguments) -> str`` named in ``agent.tools``
by a built-in name (:data:`BUILTIN_TOOLS`) or a dotted path ``pkg.mod:fn``. Its
OpenAI-style schema (what the chat template shows the model) comes from the
signature: parameter names, ``int``/``float``/``str``/``bool`` annotations,
required = no default, and the docstring's first paragraph as the description.

Every call runs in a worker process (megarl/workers/pool.py) with
``agent.tool_timeout_s`` and ``agent.tool_memory_mb``: a tool that raises,
hangs, allocates without bound or kills its process returns an error message
to the model instead of stopping the run, and is counted. A call with an
unknown tool name or arguments that do not fit the signature gets an error
message too. The ``python`` tool runs the code in the same sandbox as the code
reward (megarl/rewards/code.py: its own subprocess, resource limits, no network).
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable

from megarl.errors import ConfigError
from megarl.rewards import resolve_reward_fn
from megarl.workers.pool import WorkerPool

#: longest tool result handed back to the model (characters)
MAX_RESULT_CHARS = 4000

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def python(code: str) -> str:
    """Run Python code and return what it printed.

    It runs in a sandbox: no network, a time and a memory limit; print the values you need.
    """
    from megarl.rewards.code import run_python

    return run_python(code)


BUILTIN_TOOLS: dict[str, str] = {"python": "megarl.agents.tools:python"}


def tool_schema(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI function-tool schema of ``fn``; ConfigError for parameters it cannot describe."""
    props: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ConfigError(f"tool {name!r}: parameter {p.name!r} must be a plain named parameter "
                              f"(tools are called with keyword arguments from JSON)")
        ann = p.annotation
        if isinstance(ann, str):  # `from __future__ import annotations`
            ann = {"int": int, "float": float, "str": str, "bool": bool}.get(ann, ann)
        if ann not in _JSON_TYPES:
            raise ConfigError(f"tool {name!r}: parameter {p.name!r} needs an int, float, str or bool annotation "
                              f"(got {ann!r})")
        props[p.name] = {"type": _JSON_TYPES[ann]}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    doc = inspect.getdoc(fn) or f"The {name} tool."
    return {"type": "function", "function": {"name": name, "description": doc.split("\n\n")[0].replace("\n", " "),
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


@dataclass
class ToolResult:
    content: str
    #: why the call failed (unknown tool, bad arguments, raised, timed out, out of memory), or None
    error: str | None = None


class ToolService:
    """The configured tools: their schemas (for the chat template) and ``await call(name, arguments_json)``."""

    def __init__(self, names: list[str], *, timeout_s: float = 10.0, memory_mb: int = 512, n_workers: int = 1) -> None:
        paths: dict[str, str] = {}
        self.schemas: list[dict[str, Any]] = []
        self._signatures: dict[str, inspect.Signature] = {}
        for entry in names:
            path = BUILTIN_TOOLS.get(entry, entry)
            fn = resolve_reward_fn(path)  # dotted-path loading with clear errors
            name = entry if entry in BUILTIN_TOOLS else path.replace(":", ".").rsplit(".", 1)[-1]
            if name in paths:
                raise ConfigError(f"agent.tools names two tools {name!r} ({paths[name]} and {path})")
            schema = tool_schema(name, fn)
            paths[name] = path
            self.schemas.append(schema)
            self._signatures[name] = inspect.signature(fn)
        self.timeout_s = timeout_s
        self._pool = WorkerPool("tool", paths, n_workers=n_workers, timeout_s=timeout_s, memory_mb=memory_mb,
                                label="ToolService") if paths else None

    @property
    def names(self) -> list[str]:
        return list(self._signatures)

    async def call(self, name: str | None, arguments: str | None) -> ToolResult:
        """Run one call; the result (or the error) is what goes back to the model."""
        if name not in self._signatures:
            return self._error(f"unknown tool {name!r}; available: {', '.join(self.names) or 'none'}")
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            return self._error(f"arguments of {name} are not valid JSON: {e.msg}")
        if not isinstance(args, dict):
            return self._error(f"arguments of {name} must be a JSON object")
        try:
            self._signatures[name].bind(**args)
        except TypeError as e:
            return self._error(f"bad arguments for {name}: {e}")
        kind, value = await self._pool.call((name, args))
        if kind == "ok":
            return ToolResult(_truncate(str(value)))
        return self._error(f"tool {name} failed ({kind}): {value}")

    @staticmethod
    def _error(message: str) -> ToolResult:
        return ToolResult(f"Error: {message}", error=message)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def _truncate(text: str) -> str:
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[:MAX_RESULT_CHARS] + f"\n[... {len(text) - MAX_RESULT_CHARS} more characters]"
