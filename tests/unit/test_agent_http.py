"""The OpenAI-compatible agent endpoint, driven by the real openai package, and the agent_http command runner.

As in test_agents.py the engine is a scripted stand-in for the controller's
generate function; tokenizer, chat template, server and client are the real
ones. An HTTP agent must be recorded exactly as the in-process client records
the same conversation.
"""
import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import openai
import pytest
from test_agents import SAMPLING, ScriptedModel, client_for

from megarl.agents.client import AgentClient, AgentLimits
from megarl.agents.http_server import AgentHttpServer
from megarl.types import Trajectory
from megarl.workflows.agent import check_token_exact
from megarl.workflows.agent_http import (
    AgentCommandError,
    AgentHttpWorkflow,
    CommandLimits,
    parse_answer,
    run_command,
)

ROOT = Path(__file__).resolve().parents[2]
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


async def serving(fn):
    """``await fn(server)`` with an endpoint listening on a free port of 127.0.0.1."""
    server = AgentHttpServer("127.0.0.1", 0, model="tiny")
    await server.start()
    try:
        return await fn(server)
    finally:
        await server.stop()


def api(server, key, **kw):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=key, **kw)


async def two_turns(create, assistant_dict):
    """The same agent for both paths: a tool call, its result, an answer."""
    messages = [{"role": "user", "content": "add 1 and 2"}]
    r = await create(messages=messages, tools=[ADD])
    msg = r.choices[0].message
    messages.append(assistant_dict(msg))
    messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "3"})
    r2 = await create(messages=messages, tools=[ADD])
    return r, r2


def test_http_records_exactly_what_the_in_process_client_records(text_tokenizer):
    here, traj_here, _ = client_for(text_tokenizer, [CALL, "3"])
    asyncio.run(two_turns(here.chat.completions.create, lambda m: m.model_dump(exclude_none=True)))
    there, traj_there, model = client_for(text_tokenizer, [CALL, "3"])

    async def over_http(server):
        session = server.open_session(there)
        async with api(server, session.key) as oa:
            models = await oa.models.list()
            create = lambda **kw: oa.chat.completions.create(model="tiny", **kw)  # noqa: E731
            return models, await two_turns(create, lambda m: m)  # the openai message object, sent back as is

    models, (r1, r2) = asyncio.run(serving(over_http))
    assert [m.id for m in models.data] == ["tiny"]
    assert r1.choices[0].finish_reason == "tool_calls" and r1.choices[0].message.tool_calls[0].function.name == "add"
    assert json.loads(r1.choices[0].message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    assert r2.choices[0].message.content == "3" and r2.usage.completion_tokens == 2  # "3" and EOS
    assert [(r.prompt_ids, r.output_ids, r.versions) for r in there.records] == \
           [(r.prompt_ids, r.output_ids, r.versions) for r in here.records]
    assert (traj_there.tokens, traj_there.loss_mask, traj_there.versions) == \
           (traj_here.tokens, traj_here.loss_mask, traj_here.versions)
    assert traj_there.parts == [] and traj_there.policy_versions() == {3, 4}
    assert there.stats.n_tool_calls == 1
    check_token_exact(traj_there, there.records)
    assert model.contexts[1] == traj_there.tokens[:len(model.contexts[1])]


async def streamed(oa, **kw):
    """One completion with stream=True, as its chunks and the message they add up to."""
    chunks = [c async for c in await oa.chat.completions.create(model="tiny", stream=True, **kw)]
    content, calls = "", {}
    for c in chunks:
        for choice in c.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                calls[call.index] = {"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": call.function.arguments}}
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return chunks, message


def test_a_streamed_completion_is_recorded_exactly_as_a_plain_one(text_tokenizer):
    here, traj_here, _ = client_for(text_tokenizer, [CALL, "3"])
    asyncio.run(two_turns(here.chat.completions.create, lambda m: m.model_dump(exclude_none=True)))
    there, traj_there, _ = client_for(text_tokenizer, [CALL, "3"])
    seen = []

    async def over_http(server):
        async def create(**kw):  # what two_turns reads of a response: the tool calls' ids; and the message
            chunks, message = await streamed(oa, stream_options={"include_usage": True}, **kw)
            seen.append(chunks)
            return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(
                tool_calls=[SimpleNamespace(id=c["id"]) for c in message.get("tool_calls", ())], sent=message))])

        session = server.open_session(there)
        async with aiohttp.ClientSession() as http:
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}
            async with http.post(server.base_url + "/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {session.key}"}) as r:
                bad = r.status, (await r.json())["error"]["code"]
        async with api(server, session.key) as oa:
            turns = await two_turns(create, lambda m: m.sent)  # the message the chunks add up to, sent back
        return bad, turns

    bad, (r1, r2) = asyncio.run(serving(over_http))
    m1, m2 = r1.choices[0].message.sent, r2.choices[0].message.sent
    assert bad == (400, "invalid_stream")
    assert m1["content"] == "" and m1["tool_calls"][0]["function"]["name"] == "add"
    assert json.loads(m1["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert m2 == {"role": "assistant", "content": "3"}
    first, second = seen
    assert [c.object for c in second] == ["chat.completion.chunk"] * 3 and len({c.id for c in second}) == 1
    assert [c.choices[0].finish_reason if c.choices else None for c in first] == [None, "tool_calls", None]
    assert second[-1].choices == [] and second[-1].usage.completion_tokens == 2  # "3" and EOS
    assert [(r.prompt_ids, r.output_ids, r.versions) for r in there.records] == \
           [(r.prompt_ids, r.output_ids, r.versions) for r in here.records]
    assert (traj_there.tokens, traj_there.loss_mask, traj_there.versions) == \
           (traj_here.tokens, traj_here.loss_mask, traj_here.versions)


def test_keys_no_key_unknown_key_and_finished_key_get_401(text_tokenizer):
    client, _, model = client_for(text_tokenizer, ["a"])

    async def main(server):
        session = server.open_session(client)
        async with aiohttp.ClientSession() as http:
            async with http.post(server.base_url + "/chat/completions", json={"messages": []}) as r:
                no_key = (r.status, (await r.json())["error"]["code"], r.headers["x-should-retry"])
            async with http.post(server.base_url + "/completions", json={}) as r:
                not_served = [(r.status, (await r.json())["error"]["code"])]
            async with http.post(server.base_url[:-len("/v1")] + "/sessions", json={}) as r:  # no agent.serve
                not_served.append((r.status, (await r.json())["error"]["code"]))
        async with api(server, "megarl-not-a-key") as oa:
            with pytest.raises(openai.AuthenticationError) as unknown:
                await oa.models.list()
        async with api(server, session.key) as oa:
            await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
            await server.close_session(session)
            with pytest.raises(openai.AuthenticationError) as finished:
                await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        return no_key, not_served, unknown.value, finished.value

    no_key, not_served, unknown, finished = asyncio.run(serving(main))
    assert no_key == (401, "missing_api_key", "false")  # the openai package must not resend it
    assert not_served == [(404, "not_found")] * 2
    assert unknown.status_code == 401 and unknown.code == "invalid_api_key"
    assert finished.status_code == 401 and finished.code == "session_finished"
    assert len(model.contexts) == 1  # the refused request never reached the engine


class BlockingModel(ScriptedModel):
    async def __call__(self, context, sampling, into):
        self.started.set()
        await self.release.wait()
        return await super().__call__(context, sampling, into)


def test_a_second_completion_while_one_runs_gets_409(text_tokenizer):
    model = BlockingModel(text_tokenizer, ["a", "b"])
    traj = Trajectory("g0-0", "g0", [1], meta={"row": {}}, logp_old=[])
    client = AgentClient(traj, model, text_tokenizer, None, AgentLimits(SAMPLING, max_turns=8, max_tokens=1024))
    msgs = [{"role": "user", "content": "hi"}]

    async def main(server):
        model.started, model.release = asyncio.Event(), asyncio.Event()
        session = server.open_session(client)
        async with api(server, session.key) as oa:  # the package's default retries stay on
            first = asyncio.create_task(oa.chat.completions.create(model="tiny", messages=msgs))
            await model.started.wait()
            with pytest.raises(openai.ConflictError) as second:
                await oa.chat.completions.create(model="tiny", messages=msgs)
            model.release.set()
            return (await first).choices[0].message.content, second.value

    first, second = asyncio.run(serving(main))
    assert first == "a" and second.status_code == 409 and second.code == "concurrent_completion"
    assert len(model.contexts) == 1 and len(client.records) == 1


def test_a_completion_whose_body_is_still_arriving_already_holds_the_session(text_tokenizer):
    client, _, model = client_for(text_tokenizer, ["a", "b"])

    async def main(server):
        session, release = server.open_session(client), asyncio.Event()

        async def slow_body():
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]'
            await release.wait()
            yield b"}"

        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {session.key}"}) as http:
            first = asyncio.create_task(http.post(server.base_url + "/chat/completions", data=slow_body()))
            for _ in range(200):  # until the server reads the first request's body
                await asyncio.sleep(0.01)
                if session.busy:
                    break
            async with api(server, session.key) as oa:
                with pytest.raises(openai.ConflictError) as second:
                    await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
            release.set()
            async with await first as r:
                return r.status, second.value.code

    assert asyncio.run(serving(main)) == (200, "concurrent_completion")
    assert len(model.contexts) == 1


def test_bad_requests_get_400_and_the_session_goes_on(text_tokenizer):
    client, traj, model = client_for(text_tokenizer, ["fine"])
    user = [{"role": "user", "content": "hi"}]
    bad = {
        "invalid_messages": dict(messages=[{"content": "no role"}]),
        "invalid_tools": dict(messages=user, tools=[{"type": "function", "function": {}}]),
        "unknown_tool": dict(messages=[*user, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "nope", "arguments": "{}"}}]}], tools=[ADD]),
        "unknown_tool_call": dict(messages=[*user, {"role": "tool", "tool_call_id": "c9", "content": "3"}]),
        "unsupported_stop": dict(messages=user, stop=["two tokens"]),
    }

    async def main(server):
        session = server.open_session(client)
        out = {}
        async with api(server, session.key) as oa:
            for code, kw in bad.items():
                with pytest.raises(openai.BadRequestError) as e:
                    await oa.chat.completions.create(model="tiny", **kw)
                out[code] = e.value
            with pytest.raises(openai.BadRequestError) as temp:
                await oa.chat.completions.create(model="tiny", messages=user, temperature=0.5)
            ok = await oa.chat.completions.create(model="tiny", messages=user, stop="\n", max_tokens=5)
        return out, temp.value, ok, session

    out, temp, ok, session = asyncio.run(serving(main))
    assert {code: (e.status_code, e.code) for code, e in out.items()} == {c: (400, c) for c in bad}
    assert "'nope', which is not among the request's tools (add)" in out["unknown_tool"].message
    assert "differs from the run's rollout.temperature=1.0" in temp.message
    assert ok.choices[0].message.content == "fine" and session.error is None
    assert len(model.contexts) == 1 and len(client.records) == 1 and traj.n_policy_tokens == 5  # "fine" and EOS
    assert client.limits.sampling.stop_token_ids == SAMPLING.stop_token_ids  # the request's stop was its own


def test_a_completion_past_the_budget_fails_the_episode(text_tokenizer):
    client, _, _ = client_for(text_tokenizer, ["a", "b"], max_turns=1)

    async def main(server):
        session = server.open_session(client)
        async with api(server, session.key) as oa:
            await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(openai.BadRequestError) as e:
                await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        return e.value, session

    e, session = asyncio.run(serving(main))
    assert e.code == "agent_budget_exceeded" and session.error.startswith("AgentLimitError: ")
    assert "more than agent.max_turns=1" in session.error


# -- the command runner ---------------------------------------------------------------------------
def test_parse_answer():
    assert parse_answer("thinking\n\\boxed{7}\n\n") == ("\\boxed{7}", None)
    assert parse_answer('log\n{"reward": 0.5}\n') == ('{"reward": 0.5}', 0.5)
    assert parse_answer('{"answer": 3}') == ('{"answer": 3}', None)
    with pytest.raises(AgentCommandError, match="printed nothing"):
        parse_answer("\n \n")
    with pytest.raises(AgentCommandError, match="must be a finite number, got 'high'"):
        parse_answer('{"reward": "high"}')


def test_run_command_fails_on_exit_status_and_timeout():
    async def main():
        echo = await run_command([sys.executable, "-c", "import json, os, sys; row = json.load(sys.stdin); "
                                  "print(row['q'] * 2, os.environ['OPENAI_API_KEY'])"], {"q": 21},
                                 {"OPENAI_API_KEY": "k1"}, 30.0)
        with pytest.raises(AgentCommandError, match="exited with status 3: broken"):
            await run_command([sys.executable, "-c", "import sys; print('broken', file=sys.stderr); sys.exit(3)"],
                              {}, {}, 30.0)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(AgentCommandError, match=r"past agent.timeout_s=0.5s and was killed"):
            await run_command([sys.executable, "-c", "import time; time.sleep(60)"], {}, {}, 0.5)
        return echo, asyncio.get_running_loop().time() - t0

    echo, waited = asyncio.run(main())
    assert echo == "42 k1\n" and waited < 10


def test_commands_run_under_the_configured_resource_limits():
    limits = CommandLimits(memory_mb=256, cpu_s=1, open_files=64)
    show = ("import resource as r; print([r.getrlimit(k) for k in (r.RLIMIT_AS, r.RLIMIT_CPU, r.RLIMIT_NOFILE, "
            "r.RLIMIT_CORE)])")

    async def main():
        seen = await run_command([sys.executable, "-c", show], {}, {}, 30.0, limits)
        small = await run_command([sys.executable, "-c", "x = bytearray(32 << 20); print(len(x) >> 20)"], {}, {},
                                  30.0, limits)
        with pytest.raises(AgentCommandError, match=r"exited with status 1 \(out of memory: "
                                                    r"agent.command_memory_mb=256 limits its address space\)"):
            await run_command([sys.executable, "-c", "x = bytearray(512 << 20)"], {}, {}, 30.0, limits)
        with pytest.raises(AgentCommandError, match=r"exited with status -24 \(killed by signal 24: past "
                                                    r"agent.command_cpu_s=1\?\)"):
            await run_command([sys.executable, "-c", "while True: pass"], {}, {}, 30.0, limits)
        return seen, small

    seen, small = asyncio.run(main())
    mb = 1 << 20
    assert seen == f"[({256 * mb}, {256 * mb}), (1, 2), (64, 64), (0, 0)]\n" and small == "32\n"


def test_a_command_past_its_memory_limit_fails_its_episode_and_the_next_episode_runs(text_tokenizer):
    # the command allocates what its row asks for
    hungry = [sys.executable, "-c", "import json, sys; x = bytearray(json.load(sys.stdin)['mb'] << 20); "
                                    "print('\\\\boxed{1}')"]
    wf = AgentHttpWorkflow(hungry, text_tokenizer, AgentLimits(SAMPLING, max_turns=1, max_tokens=128),
                           command_limits=CommandLimits(memory_mb=256))

    async def main():
        out = []
        try:
            for j, mb in enumerate((1024, 8)):
                traj = Trajectory(f"g0-{j}", "g0", [1], meta={"row": {"prompt": "p", "mb": mb}}, logp_old=[])
                out.append(await wf.run(traj, ScriptedModel(text_tokenizer, [])))
        finally:
            await wf.aclose()
        return out

    over, within = asyncio.run(main())
    assert over.reward == 0.0 and "out of memory: agent.command_memory_mb=256" in over.meta["agent_error"]
    assert "agent_error" not in within.meta and within.meta["final_response"] == "\\boxed{1}"
    assert wf.stats()["n_agent_failed"] == 1


def test_the_example_agent_runs_as_an_episode_and_failures_cost_the_episode(text_tokenizer):
    limits = AgentLimits(SAMPLING, max_turns=3, max_tokens=2048)
    agent = [sys.executable, str(ROOT / "configs" / "agents" / "calculator_agent.py")]
    good = AgentHttpWorkflow(agent, text_tokenizer, limits, timeout_s=60.0)
    broken = AgentHttpWorkflow([sys.executable, "-c", "raise SystemExit(2)"], text_tokenizer, limits)
    slow = AgentHttpWorkflow([sys.executable, "-c", "import time; time.sleep(60)"], text_tokenizer, limits,
                             timeout_s=1.0)

    async def main():
        out = []
        for wf, outputs in ((good, [CALL, "\\boxed{3}"]), (broken, []), (slow, [])):
            traj = Trajectory("g0-0", "g0", [1], meta={"row": {"prompt": "add 1 and 2"}}, logp_old=[])
            try:
                out.append((await wf.run(traj, ScriptedModel(text_tokenizer, outputs)), wf.stats()))
            finally:
                await wf.aclose()
        return out

    (ok, ok_stats), (fail, fail_stats), (late, late_stats) = asyncio.run(main())
    assert ok.reward is None and ok.meta["final_response"] == "\\boxed{3}" and "agent_error" not in ok.meta
    assert ok_stats == {"n_agent_failed": 0, "n_agent_turns": 2, "n_tool_calls": 1, "n_tool_errors": 0,
                        "n_agent_new_trajectories": 0}
    n_call = len(text_tokenizer.hf.encode(CALL, add_special_tokens=False))  # <tool_call> is one token
    assert '"name": "add"' in text_tokenizer.hf.decode(ok.prompt_ids) and ok.n_policy_tokens == n_call + 1 + 10
    assert fail.reward == 0.0 and fail.meta["agent_error"].startswith("AgentCommandError: agent.command exited "
                                                                      "with status 2")
    assert late.reward == 0.0 and "past agent.timeout_s=1s" in late.meta["agent_error"]
    assert fail_stats["n_agent_failed"] == 1 and late_stats["n_agent_failed"] == 1


def test_agent_http_configuration_is_checked_before_the_run(text_tokenizer):
    from megarl.config.schema import AgentConfig
    from megarl.errors import ConfigError
    from megarl.workflows.agent_checks import check_agent_config

    for agent, match in ((AgentConfig(command=""), "needs agent.command"),
                         (AgentConfig(command="no-such-program --flag"), "program 'no-such-program' is not found"),
                         (AgentConfig(command="python 'unclosed"), "cannot be split into words"),
                         (AgentConfig(command="python agent.py", tools=["python"]), "set agent.tools=\\[\\]")):
        with pytest.raises(ConfigError, match=match):
            check_agent_config(agent, text_tokenizer, http=True)
    check_agent_config(AgentConfig(command=f"{sys.executable} agent.py"), text_tokenizer, http=True)


def test_workflows_on_one_fixed_port_share_one_endpoint(text_tokenizer):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    limits = AgentLimits(SAMPLING, max_turns=1, max_tokens=128)
    train, evaluation = (AgentHttpWorkflow([sys.executable], text_tokenizer, limits, port=port) for _ in range(2))

    async def main():
        await train.start()
        await evaluation.start()
        shared = train.server is evaluation.server and train.server.base_url == f"http://127.0.0.1:{port}/v1"
        await train.aclose()
        async with aiohttp.ClientSession() as http:  # still served for the other workflow
            async with http.get(f"http://127.0.0.1:{port}/v1/models") as r:
                status = r.status
        await evaluation.aclose()
        with socket.socket() as s:  # and now the port is free again
            s.bind(("127.0.0.1", port))
        return shared, status

    assert asyncio.run(main()) == (True, 401)


# -- long-lived agent services ------------------------------------------------------------------
SERVICE_KEY = "s3cret-service-key-0123"


def test_an_agent_service_claims_episodes_and_reports_their_outcomes(text_tokenizer, monkeypatch):
    import megarl.agents.http_service as http_service

    monkeypatch.setattr(http_service, "CLAIM_WAIT_S", 0.3)
    limits = AgentLimits(SAMPLING, max_turns=3, max_tokens=1024)
    wf = AgentHttpWorkflow(None, text_tokenizer, limits, timeout_s=30.0, service_key=SERVICE_KEY)
    late = AgentHttpWorkflow(None, text_tokenizer, limits, timeout_s=0.5, service_key=SERVICE_KEY)

    async def post(http, path, key, body=None):
        async with http.post(wf.server.base_url[:-len("/v1")] + path, json=body or {},
                             headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status, (await r.json() if r.status != 204 else None)

    async def main():
        await wf.start()
        trajs = [Trajectory(f"g0-{j}", "g0", [1], meta={"row": {"prompt": "p", "j": j}}, logp_old=[]) for j in (0, 1)]
        async with aiohttp.ClientSession() as http:
            wrong = await post(http, "/sessions", "not-the-key")
            idle = await post(http, "/sessions", SERVICE_KEY)  # no episode waiting: 204 after the wait
            runs = [asyncio.create_task(wf.run(t, ScriptedModel(text_tokenizer, ["ok"]))) for t in trajs]
            claims = [(await post(http, "/sessions", SERVICE_KEY))[1] for _ in trajs]
            by_row = {c["row"]["j"]: c for c in claims}
            async with openai.AsyncOpenAI(base_url=by_row[0]["base_url"], api_key=by_row[0]["key"]) as oa:
                reply = await oa.chat.completions.create(model=wf.server.model,
                                                         messages=[{"role": "user", "content": "p"}])
            bad = await post(http, f"/sessions/{by_row[0]['key']}/reward", by_row[0]["key"], {"reward": "high"})
            reports = [await post(http, f"/sessions/{by_row[0]['key']}/reward", "", {"reward": 0.75}),
                       await post(http, f"/sessions/{by_row[1]['key']}/reward", "", {"answer": "\\boxed{3}"})]
            await asyncio.gather(*runs)
            again = await post(http, f"/sessions/{by_row[0]['key']}/reward", "", {"reward": 1.0})
        await wf.aclose()
        await late.start()
        timed_out = await late.run(Trajectory("g1-0", "g1", [1], meta={"row": {}}, logp_old=[]),
                                   ScriptedModel(text_tokenizer, []))
        await late.aclose()
        return wrong, idle, reply, bad, reports, again, trajs, timed_out

    wrong, idle, reply, bad, reports, again, (t0, t1), timed_out = asyncio.run(main())
    assert wrong[0] == 401 and idle == (204, None) and reply.choices[0].message.content == "ok"
    assert bad[0] == 400 and bad[1]["error"]["code"] == "invalid_reward"
    assert reports == [(200, {"ok": True})] * 2
    assert again[0] == 401 and again[1]["error"]["code"] == "session_finished"
    assert t0.reward == 0.75 and t0.n_policy_tokens == 3  # "ok" and EOS, recorded as the episode's
    assert t1.reward is None and t1.meta["final_response"] == "\\boxed{3}"  # reward.fn scores it
    assert wf.stats()["n_agent_failed"] == 0 and wf.stats()["n_agent_turns"] == 1
    assert timed_out.reward == 0.0 and "no agent service claimed and ended the episode within agent.timeout_s=0.5s" \
        in timed_out.meta["agent_error"] and late.stats()["n_agent_failed"] == 1


def test_agent_service_configuration_is_checked(monkeypatch):
    from megarl.config.schema import AgentConfig
    from megarl.errors import ConfigError
    from megarl.workflows.agent_http import agent_source

    monkeypatch.delenv("MEGARL_AGENT_SERVICE_KEY", raising=False)
    with pytest.raises(ConfigError, match="needs \\$MEGARL_AGENT_SERVICE_KEY"):
        agent_source(AgentConfig(serve=True, http_port=8400))
    monkeypatch.setenv("MEGARL_AGENT_SERVICE_KEY", SERVICE_KEY)
    with pytest.raises(ConfigError, match="needs a fixed agent.http_port"):
        agent_source(AgentConfig(serve=True))
    with pytest.raises(ConfigError, match="either run as a command or claimed by an agent service"):
        agent_source(AgentConfig(serve=True, http_port=8400, command="python a.py"))
    assert agent_source(AgentConfig(serve=True, http_port=8400)) == (None, SERVICE_KEY)
