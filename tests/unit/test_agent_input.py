"""Bad input at the agent endpoint is the agent's mistake, not the episode's failure: a 4xx naming what is
wrong, no turn of agent.max_turns used, ``Session.error`` untouched; no answer tells one key holder anything
about other sessions; a body that never finishes arriving ends at agent.timeout_s.

The engine is test_agents.py's scripted stand-in; server, client, tokenizer
and the openai package are the real ones (test_agent_http.py has the rest of
the endpoint).
"""
import asyncio
import time

import aiohttp
import openai
import pytest
from test_agent_http import api, serving
from test_agents import client_for

USER = [{"role": "user", "content": "hi"}]


def test_malformed_fields_get_a_4xx_use_no_turn_and_leave_the_episode_going(text_tokenizer):
    client, traj, model = client_for(text_tokenizer, ["fine"], max_turns=1, max_tokens=1024)
    assistant = {"role": "assistant", "content": ""}
    bad = {  # the JSON body's fields, sent as they are
        "tool_calls not a list": ({"messages": [*USER, {**assistant, "tool_calls": 5}]}, 400, "invalid_messages"),
        "a tool call not an object": ({"messages": [*USER, {**assistant, "tool_calls": [7]}]}, 400,
                                      "invalid_messages"),
        "tool call id not text": ({"messages": [*USER, {**assistant, "tool_calls": [
            {"id": ["x"], "type": "function", "function": {"name": "invalid_tool_call", "arguments": "{}"}}]}]},
            400, "invalid_messages"),
        "tool_call_id not text": ({"messages": [*USER, {"role": "tool", "tool_call_id": {"a": 1}, "content": "3"}]},
                                  400, "invalid_messages"),
        "name not text": ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, 400, "invalid_messages"),
        "n true": ({"messages": USER, "n": True}, 400, "invalid_n"),
        "n zero": ({"messages": USER, "n": 0}, 400, "invalid_n"),
        "n two": ({"messages": USER, "n": 2}, 400, "invalid_n"),
        "model not text": ({"model": 3, "messages": USER}, 400, "invalid_model"),
        "max_tokens past the context": ({"messages": USER, "max_tokens": 10**12}, 400, "invalid_max_tokens"),
        "max_tokens past agent.max_tokens": ({"messages": USER, "max_completion_tokens": 1025}, 400,
                                             "invalid_max_tokens"),
        "temperature of another distribution": ({"messages": USER, "temperature": 0.5}, 400, "invalid_request"),
    }

    async def main(server):
        session = server.open_session(client, timeout_s=30.0)
        got = {}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {session.key}"}) as http:
            for what, (body, _, _) in bad.items():
                async with http.post(server.base_url + "/chat/completions", json={"model": "tiny", **body}) as r:
                    got[what] = (r.status, (await r.json())["error"])
        async with api(server, session.key) as oa:  # agent.max_turns=1: the one turn is still there
            ok = await oa.chat.completions.create(model="tiny", messages=USER, max_tokens=1024)
        return got, ok, session

    got, ok, session = asyncio.run(serving(main))
    assert {k: (status, e["code"]) for k, (status, e) in got.items()} == {k: v[1:] for k, v in bad.items()}
    assert "tool_calls must be a list" in got["tool_calls not a list"][1]["message"]
    assert "n=True" in got["n true"][1]["message"] and "positive integer" in got["n true"][1]["message"]
    assert "model must be text, got 3" in got["model not text"][1]["message"]
    assert "1024" in got["max_tokens past agent.max_tokens"][1]["message"]
    assert ok.choices[0].message.content == "fine" and session.error is None
    assert client.stats.n_turns == 1 and len(model.contexts) == 1 and len(client.records) == 1


def test_a_body_over_the_limit_gets_413_and_the_episode_goes_on(text_tokenizer):
    client, _, model = client_for(text_tokenizer, ["fine"], max_turns=1)

    async def main(server):
        session = server.open_session(client, timeout_s=30.0)
        body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (64 << 20) + b'"}]}'
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {session.key}",
                                                  "Content-Type": "application/json"}) as http:
            async with http.post(server.base_url + "/chat/completions", data=body) as r:
                status, error = r.status, (await r.json())["error"]
        async with api(server, session.key) as oa:
            ok = await oa.chat.completions.create(model="tiny", messages=USER)
        return status, error, ok, session

    status, error, ok, session = asyncio.run(serving(main))
    assert (status, error["code"]) == (413, "request_too_large") and "64 MiB" in error["message"]
    assert ok.choices[0].message.content == "fine" and session.error is None and len(model.contexts) == 1


def test_the_finished_key_answer_reveals_nothing_about_other_keys(text_tokenizer):
    clients = [client_for(text_tokenizer, ["a"])[0] for _ in range(3)]

    async def main(server):
        sessions = [server.open_session(c, timeout_s=30.0) for c in clients]
        await server.close_session(sessions[1])
        codes = {}
        forged = [f"megarl-{n}-{'x' * 32}" for n in range(4)] + ["megarl-" + "y" * 32, sessions[0].key + "z"]
        for name, key in [("closed", sessions[1].key), *((f"forged {k}", k) for k in forged)]:
            async with api(server, key) as oa:
                with pytest.raises(openai.AuthenticationError) as e:
                    await oa.models.list()
                codes[name] = e.value.code
        return codes, [s.key for s in sessions]

    codes, keys = asyncio.run(serving(main))
    assert codes.pop("closed") == "session_finished"
    assert set(codes.values()) == {"invalid_api_key"}, codes
    assert not any(str(i) in key.split("-")[1] for i, key in enumerate(keys) if key.count("-") >= 2 and
                   key.split("-")[1].isdigit()), f"keys count the sessions issued: {keys}"


def test_a_body_that_stops_arriving_ends_at_agent_timeout_s_and_the_session_closes(text_tokenizer):
    client, _, model = client_for(text_tokenizer, ["a"])
    timeout_s = 0.5

    async def main(server):
        session = server.open_session(client, timeout_s=timeout_s)
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + session.key.encode() + b"\r\nContent-Length: 1000\r\n\r\n"
                     b'{"model": "tiny", "mess')  # and then nothing: the key holder keeps the socket open
        await writer.drain()
        for _ in range(200):  # until the server is reading this request's body
            await asyncio.sleep(0.01)
            if session.busy:
                break
        t0 = time.monotonic()
        await asyncio.wait_for(server.close_session(session), timeout_s + 5)
        closed_after = time.monotonic() - t0
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        await writer.wait_closed()
        return closed_after, status_line, session

    closed_after, status_line, session = asyncio.run(serving(main))
    assert closed_after < timeout_s + 1.0
    assert status_line.startswith(b"HTTP/1.1 408"), status_line
    assert session.error is None and model.contexts == []


def test_closing_waits_for_a_running_completion_at_most_agent_timeout_s(text_tokenizer):
    from test_agent_http import BlockingModel
    from test_agents import SAMPLING

    from megarl.agents.client import AgentClient, AgentLimits
    from megarl.types import Trajectory

    model = BlockingModel(text_tokenizer, ["a"])
    traj = Trajectory("g0-0", "g0", [1], meta={"row": {}}, logp_old=[])
    client = AgentClient(traj, model, text_tokenizer, None, AgentLimits(SAMPLING, max_turns=8, max_tokens=1024))

    async def main(server):
        model.started, model.release = asyncio.Event(), asyncio.Event()
        session = server.open_session(client, timeout_s=0.3)
        async with api(server, session.key) as oa:
            running = asyncio.create_task(oa.chat.completions.create(model="tiny", messages=USER))
            await model.started.wait()
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(server.close_session(session), 5)
                closed_after = time.monotonic() - t0
            finally:
                model.release.set()  # the engine finishes later: the completion is still recorded whole
            reply = await running
        return closed_after, session, reply

    closed_after, session, reply = asyncio.run(serving(main))
    assert 0.25 < closed_after < 1.5
    assert "still running agent.timeout_s=0.3s after the episode ended" in session.error
    assert reply.choices[0].message.content == "a" and len(client.records) == 1
