"""Tool calls in a model's text, in the Hermes / Qwen3 format.

A call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

vLLM ships a parser for this format (``hermes``), but on a malformed call it
logs and hands the whole text back as content: an agent could not tell the
model it made a mistake, and the run could not count it. This one returns the
malformed calls with the reason, so the turn gets a tool error message back.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


@dataclass
class ParsedCall:
    """One ``<tool_call>`` block: a well-formed call (``name``, ``arguments`` as a JSON string) or an error."""

    id: str
    name: str | None = None
    arguments: str | None = None
    error: str | None = None
    raw: str = ""


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def malformed(self) -> list[ParsedCall]:
        return [c for c in self.calls if c.error is not None]


def parse_tool_calls(text: str) -> ParsedOutput:
    """Content before the first ``<tool_call>``, and every call block after it (well-formed or not)."""
    start = text.find(START)
    if start < 0:
        return ParsedOutput(content=text)
    calls = []
    for m in _CALL.finditer(text, start):
        raw = m.group(1).strip()
        call = ParsedCall(id=f"call_{uuid.uuid4().hex[:12]}", raw=raw)
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            call.error = f"tool call is not valid JSON ({e.msg} at column {e.colno}): {raw[:200]!r}"
        else:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                call.error = f'tool call must be an object {{"name": str, "arguments": object}}, got {raw[:200]!r}'
            elif not isinstance(obj.get("arguments", {}), (dict, str)):
                call.error = f"tool call arguments must be an object, got {type(obj['arguments']).__name__}"
            else:
                args = obj.get("arguments", {})
                call.name = obj["name"]
                call.arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(call)
    return ParsedOutput(content=text[:start].rstrip("\n"), calls=calls)
