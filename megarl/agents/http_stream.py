"""``stream: true`` on the agent endpoint (http_server.py): a completion sent as server-sent events.

The completion is generated and recorded exactly as a plain one (the same
call of the episode's client); only its delivery differs. It goes out once it
is complete, as OpenAI ``chat.completion.chunk`` events: the role and the
content, then the tool calls with the finish reason, then (with
``stream_options.include_usage``) a chunk without choices holding the usage,
then ``data: [DONE]``. An error before the first chunk is an ordinary JSON
error response, so a failed streamed completion looks like a failed plain one.
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web


def completion_chunks(completion: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """The chunks of ``completion`` (a ``chat.completion`` object as JSON)."""
    choice = completion["choices"][0]
    message = choice["message"]
    base = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"], "system_fingerprint": completion.get("system_fingerprint")}
    if include_usage:  # as OpenAI sends it: null on every chunk but the last
        base["usage"] = None
    calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or ())]
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": message.get("content") or ""},
                                    "logprobs": None, "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": {"tool_calls": calls} if calls else {}, "logprobs": None,
                                    "finish_reason": choice["finish_reason"]}]}]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return chunks


async def send_streamed(request: web.Request, completion: dict[str, Any], include_usage: bool) -> web.StreamResponse:
    """Answer ``request`` with ``completion`` as server-sent events."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in completion_chunks(completion, include_usage):
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
