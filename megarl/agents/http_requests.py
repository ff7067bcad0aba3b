"""Checks of one OpenAI chat-completions request body (http_server.py): what megarl can honour, and one clear
error naming what is wrong otherwise.

megarl trains on the distribution the engine samples from, so a request may
lower ``max_tokens`` and add ``stop`` strings that are single tokens of the
model's vocabulary (the stop token stays in the content, as the engine
returns it), but not change the distribution (``temperature`` and ``top_p``
must be the run's; penalties and ``logit_bias`` are refused), ask for several
choices, or force a tool (``tool_choice`` other than ``auto``). ``stream`` and
``stream_options.include_usage`` are honoured (http_stream.py). Any ``model``
name is served by the run's policy (an agent written for another endpoint
sends its own), unless ``agent.strict_model_name`` asks for the one served
(``GET /v1/models``; 404 otherwise, as OpenAI answers); ``max_tokens`` is at
most the episode's token budget (``agent.max_tokens``, by default the model's
context); below that, the run's ``rollout.max_new_tokens`` caps it. Every field is checked for its type and
shape before anything uses it.
"""
from __future__ import annotations

from typing import Any

from megarl.agents.client import INVALID_TOOL

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request megarl refuses (HTTP ``status``, 400 by default); ``code`` is the OpenAI error code."""

    def __init__(self, message: str, code: str = "invalid_request", status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def completion_kwargs(body: Any, tokenizer: Any, *, model: str, max_tokens: int,
                      strict_model_name: bool = False) -> tuple[dict[str, Any], list[int]]:
    """The keyword arguments of ``AgentClient.chat.completions.create`` for ``body``, and its stop token ids;
    ``model`` is the served model's id, ``max_tokens`` the episode's token budget; ``strict_model_name``
    (agent.strict_model_name) refuses a request naming another model."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_model(body.get("model"), model, strict_model_name)
    n = body.get("n")
    if n is not None and not _positive_int(n):
        raise RequestError(f"n={n!r:.40} must be a positive integer (megarl returns one choice: n=1)", "invalid_n")
    if n not in (None, 1):
        raise RequestError(f"n={n}: megarl's endpoint returns one choice per request (n=1)", "invalid_n")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise RequestError(f"{key}={body[key]}: megarl trains on the distribution the engine samples from; "
                               f"penalties would change it")
    if body.get("logit_bias"):
        raise RequestError("logit_bias would change the distribution megarl trains on; leave it out")
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto"):
        raise RequestError(f"tool_choice={choice!r} is not supported: the model chooses whether to call a tool "
                           f"(tool_choice='auto')")
    kwargs: dict[str, Any] = {"messages": _messages(body.get("messages"), {t["function"]["name"] for t in tools}),
                              "tools": tools or None}
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            if not isinstance(body[key], (int, float)) or isinstance(body[key], bool):
                raise RequestError(f"{key} must be a number, got {body[key]!r}")
            kwargs[key] = body[key]
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None:
            if not _positive_int(value):
                raise RequestError(f"{key} must be a positive integer, got {value!r:.40}", "invalid_max_tokens")
            if value > max_tokens:
                raise RequestError(f"{key}={value} is more than this episode's token budget of {max_tokens} "
                                   f"(agent.max_tokens, at most the model's context; prompt and turns included)",
                                   "invalid_max_tokens")
            kwargs["max_tokens"] = min(value, kwargs.get("max_tokens", value))
    return kwargs, _stop_ids(body.get("stop"), tokenizer)


def stream_mode(body: dict[str, Any]) -> tuple[bool, bool]:
    """Whether the completion is streamed (``stream``) and its last chunk reports the usage
    (``stream_options.include_usage``)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r:.80}", "invalid_stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise RequestError("stream_options is only allowed with stream=true", "invalid_stream")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(f"stream_options must be {{'include_usage': true or false}}, got {options!r:.200}",
                           "invalid_stream")
    return True, options.get("include_usage", False)


def _check_model(asked: Any, served: str, strict: bool) -> None:
    """Any model name is served by the run's policy; with ``strict`` only the served one."""
    if asked is None:
        return
    if not isinstance(asked, str):
        raise RequestError(f"model must be text, got {asked!r:.100} (any name is served by the run's policy)",
                           "invalid_model")
    if strict and asked != served:
        raise RequestError(f"the model {asked!r:.100} is not served here; megarl serves {served!r} "
                           f"(GET /v1/models): send model={served!r}, or set agent.strict_model_name=false to serve "
                           f"any name", "model_not_found", 404)


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {'type': 'function', 'function': {...}} objects", "invalid_tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                               f"...}}}}, got {t!r:.200}", "invalid_tools")
    return tools


def _messages(messages: Any, tool_names: set[str]) -> list[dict]:
    """The messages as the chat template takes them (text content, no null fields); every tool call names a
    tool of the request and every tool result answers a call made before it."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role', 'content'} objects", "invalid_messages")
    out, call_ids = [], set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}, got "
                               f"{m!r:.200}", "invalid_messages")
        m = {k: v for k, v in m.items() if v is not None}
        m["content"] = _text(m.get("content", ""), i)
        if not isinstance(m.get("tool_calls", []), list):
            raise RequestError(f"messages[{i}].tool_calls must be a list of tool calls, got "
                               f"{m['tool_calls']!r:.200}", "invalid_messages")
        for key in ("tool_call_id", "name"):
            if not isinstance(m.get(key, ""), str):
                raise RequestError(f"messages[{i}].{key} must be text, got {m[key]!r:.200}", "invalid_messages")
        for j, call in enumerate(m.get("tool_calls") or ()):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments", ""), str) or not isinstance(call.get("id", ""), str):
                raise RequestError(f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', 'function': "
                                   f"{{'name', 'arguments': <JSON text>}}}}, got {call!r:.200}", "invalid_messages")
            if fn["name"] not in tool_names and fn["name"] != INVALID_TOOL:
                raise RequestError(f"messages[{i}].tool_calls[{j}] calls {fn['name']!r}, which is not among the "
                                   f"request's tools ({', '.join(sorted(tool_names)) or 'none'})", "unknown_tool")
            call_ids.add(call.get("id"))
        if m["role"] == "tool" and "tool_call_id" in m and m["tool_call_id"] not in call_ids:
            raise RequestError(f"messages[{i}] answers tool_call_id {m['tool_call_id']!r}, which no earlier "
                               f"assistant message called", "unknown_tool_call")
        out.append(m)
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{i}].content must be text (a string or a list of text parts), got {content!r:.200}",
                       "invalid_messages")


def _stop_ids(stop: Any, tokenizer: Any) -> list[int]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a string or a list of strings, got {stop!r:.200}")
    ids = []
    for s in stops:
        enc = tokenizer.hf.encode(s, add_special_tokens=False)
        if len(enc) != 1:
            raise RequestError(f"stop={s!r} is {len(enc)} tokens of the model's vocabulary; megarl stops on single "
                               f"tokens (the engine keeps the token ids it sampled), so use a stop string that is one "
                               f"token", "unsupported_stop")
        ids.append(enc[0])
    return ids
