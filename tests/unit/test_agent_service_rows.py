"""An agent service that brings its own rows (agent.rows_from_service): POST /sessions {"row"} -> a group's keys.

The controller, replay buffer, staleness gate, endpoint (aiohttp) and the
service's clients (aiohttp, the official openai package) are the real ones;
the engine and trainer are the timing simulators of test_staleness_gate.py.
"""
import asyncio
import random

import aiohttp
import openai
import pytest
from test_agents import SAMPLING
from test_staleness_gate import (
    SimulatedEngineForGateTests,
    SimulatedPublisher,
    StepCounterTrainerForGateTests,
    zero_advantages,
)

from megarl.agents.client import AgentLimits
from megarl.agents.service_rows import ServiceRows
from megarl.builder import load_run_config
from megarl.config.schema import DataConfig
from megarl.loop.buffer import PublishedVersion, ReplayBuffer
from megarl.loop.controller import Controller
from megarl.workflows.agent_http import AgentHttpWorkflow
from recovery.base import RecoveryContext
from recovery.behav import Behav

KEY = "s3cret-service-key-0123"


class KeepStates:
    """A checkpointer that keeps the loop's state."""

    def __init__(self):
        self.last_step, self.states = -1, []

    async def save(self, controller, background=False):
        self.last_step = controller.step
        self.states.append(controller.state_dict())

    async def wait(self):
        return None


def controller(rows, workflow, checkpointer):
    # B=4 trajectories, groups of 2, eta=1: the gate admits (eta + v + 1) * B = 8 trajectories at version 0
    cfg = load_run_config(None, ["trainer.batch_size=4", "rollout.group_size=2", "rollout.eta=1"])
    rng = random.Random(0)
    engine, trainer = SimulatedEngineForGateTests(rng, 12), StepCounterTrainerForGateTests(rng)

    c = Controller(cfg, trainer=trainer, router=engine, buffer=ReplayBuffer(4, 1), published=PublishedVersion(),
                   rewards=None, dataset=rows, workflow=workflow,
                   strategy=Behav(None, RecoveryContext(trainer=trainer)), publisher=SimulatedPublisher(engine),
                   loss_fn_factory=lambda b, a: None, advantages=zero_advantages, on_step=lambda record: None,
                   checkpointer=checkpointer)
    return c, trainer


def service_side(tokenizer, data_cfg=None, wait_s=0.3):
    rows = ServiceRows(tokenizer, data_cfg or DataConfig(max_prompt_len=200), group_size=2, wait_s=wait_s)
    workflow = AgentHttpWorkflow(None, tokenizer, AgentLimits(SAMPLING, max_turns=2, max_tokens=1024),
                                 timeout_s=30.0, service_key=KEY)
    return rows, workflow


async def post(http, workflow, path, body=None, key=KEY):
    async with http.post(workflow.server.base_url[:-len("/v1")] + path, json=body,
                         headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, (await r.json() if r.status != 204 else None), r.headers.get("Retry-After")


async def run_episode(http, workflow, session, reward):
    """What a service does with one key: a completion, then the episode's reward."""
    async with openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["key"]) as oa:
        await oa.chat.completions.create(model=workflow.server.model, messages=[{"role": "user", "content": "go"}])
    status, _, _ = await post(http, workflow, f"/sessions/{session['key']}/reward", {"reward": reward}, key="")
    assert status == 200


async def run_groups(http, workflow, groups):
    """Every episode of ``groups``, the j-th of each rewarded 1 + j."""
    await asyncio.gather(*(run_episode(http, workflow, s, 1.0 + j) for g in groups
                           for j, s in enumerate(g["sessions"])))


async def post_and_run(http, workflow, ks):
    """Post the rows ``ks`` and run their groups."""
    groups = [(await post(http, workflow, "/sessions", {"row": row(k)}))[1] for k in ks]
    await run_groups(http, workflow, groups)
    return groups


def row(k):
    return {"prompt": f"What is {k} + {k}?", "answer": str(2 * k), "topic": "sums"}


def first_attempt(tokenizer):
    """Four posted rows fill the gate; a fifth gets 503; the service runs two groups, which train the one step."""
    rows, workflow = service_side(tokenizer)
    ckpt = KeepStates()
    c, trainer = controller(rows, workflow, ckpt)

    async def main():
        await workflow.serve_rows(rows)
        train = asyncio.create_task(c.train(1))
        async with aiohttp.ClientSession() as http:
            groups = [(await post(http, workflow, "/sessions", {"row": row(k)}))[1] for k in range(4)]
            held = await post(http, workflow, "/sessions", {"row": row(9)})  # 8 trajectories admitted: gate closed
            await run_groups(http, workflow, groups[:2])
            await asyncio.wait_for(train, 30)
        await workflow.aclose()
        return groups, held

    groups, held = asyncio.run(main())
    return groups, held, trainer, ckpt.states[-1], rows


def test_posted_rows_roll_out_as_groups_and_a_closed_gate_answers_503(text_tokenizer):
    groups, held, trainer, state, rows = first_attempt(text_tokenizer)
    assert [g["group_id"] for g in groups] == ["g0", "g1", "g2", "g3"]
    assert all(len(g["sessions"]) == 2 and len({s["key"] for s in g["sessions"]}) == 2 for g in groups)
    assert held[0] == 503 and held[1]["error"]["code"] == "busy" and "agent.row_wait_s=0.3s" in \
        held[1]["error"]["message"] and held[2] == "1"
    # the one step trained the two groups the service ran (rewards 1 and 2 per group), nothing else
    assert sorted(trainer.trained[0][2]) == ["g0-0", "g0-1", "g1-0", "g1-1"]
    # posted but unfinished: the rows of g2 and g3 are checkpointed as running; the refused row is not rolled out
    assert [(g["prompt"]["prompt_id"], g["prompt"]["row"]["prompt"]) for g in state["running_groups"]] == \
        [("service:2", "What is 2 + 2?"), ("service:3", "What is 3 + 3?")]
    assert state["dataset"] == {"source": "service", "n_posted": 4} and rows.n_posted == 4


def test_unfinished_posted_groups_are_regenerated_on_resume_and_claimed_with_an_empty_post(text_tokenizer):
    _, _, _, state, _ = first_attempt(text_tokenizer)
    rows, workflow = service_side(text_tokenizer)
    c, trainer = controller(rows, workflow, KeepStates())
    c.load_state_dict(state, id_prefix="r1.")
    # an external service's episodes do not survive a restart: both groups' four are started again, counted
    assert (c.counters["n_regenerated_after_resume"], c.counters["n_continued_after_resume"]) == (4, 0)

    async def main():
        await workflow.serve_rows(rows)
        train = asyncio.create_task(c.train(2))
        async with aiohttp.ClientSession() as http:
            claims = [(await post(http, workflow, "/sessions"))[1] for _ in range(4)]  # no request waits for them
            await asyncio.gather(*(run_episode(http, workflow, c, 0.5) for c in claims))
            await asyncio.wait_for(train, 30)
            new = await post(http, workflow, "/sessions", {"row": row(5)})  # the run is over: nobody takes it
        await workflow.aclose()
        return claims, new

    claims, new = asyncio.run(main())
    assert sorted((c["group_id"], c["row"]["prompt"]) for c in claims) == [
        ("r1.g4", "What is 2 + 2?"), ("r1.g4", "What is 2 + 2?"), ("r1.g5", "What is 3 + 3?"),
        ("r1.g5", "What is 3 + 3?")]
    assert sorted(trainer.trained[0][2]) == ["r1.g4-0", "r1.g4-1", "r1.g5-0", "r1.g5-1"]
    assert rows.n_posted == 4 and new[0] == 503  # numbering goes on from the checkpoint


@pytest.mark.parametrize("body, code, message", [
    ({"row": {"question": "hi", "answer": "1"}}, 400, "the posted row: no field 'prompt' (data.prompt_key)"),
    ({"row": {"prompt": "hi"}}, 400, "the posted row: no field 'answer' (data.answer_key)"),
    ({"row": {"prompt": "hi", "answer": None}}, 400, "field 'answer' (data.answer_key) is null"),
    ({"row": {"prompt": "x" * 300, "answer": "1"}}, 400, "longer than data.max_prompt_len=200"),
    ({"row": ["hi"]}, 400, "'row' must be a JSON object"),
])
def test_a_bad_row_gets_400_naming_what_is_wrong(text_tokenizer, body, code, message):
    rows, workflow = service_side(text_tokenizer)

    async def main():
        await workflow.serve_rows(rows)
        async with aiohttp.ClientSession() as http:
            out = await post(http, workflow, "/sessions", body)
            refused = await post(http, workflow, "/sessions", body, key="not-the-key")
        await workflow.aclose()
        return out, refused

    (status, answer, _), refused = asyncio.run(main())
    assert status == code and answer["error"]["code"] == "invalid_row" and message in answer["error"]["message"]
    assert refused[0] == 401 and rows._queued().empty()


def test_a_row_posted_to_a_run_with_data_of_its_own_is_refused(text_tokenizer):
    _, workflow = service_side(text_tokenizer)

    async def main():
        await workflow.start()
        async with aiohttp.ClientSession() as http:
            out = await post(http, workflow, "/sessions", {"row": row(1)})
        await workflow.aclose()
        return out

    status, answer, _ = asyncio.run(main())
    assert status == 400 and answer["error"]["code"] == "rows_not_taken"


def test_a_run_ends_while_its_loop_waits_for_a_row(text_tokenizer):
    rows, workflow = service_side(text_tokenizer)
    c, trainer = controller(rows, workflow, KeepStates())

    async def main():
        await workflow.serve_rows(rows)
        train = asyncio.create_task(c.train(1))
        async with aiohttp.ClientSession() as http:
            await post_and_run(http, workflow, range(2))
            # the gate has room for two more groups: the loop waits in ServiceRows.next when the step ends
            await asyncio.wait_for(train, 10)
        await workflow.aclose()

    asyncio.run(main())
    assert sorted(trainer.trained[0][2]) == ["g0-0", "g0-1", "g1-0", "g1-1"]


def test_the_run_takes_its_rows_from_one_source_named_in_the_config(text_tokenizer):
    from megarl.errors import ConfigError
    from megarl.preflight import training_prompts

    def prompts(*overrides):
        return training_prompts(load_run_config(None, list(overrides)), text_tokenizer, 128)

    service = ["rollout.workflow=agent_http", "agent.serve=true", "agent.http_port=8400"]
    with pytest.raises(ConfigError, match="data.path is empty: .* or let an agent service post the rows with "
                                          "agent.rows_from_service=true"):
        prompts("data.path=")
    with pytest.raises(ConfigError, match="needs rollout.workflow=agent_http and agent.serve=true"):
        prompts("data.path=", "agent.rows_from_service=true")
    with pytest.raises(ConfigError, match="the prompts come either from the agent service or from data.path"):
        prompts("data.path=configs/data/arithmetic_train.jsonl", "agent.rows_from_service=true", *service)
    with pytest.raises(ConfigError, match="agent.row_wait_s=0.0 must be > 0"):
        prompts("data.path=", "agent.rows_from_service=true", "agent.row_wait_s=0", *service)
    rows = prompts("data.path=", "agent.rows_from_service=true", "rollout.group_size=3", *service)
    assert isinstance(rows, ServiceRows) and rows.group_size == 3 and rows.wait_s == 60.0


def test_a_row_posted_during_a_publish_starts_its_group_at_the_new_version(text_tokenizer):
    rows, workflow = service_side(text_tokenizer, wait_s=10.0)
    c, trainer = controller(rows, workflow, KeepStates())
    loading, loaded = asyncio.Event(), asyncio.Event()
    apply = c.publisher.apply

    async def slow_apply(version):  # the engines load version 1 until the test lets them
        loading.set()
        await loaded.wait()
        await apply(version)

    c.publisher.apply = slow_apply

    async def main():
        await workflow.serve_rows(rows)
        train = asyncio.create_task(c.train(2))
        async with aiohttp.ClientSession() as http:
            await post_and_run(http, workflow, range(2))
            await loading.wait()  # step 1 is done and publishing: the loop waits for a row with generation closed
            late = asyncio.create_task(post(http, workflow, "/sessions", {"row": row(2)}))
            await asyncio.sleep(0.2)
            held = late.done()
            loaded.set()
            g2 = (await late)[1]
            start = c.buffer.running_groups[g2["group_id"]].start_version
            more = (await post(http, workflow, "/sessions", {"row": row(3)}))[1]
            await run_groups(http, workflow, (g2, more))
            await asyncio.wait_for(train, 10)
        await workflow.aclose()
        return held, g2, start

    held, g2, start = asyncio.run(main())
    assert not held and g2["group_id"] == "g2" and start == 1
    assert len(trainer.trained) == 2 and sorted(trainer.trained[1][2]) == ["g2-0", "g2-1", "g3-0", "g3-1"]
