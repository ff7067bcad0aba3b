"""Running groups in a checkpoint (megarl/loop/running_groups.py), with hand-made groups on the real controller.

A group cut mid-run is kept whole: finished trajectories (scored or not) and partial ones with their tokens,
versions, logp_behav, logp_old and the workflow's turn. On resume megarl's own workflows continue each partial
turn from its tokens (the engine is sent prompt + tokens so far; new tokens get the resumed version), a
multi-turn episode whose tool answer had not come asks the environment again, a scored trajectory is neither
generated nor scored again, and an episode of a workflow that cannot continue is generated again under a new
id, counted. The cut is consistent: what an engine had not returned when the checkpoint was cut is not in it,
and a stop collects every request's partial tokens before its checkpoint.
"""
import asyncio

import pytest
from loop_fixtures import make_controller

from megarl.data import Prompt
from megarl.errors import EngineError
from megarl.loop.buffer import Group
from megarl.types import NO_VERSION, GenerateResult, SamplingParams, Trajectory
from megarl.workflows.base import TurnPoint
from megarl.workflows.multi_turn import MultiTurnWorkflow
from megarl.workflows.single_turn import SingleTurnWorkflow

CALL, STOP, TOOL = 7, 2, [9, 9]
PROMPT = [1, 1]


class ScriptedRouterFake:
    """A router fake whose answers are scripted per trajectory: ``(tokens, finish_reason)`` in order, at
    ``version``; ``None`` holds the request until :meth:`abort_all`, which returns ``aborted`` tokens for it; an
    exception is raised (a request the engine refused)."""

    def __init__(self, script, version, aborted=()):
        self.script = {k: list(v) for k, v in script.items()}
        self.version = version
        self.aborted = list(aborted)
        self.requests: dict[str, list] = {}
        self.failure = None
        self._abort = asyncio.Event()

    async def generate(self, req):
        tid = req.request_id.split("/")[0]
        self.requests.setdefault(tid, []).append((list(req.prompt_ids), req.sampling.max_new_tokens))
        answer = self.script[tid].pop(0)
        if isinstance(answer, Exception):
            raise answer
        if answer is None:
            await self._abort.wait()
            answer = (self.aborted, "abort")
        out, reason = answer
        return GenerateResult(req.request_id, list(out), [-0.25] * len(out), [self.version] * len(out), reason)

    async def abort_all(self):
        self._abort.set()
        await asyncio.sleep(0)

    async def wait_available(self):
        """Never loses an engine."""


class EnvFake:
    tool_call_id = CALL

    def __init__(self):
        self.calls = 0

    async def respond(self, traj):
        self.calls += 1
        return list(TOOL)


def multi_turn(env):
    return MultiTurnWorkflow(SamplingParams(max_new_tokens=20, stop_token_ids=[STOP]), env, max_turns=3)


def traj(j, response=(), versions=(), tool=(), finished=False, reward=None):
    """Trajectory ``g0-j`` of the hand-made group: ``response`` policy tokens of ``versions`` with ``tool``
    tokens at the given positions."""
    t = Trajectory(f"g0-{j}", "g0", list(PROMPT), logp_old=[], finished=finished, reward=reward)
    for i, (tok, v) in enumerate(zip(response, versions)):
        if i in tool:
            t.append_tool([tok])
        else:
            t.append_policy([tok], [-0.5 - i], [v])
    if finished:
        t.finish_reason = "stop"
    return t


def hand_made_state(workflow, trajs, turns):
    """The checkpoint of a controller (at version 1) whose one running group is ``trajs``, with ``turns``."""
    c, *_ = make_controller(0, workflow=workflow)
    c.version = 1
    group = Group("g0", 0, trajs)
    c.buffer.admit(group)
    c.running.items["g0"] = Prompt("p0", list(PROMPT), answer="x", row={"prompt": "p"})
    c.running.turns.update(turns)
    c.group_counter = 1
    state = c.state_dict()
    state["trainer_version"] = 1
    return state


def resumed(state, workflow, router):
    c, *_ = make_controller(1, state, workflow=workflow)
    c.router = c.generation.router = c.running.router = router
    return c


def run_restored(c):
    group = c.running.restored[0]
    asyncio.run(c.running.run_group(group, c.running.items[group.group_id]))
    return {t.traj_id: t for g in c.buffer.ready for t in g.trajectories}


def test_a_multi_turn_group_cut_mid_run_continues_at_each_trajectorys_turn_and_loses_no_token():
    env = EnvFake()
    trajs = [traj(0, [3, CALL, 9, 9, 3, 3], [0, 0, -1, -1, 1, 1], tool={2, 3}),  # cut in turn 1
             traj(1, [3, 3, CALL], [1, 1, 1]),  # turn 0 ended with a call: its answer had not come
             traj(2, [4, STOP], [0, 0], finished=True, reward=1.0),  # done: waits for its siblings
             traj(3, [4, 4, STOP], [1, 1, 1], finished=True)]  # finished, its score had not come
    turns = {"g0-0": TurnPoint(1, 4, True), "g0-1": TurnPoint(0, 0, False)}
    state = hand_made_state(multi_turn(env), trajs, turns)
    kept = {t["traj_id"]: t for t in state["running_groups"][0]["trajectories"]}
    assert kept["g0-0"]["response_ids"] == trajs[0].response_ids and kept["g0-0"]["versions"] == trajs[0].versions
    assert kept["g0-0"]["logp_behav"] == trajs[0].logp_behav and state["running_groups"][0]["turns"] == {
        "g0-0": {"turn": 1, "start": 4, "open": True}, "g0-1": {"turn": 0, "start": 0, "open": False}}

    router = ScriptedRouterFake({"g0-0": [([3, STOP], "stop")], "g0-1": [([5, STOP], "stop")]}, version=2)
    c = resumed(state, multi_turn(env), router)
    # admitted again at once: the versions its tokens reference stay live for exact strategies
    assert c.buffer.running == 4 and c.buffer.live_versions(c.version) == {0, 1}
    # a round trip before it runs keeps it as it was
    again = c.state_dict()["running_groups"]
    assert again == state["running_groups"]
    done = run_restored(c)

    a, b = done["g0-0"], done["g0-1"]
    # turn 1 went on from its two tokens: prompt + everything so far sent once, the budget what the turn had left
    assert router.requests["g0-0"] == [(PROMPT + [3, CALL, 9, 9, 3, 3], 20 - 4 - 2)]
    assert a.response_ids == [3, CALL, 9, 9, 3, 3, 3, STOP]
    assert a.versions == [0, 0, NO_VERSION, NO_VERSION, 1, 1, 2, 2]
    assert a.logp_behav[:6] == trajs[0].logp_behav and a.loss_mask == [1, 1, 0, 0, 1, 1, 1, 1]
    # the call of turn 0 got its answer, then turn 1 ran
    assert router.requests["g0-1"] == [(PROMPT + [3, 3, CALL, 9, 9], 20 - 5)] and env.calls == 1
    assert b.response_ids == [3, 3, CALL, 9, 9, 5, STOP] and b.versions == [1, 1, 1, -1, -1, 2, 2]
    # the scored one was neither generated nor scored again; the unscored one was scored (reward = its length)
    assert set(router.requests) == {"g0-0", "g0-1"}
    assert done["g0-2"].reward == 1.0 and done["g0-3"].reward == 3.0
    assert {k: c.counters[k] - state["counters"][k] for k in
            ("n_continued_after_resume", "n_regenerated_after_resume", "n_tokens_regenerated_after_resume")} == \
        {"n_continued_after_resume": 4, "n_regenerated_after_resume": 0, "n_tokens_regenerated_after_resume": 0}
    assert c.running.turns == {}, "turn points are dropped once their workflow returned"


def test_the_cut_keeps_what_came_back_and_a_stop_collects_what_is_in_flight():
    """A checkpoint cut while a request is in flight keeps the tokens returned before it (an interruption's
    chunk), not the ones the engine had not returned: on resume the answer goes on from the kept ones, which
    are sent as prompt and never sampled again. A stop first aborts the request and keeps its partial tokens."""
    wf = SingleTurnWorkflow(SamplingParams(max_new_tokens=12, stop_token_ids=[STOP]))
    c, *_ = make_controller(0, workflow=wf)
    c.router = c.generation.router = c.running.router = ScriptedRouterFake(
        {"g0-0": [([3, 3], "abort"), None]}, version=0, aborted=[5])
    t = traj(0)
    group = Group("g0", 0, [t])
    c.buffer.admit(group)
    c.running.items["g0"] = Prompt("p0", list(PROMPT))
    states = {}

    async def cut():
        task = asyncio.create_task(c.running.run_workflow(t))
        while len(c.router.requests.get("g0-0", [])) < 2:  # the second request is in flight
            await asyncio.sleep(0)
        states["periodic"] = c.state_dict()
        await c.running.quiesce_for_stop()
        states["stop"] = c.state_dict()
        task.cancel()

    asyncio.run(cut())
    periodic, stop = ([d["trajectories"][0] for d in states[k]["running_groups"]][0] for k in ("periodic", "stop"))
    assert periodic["response_ids"] == [3, 3] and stop["response_ids"] == [3, 3, 5]
    assert states["stop"]["running_groups"][0]["turns"] == {"g0-0": {"turn": 0, "start": 0, "open": True}}
    for name, kept in (("periodic", periodic), ("stop", stop)):
        state = {**states[name], "trainer_version": 0}
        router = ScriptedRouterFake({"g0-0": [([4, STOP], "stop")]}, version=1)
        done = run_restored(resumed(state, wf, router))["g0-0"]
        assert router.requests["g0-0"] == [(PROMPT + kept["response_ids"], 12 - len(kept["response_ids"]))], name
        assert done.response_ids == kept["response_ids"] + [4, STOP] and done.versions[-2:] == [1, 1]
        assert done.versions[:-2] == kept["versions"] == [0] * len(kept["response_ids"])


@pytest.mark.parametrize("name", ["single_turn", "multi_turn"])
def test_a_cut_while_a_failed_group_stops_its_siblings_keeps_every_token_with_its_turn(name):
    """A request the engine refuses fails its trajectory, and its group stops the siblings before it is dropped:
    a checkpoint cut at any moment of that (the loop runs on) keeps each partial trajectory with its turn, so a
    resume continues it from its tokens and generates nothing again."""
    wf, budget = ((SingleTurnWorkflow(SamplingParams(max_new_tokens=12, stop_token_ids=[STOP])), 12)
                  if name == "single_turn" else (multi_turn(EnvFake()), 20))
    c, *_ = make_controller(0, workflow=wf)
    c.router = c.generation.router = c.running.router = ScriptedRouterFake(
        {"g0-0": [([3, 3], "abort"), EngineError("request refused")], "g0-1": [([4], "abort"), None]}, version=0)
    group = Group("g0", 0, [traj(0), traj(1)])
    c.buffer.admit(group)
    c.running.items["g0"] = item = Prompt("p0", list(PROMPT))
    cuts = []

    async def run_and_cut_every_iteration():
        task = asyncio.create_task(c.running.run_group(group, item))
        while not task.done():
            if "g0" in c.running.items:
                cuts.append(c.state_dict())
            await asyncio.sleep(0)

    asyncio.run(run_and_cut_every_iteration())
    assert c.counters["n_dropped"] == 2 and "g0" not in c.buffer.running_groups and c.running.turns == {}
    last = cuts[-1]["running_groups"][0]  # the group had failed; its siblings were stopped
    assert [t["response_ids"] for t in last["trajectories"]] == [[3, 3], [4]]
    for cut in cuts:
        kept = cut["running_groups"][0]
        partial = {t["traj_id"] for t in kept["trajectories"] if t["response_ids"] and not t["finished"]}
        assert partial <= set(kept["turns"]), f"partial trajectories without their turn: {partial}"
    router = ScriptedRouterFake({"g0-0": [([5, STOP], "stop")], "g0-1": [([6, STOP], "stop")]}, version=1)
    c = resumed({**cuts[-1], "trainer_version": 0}, wf, router)
    assert {k: c.counters[k] - cuts[-1]["counters"][k] for k in
            ("n_continued_after_resume", "n_regenerated_after_resume", "n_tokens_regenerated_after_resume")} == \
        {"n_continued_after_resume": 2, "n_regenerated_after_resume": 0, "n_tokens_regenerated_after_resume": 0}
    done = run_restored(c)
    assert router.requests == {"g0-0": [(PROMPT + [3, 3], budget - 2)], "g0-1": [(PROMPT + [4], budget - 1)]}
    assert done["g0-0"].response_ids == [3, 3, 5, STOP] and done["g0-1"].response_ids == [4, 6, STOP]
    assert done["g0-0"].versions == [0, 0, 1, 1] and done["g0-1"].versions == [0, 1, 1]


def test_an_episode_that_cannot_continue_is_generated_again_under_a_new_id_and_counted():
    trajs = [traj(0, [3, 3, 3], [0, 0, 1]), traj(1, [4, STOP], [0, 0], finished=True, reward=2.0), traj(2)]
    state = hand_made_state(None, trajs, {"g0-0": TurnPoint(0, 0, True)})  # the gate tests' single turn
    router = ScriptedRouterFake({"r1.g0-0": [([6, STOP], "stop")], "r1.g0-2": [([6, 6, STOP], "stop")]}, version=1)
    c = resumed(state, None, router)
    assert [t.traj_id for t in c.running.restored[0].trajectories] == ["r1.g0-0", "g0-1", "r1.g0-2"]
    assert {k: c.counters[k] - state["counters"][k] for k in
            ("n_continued_after_resume", "n_regenerated_after_resume", "n_tokens_regenerated_after_resume")} == \
        {"n_continued_after_resume": 1, "n_regenerated_after_resume": 2, "n_tokens_regenerated_after_resume": 3}
    done = run_restored(c)
    assert router.requests["r1.g0-0"][0][0] == PROMPT and done["r1.g0-0"].response_ids == [6, STOP]
    assert done["g0-1"].reward == 2.0 and done["r1.g0-2"].response_ids == [6, 6, STOP]
    # with no finished trajectory there is nothing to keep: the group starts again from its prompt, as a new one
    state = hand_made_state(None, [traj(0, [3, 3], [0, 0]), traj(1)], {})
    c = resumed(state, None, ScriptedRouterFake({}, version=1))
    assert c.running.restored == [] and [p.prompt_id for p in c.running.regenerate] == ["p0"] and c.buffer.running == 0
    assert c.counters["n_regenerated_after_resume"] - state["counters"]["n_regenerated_after_resume"] == 2


def test_a_checkpoint_of_an_older_megarl_regenerates_running_groups_from_their_prompts():
    state = hand_made_state(None, [traj(0, [3], [0])], {})
    state["running_prompts"] = [p for p in [Prompt("p0", list(PROMPT)).to_dict()]]
    del state["running_groups"]
    c = resumed(state, None, ScriptedRouterFake({}, version=1))
    assert c.running.restored == [] and [p.prompt_id for p in c.running.regenerate] == ["p0"] and c.buffer.running == 0


def test_with_keep_running_groups_false_a_checkpoint_keeps_prompts_and_the_resume_counts_what_it_threw_away():
    """logging.keep_running_groups=false: the running group's prompt only; its two trajectories (one finished,
    one partial; 3 + 2 policy tokens) are generated again as a new group, counted on resume."""
    wf = SingleTurnWorkflow(SamplingParams(max_new_tokens=12, stop_token_ids=[STOP]))
    c, *_ = make_controller(0, workflow=wf, overrides=["logging.keep_running_groups=false"])
    c.buffer.admit(Group("g0", 0, [traj(0, [3, 3, 3], [0, 0, 1]), traj(1, [4, STOP], [0, 0], finished=True)]))
    c.running.items["g0"] = Prompt("p0", list(PROMPT))
    state = {**c.state_dict(), "trainer_version": 0}
    assert state["running_groups"] == [] and [p["prompt_id"] for p in state["running_prompts"]] == ["p0"]
    assert state["thrown_away"] == {"trajectories": 2, "tokens": 5}
    r = resumed(state, wf, ScriptedRouterFake({}, version=1))
    assert r.running.restored == [] and [p.prompt_id for p in r.running.regenerate] == ["p0"]
    assert {k: r.counters[k] - state["counters"][k] for k in ("n_regenerated_after_resume",
                                                            "n_tokens_regenerated_after_resume")} == \
        {"n_regenerated_after_resume": 2, "n_tokens_regenerated_after_resume": 5}


def test_what_a_stop_counts_after_the_last_step_record_reaches_the_resumed_runs_first_record():
    """A stop's aborted requests return tokens after the last step's record: their counts (here 3 generated
    tokens) are in the checkpoint and the resumed run's first step record reports them, not lost between two."""
    c, *_ = make_controller(0)
    c.counters["n_engine_generated_tokens"] = 10
    c.bookkeeping.step_counters = dict(c.counters)  # the last step record
    c.counters["n_engine_generated_tokens"] += 3  # the stop's aborted requests
    state = {**c.state_dict(), "trainer_version": 0}
    r = resumed(state, None, ScriptedRouterFake({}, version=1))
    step = {k: r.counters[k] - r.bookkeeping.step_counters[k] for k in r.counters}
    assert step["n_engine_generated_tokens"] == 3
