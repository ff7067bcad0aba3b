"""The agent endpoint serves the run's policy under any model name an agent sends (agents written for other
OpenAI endpoints name their own model); agent.strict_model_name=true refuses a name other than the run's.

The engine is test_agents.py's scripted stand-in; server, client, tokenizer and the openai package are the
real ones (test_agent_http.py has the rest of the endpoint).
"""
import asyncio
import re
import sys
from pathlib import Path

import openai
import pytest
from test_agent_http import api
from test_agents import SAMPLING, ScriptedModel, client_for

from megarl.agents.client import AgentLimits
from megarl.agents.http_server import AgentHttpServer
from megarl.types import Trajectory
from megarl.workflows.agent_http import AgentHttpWorkflow

ROOT = Path(__file__).resolve().parents[2]
SERVED = "runs/checkpoints/tiny_qwen3_text"  # what a run's endpoint serves: its model.checkpoint
USER = [{"role": "user", "content": "hi"}]
#: the README's own example, an agent written for another endpoint, and a Hugging Face id
NAMES = ("megarl", "policy", "gpt-4o-mini", "Qwen/Qwen3-0.6B")


async def serving(fn, **kw):
    server = AgentHttpServer("127.0.0.1", 0, model=SERVED, **kw)
    await server.start()
    try:
        return await fn(server)
    finally:
        await server.stop()


def test_any_model_name_gets_a_completion_from_the_runs_policy_named_in_the_response(text_tokenizer):
    client, traj, model = client_for(text_tokenizer, [f"answer {i}" for i in range(len(NAMES) + 1)])

    async def main(server):
        session = server.open_session(client, timeout_s=30.0)
        async with api(server, session.key) as oa:
            replies = [await oa.chat.completions.create(model=name, messages=USER) for name in (*NAMES, SERVED)]
            listed = await oa.models.list()
        return replies, listed, session

    replies, listed, session = asyncio.run(serving(main))
    assert [r.choices[0].message.content for r in replies] == [f"answer {i}" for i in range(len(NAMES) + 1)]
    assert {r.model for r in replies} == {SERVED}  # what served them, whatever name was asked for
    assert [m.id for m in listed.data] == [SERVED]  # GET /v1/models names the one model there is
    assert session.error is None and client.stats.n_turns == len(NAMES) + 1 and len(model.contexts) == 5


def test_strict_model_name_refuses_another_name_with_404_and_serves_the_runs(text_tokenizer):
    client, _, model = client_for(text_tokenizer, ["served"], max_turns=1)

    async def main(server):
        session = server.open_session(client, timeout_s=30.0)
        refused = {}
        async with api(server, session.key) as oa:
            for name in NAMES:
                with pytest.raises(openai.NotFoundError) as e:
                    await oa.chat.completions.create(model=name, messages=USER)
                refused[name] = e.value
            ok = await oa.chat.completions.create(model=SERVED, messages=USER)  # agent.max_turns=1: still there
        return refused, ok, session

    refused, ok, session = asyncio.run(serving(main, strict_model_name=True))
    for name, e in refused.items():
        assert e.status_code == 404 and e.code == "model_not_found"
        assert f"the model {name!r} is not served here; megarl serves {SERVED!r}" in e.message
        assert "agent.strict_model_name" in e.message
    assert ok.choices[0].message.content == "served" and ok.model == SERVED
    assert session.error is None and len(model.contexts) == 1


def test_a_model_that_is_not_text_is_refused_in_either_mode(text_tokenizer):
    client, _, model = client_for(text_tokenizer, [])

    async def main(server):
        session = server.open_session(client, timeout_s=30.0)
        async with api(server, session.key) as oa:
            with pytest.raises(openai.BadRequestError) as e:
                await oa.chat.completions.create(model=3, messages=USER)
        return e.value

    for strict in (False, True):
        e = asyncio.run(serving(main, strict_model_name=strict))
        assert e.status_code == 400 and e.code == "invalid_model" and "model must be text, got 3" in e.message
    assert model.contexts == []


def readme_agent() -> str:
    """The README's example of an agent in another process (the code block under "Training an agent")."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(# agent\.py -- rollout\.workflow=agent_http.*?)```", text, re.S)
    assert block is not None, "README.md has no agent_http example starting '# agent.py -- rollout.workflow=...'"
    return block.group(1)


def test_the_readme_agent_example_runs_as_an_episode(text_tokenizer):
    code = readme_agent()  # run as `python -c`: the command's /tmp is its own, a file written there is not
    assert 'model="megarl"' in code  # the name it sends is not the run's model
    wf = AgentHttpWorkflow([sys.executable, "-c", code], text_tokenizer,
                           AgentLimits(SAMPLING, max_turns=2, max_tokens=512), timeout_s=60.0)

    async def main():
        traj = Trajectory("g0-0", "g0", [1], meta={"row": {"prompt": "what is 1 + 2?"}}, logp_old=[])
        try:
            return await wf.run(traj, ScriptedModel(text_tokenizer, ["it is\n\\boxed{3}"]))
        finally:
            await wf.aclose()

    traj = asyncio.run(main())
    assert "agent_error" not in traj.meta, traj.meta.get("agent_error")
    assert traj.meta["final_response"] == "it is \\boxed{3}" and wf.stats()["n_agent_failed"] == 0
