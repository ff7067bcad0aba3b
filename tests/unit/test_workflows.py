"""Workflows against a scripted stand-in for the engine.

``scripted_generate`` is a test double for the controller's generate function
only: it replays GenerateResults in order and records what it was asked.
"""
import asyncio

import pytest
from conftest import DEMO, chat_prompt, digits

from megarl.config.schema import MegaRLConfig
from megarl.errors import ConfigError
from megarl.types import NO_VERSION, GenerateResult, SamplingParams, Segment, Trajectory
from megarl.workflows import DigitCountEnv, MultiTurnWorkflow, SingleTurnWorkflow, ToolEnv, Workflow, build_workflow

D = digits
EOS = DEMO.IM_END  # the demo tokenizer's eos_token
SEP = DEMO.NEWLINE  # digit_count's tool call


class scripted_generate:  # noqa: N801 - used like a function
    """Replays ``(output_ids, versions, finish_reason)`` turns; logp_behav = -0.1 * (i + 1).

    With ``traj`` given it also appends each turn to it before returning, as the
    controller's generate does (so recovery hooks see partial turns).
    """

    def __init__(self, *turns, traj=None):
        self.turns = list(turns)
        self.traj = traj
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def __call__(self, context_ids, sampling):
        self.calls.append((list(context_ids), sampling))
        output_ids, versions, finish = self.turns.pop(0)
        result = GenerateResult(request_id=f"r{len(self.calls)}", output_ids=output_ids,
                                logp_behav=[-0.1 * (i + 1) for i in range(len(output_ids))],
                                versions=versions, finish_reason=finish)
        if self.traj is not None:
            self.traj.append_policy(result.output_ids, result.logp_behav, result.versions)
        return result


def new_traj(prompt):
    return Trajectory(traj_id="t0", group_id="g0", prompt_ids=prompt)


PROMPT = chat_prompt("12")
SAMPLING = SamplingParams(max_new_tokens=20, stop_token_ids=[EOS])


def test_protocols(demo_tokenizer):
    assert isinstance(SingleTurnWorkflow(SAMPLING), Workflow)
    assert isinstance(MultiTurnWorkflow(SAMPLING, DigitCountEnv(demo_tokenizer)), Workflow)
    assert isinstance(DigitCountEnv(demo_tokenizer), ToolEnv)


def test_single_turn_versions_change_mid_result():
    gen = scripted_generate((D("21") + [EOS], [3, 3, 4], "stop"))
    traj = asyncio.run(SingleTurnWorkflow(SAMPLING).run(new_traj(PROMPT), gen))
    assert gen.calls == [(PROMPT, SAMPLING)]
    assert traj.response_ids == D("21") + [EOS]
    assert traj.loss_mask == [1, 1, 1]
    assert traj.versions == [3, 3, 4]
    assert traj.logp_behav == pytest.approx([-0.1, -0.2, -0.3])
    assert traj.finish_reason == "stop"
    assert traj.segments() == [Segment("t0", 0, 2, 3), Segment("t0", 2, 3, 4)]


@pytest.mark.parametrize("generate_appends", [False, True], ids=["workflow-appends", "generate-appends"])
def test_multi_turn_tool_tokens(generate_appends, demo_tokenizer):
    # turn 1 calls the tool (SEP); the env answers "2" (the prompt has 2 digits);
    # turn 2 answers, with a weight update after its first token
    traj = new_traj(PROMPT)
    gen = scripted_generate((D("2") + [SEP], [5, 5], "stop"), (D("1") + [EOS], [5, 6], "stop"),
                            traj=traj if generate_appends else None)
    asyncio.run(MultiTurnWorkflow(SAMPLING, DigitCountEnv(demo_tokenizer)).run(traj, gen))
    tool = D("2")
    assert traj.response_ids == D("2") + [SEP] + tool + D("1") + [EOS]
    assert traj.loss_mask == [1, 1, 0, 1, 1]
    assert traj.versions == [5, 5, NO_VERSION, 5, 6]
    assert traj.logp_behav == pytest.approx([-0.1, -0.2, 0.0, -0.1, -0.2])
    assert traj.n_policy_tokens == 4
    # segments skip the tool token: no old logits are ever needed for it
    assert traj.segments() == [Segment("t0", 0, 2, 5), Segment("t0", 3, 4, 5), Segment("t0", 4, 5, 6)]
    assert traj.policy_versions() == {5, 6}
    # turn 2 sees everything so far; each turn stops on the call token too and gets the rest of the budget
    (ctx1, s1), (ctx2, s2) = gen.calls
    assert ctx1 == PROMPT and ctx2 == PROMPT + D("2") + [SEP] + tool
    assert s1.stop_token_ids == s2.stop_token_ids == sorted([EOS, SEP])
    assert (s1.max_new_tokens, s2.max_new_tokens) == (20, 17)
    assert traj.finish_reason == "stop"


def test_multi_turn_stops_after_max_turns_without_answering_the_last_call(demo_tokenizer):
    gen = scripted_generate(([SEP], [1], "stop"), ([SEP], [1], "stop"), ([EOS], [1], "stop"))
    workflow = MultiTurnWorkflow(SAMPLING, DigitCountEnv(demo_tokenizer), max_turns=2)
    traj = asyncio.run(workflow.run(new_traj(PROMPT), gen))
    assert len(gen.calls) == 2
    assert traj.response_ids == [SEP, *D("2"), SEP]
    assert traj.loss_mask == [1, 0, 1]


def test_multi_turn_no_call_when_cut_by_length(demo_tokenizer):
    gen = scripted_generate((D("2") + [SEP], [0, 0], "length"), ([EOS], [0], "stop"))
    traj = asyncio.run(MultiTurnWorkflow(SAMPLING, DigitCountEnv(demo_tokenizer)).run(new_traj(PROMPT), gen))
    assert len(gen.calls) == 1 and traj.loss_mask == [1, 1] and traj.finish_reason == "length"


def test_multi_turn_response_budget_includes_tool_tokens(demo_tokenizer):
    gen = scripted_generate((D("21") + [SEP], [0, 0, 0], "stop"), ([EOS], [0], "stop"))
    workflow = MultiTurnWorkflow(SAMPLING, DigitCountEnv(demo_tokenizer), max_response_len=4)
    traj = asyncio.run(workflow.run(new_traj(PROMPT), gen))
    assert len(gen.calls) == 1
    assert len(traj.response_ids) == 4 and traj.finish_reason == "length"


def test_multi_turn_tool_answer_that_does_not_fit_is_not_appended(demo_tokenizer):
    # the first turn spends the whole budget of 4 on a call: its 1-token answer would make the response 5 long
    gen = scripted_generate((D("212") + [SEP], [0, 0, 0, 0], "stop"), ([EOS], [0], "stop"))
    workflow = MultiTurnWorkflow(SAMPLING, DigitCountEnv(demo_tokenizer), max_response_len=4)
    traj = asyncio.run(workflow.run(new_traj(PROMPT), gen))
    assert len(gen.calls) == 1
    assert traj.response_ids == D("212") + [SEP] and traj.finish_reason == "length"


def test_digit_count_env(demo_tokenizer):
    prompt = chat_prompt("123456789012")
    env = DigitCountEnv(demo_tokenizer)
    assert asyncio.run(env.respond(new_traj(prompt))) == D("12")
    assert env.tool_call_id == SEP


def test_generate_that_appends_is_not_counted_twice():
    traj = new_traj(PROMPT)
    gen = scripted_generate((D("21") + [EOS], [3, 3, 4], "stop"), traj=traj)
    asyncio.run(SingleTurnWorkflow(SAMPLING).run(traj, gen))
    assert traj.response_ids == D("21") + [EOS] and traj.versions == [3, 3, 4]


def test_generate_that_appends_something_else_is_an_error():
    traj = new_traj(PROMPT)

    async def inconsistent(context_ids, sampling):
        traj.append_policy([EOS], [0.0], [1])
        return GenerateResult("r", D("1") + [EOS], [0.0, 0.0], [1, 1], "stop")

    with pytest.raises(RuntimeError, match="differ"):
        asyncio.run(SingleTurnWorkflow(SAMPLING).run(traj, inconsistent))


def test_build_workflow_from_config(demo_tokenizer):
    cfg = MegaRLConfig()
    single = build_workflow("single_turn", cfg, demo_tokenizer)
    assert isinstance(single, SingleTurnWorkflow)
    # stop at the tokenizer's EOS and both eos ids of generation_config.json (<|endoftext|>, <|im_end|>)
    assert single.sampling == SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                             top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                                             stop_token_ids=[DEMO.ENDOFTEXT, DEMO.IM_END])
    multi = build_workflow("multi_turn", cfg, demo_tokenizer, max_turns=3)
    assert isinstance(multi.env, DigitCountEnv) and multi.max_turns == 3
    with pytest.raises(ConfigError, match="unknown workflow"):
        build_workflow("three_turn", cfg, demo_tokenizer)
    with pytest.raises(ConfigError, match="single_turn"):
        build_workflow("single_turn", cfg, demo_tokenizer, max_turns=3)
    with pytest.raises(ConfigError, match="tool environment"):
        build_workflow("multi_turn", cfg, demo_tokenizer, env="calculator")
