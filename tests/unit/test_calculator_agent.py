"""The calculator agent (megarl/workflows/calculator.py), its rows (megarl/tasks/long_arithmetic.py), the digits
reward and the tokenizer of configs/models/tiny_qwen3_calc.yaml. The engine is a scripted stand-in that replays
model outputs into the trajectory; the tokenizer, chat template and client are the real ones."""
import asyncio
import json
import random

import pytest
from conftest import run_tokenizer, write_tokenizer

from megarl.agents.client import AgentLimits
from megarl.rewards import resolve_reward_fn
from megarl.rewards.digits import digit_reward
from megarl.tasks import long_arithmetic, reverse_digits
from megarl.types import GenerateResult, SamplingParams, Trajectory
from megarl.workflows.agent import AgentWorkflow, load_agent
from megarl.workflows.calculator import calculate, parse_problem


@pytest.fixture(scope="module")
def calc_tokenizer(tmp_path_factory):
    return run_tokenizer(write_tokenizer("configs/models/tiny_qwen3_calc.yaml", tmp_path_factory.mktemp("calc_tok")))


class Replay:
    """Replays the model's replies (text; the EOS id is added) into the trajectory it is given."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.contexts = tok, list(replies), []

    async def __call__(self, context, sampling, into):
        self.contexts.append(list(context))
        ids = self.tok.hf.encode(self.replies.pop(0), add_special_tokens=False) + [self.tok.hf.eos_token_id]
        into.append_policy(ids, [-0.5] * len(ids), [0] * len(ids))
        return GenerateResult("r", ids, [-0.5] * len(ids), [0] * len(ids), "stop")


def episode(tok, prompt, replies, agent="calculator", traj_id="g0-0", max_turns=2):
    """Run one episode of the built-in ``agent``: (the trajectory, the decoded contexts the model saw, stats)."""
    limits = AgentLimits(SamplingParams(temperature=1.0, max_new_tokens=12), max_turns=max_turns, max_tokens=96)
    wf = AgentWorkflow(load_agent(agent), tok, None, limits)
    traj = Trajectory(traj_id, "g0", [], meta={"row": {"prompt": prompt, "answer": "0"}}, logp_old=[])
    model = Replay(tok, replies)
    asyncio.run(wf.run(traj, model))
    assert not model.replies and "agent_error" not in traj.meta, traj.meta.get("agent_error")
    return traj, [tok.hf.decode(c, skip_special_tokens=False) for c in model.contexts], wf.stats()


def test_the_calculator_adds_and_multiplies_integers_only():
    assert calculate(4821, "*", 907) == 4372647 and calculate(4821, "+", 907) == 5728
    for a, op, b in ((2, "-", 1), (2, "**", 3), ("2", "+", 3), (2.0, "*", 3), (True, "+", 1)):
        with pytest.raises(ValueError):
            calculate(a, op, b)
    assert parse_problem("4821*907") == (4821, "*", 907) and parse_problem(" 12 + 3 ") == (12, "+", 3)
    for bad in ("4821/907", "1+2+3", "__import__('os')", "12*", None):
        with pytest.raises(ValueError):
            parse_problem(bad)


def test_rows_are_deterministic_and_exact(tmp_path):
    for seed in (0, 1):
        long_arithmetic.main("long_arithmetic", long_arithmetic.make_row, "", [str(tmp_path / f"{seed}a.jsonl"),
                             "--n", "50", "--seed", str(seed)], options=long_arithmetic.OPTIONS)
        long_arithmetic.main("long_arithmetic", long_arithmetic.make_row, "", [str(tmp_path / f"{seed}b.jsonl"),
                             "--n", "50", "--seed", str(seed)], options=long_arithmetic.OPTIONS)
        assert (tmp_path / f"{seed}a.jsonl").read_text() == (tmp_path / f"{seed}b.jsonl").read_text()
    rows = [json.loads(x) for x in (tmp_path / "0a.jsonl").read_text().splitlines()]
    assert rows != [json.loads(x) for x in (tmp_path / "1a.jsonl").read_text().splitlines()]
    assert {r["prompt"][len(str(parse_problem(r["prompt"])[0]))] for r in rows} == {"+", "*"}
    for r in rows:
        a, op, b = parse_problem(r["prompt"])
        assert r["answer"] == str(a * b if op == "*" else a + b) and 2 <= len(str(a)) and 2 <= len(str(b))
    only_mul = long_arithmetic.make_row(random.Random(3), ops="*", mul_digits=2)
    assert "*" in only_mul["prompt"] and len(only_mul["prompt"]) == 5
    fixed = [long_arithmetic.make_row(random.Random(i), answer_digits=3) for i in range(40)]
    assert {len(r["answer"]) for r in fixed} == {3} and {"*" in r["prompt"] for r in fixed} == {True, False}
    with pytest.raises(ValueError):
        long_arithmetic.make_row(random.Random(0), ops="-")
    with pytest.raises(ValueError, match="no answer of 9 digits"):
        long_arithmetic.make_row(random.Random(0), answer_digits=9)


def test_digit_reward_by_hand():
    assert digit_reward("4372647", "4372647") == 1.0
    assert digit_reward("4372647", "4372647", finish_reason="length") == 0.75
    assert digit_reward("4370000", "4372647") == pytest.approx(0.75 * 3 / 7 + 0.25)  # 3 digits in place
    assert digit_reward("43", "4372") == pytest.approx(0.75 * 2 / 4 + 0.25 * 0.5)  # half the length
    assert digit_reward("", "12") == 0.0 and digit_reward("123456", "12") == pytest.approx(0.75 * 2 / 6)
    # reverse_digits scores with the same rule, and "digits" is a built-in name for it
    assert reverse_digits.reward("4370000", "4372647") == digit_reward("4370000", "4372647")
    assert resolve_reward_fn("digits") is digit_reward


def test_an_operator_reply_calls_the_calculator_and_the_next_reply_is_the_answer(calc_tokenizer):
    traj, contexts, stats = episode(calc_tokenizer, "4821*907", ["*\n", "4372647"])
    assert contexts[0] == "<|im_start|>user\n4821*907<|im_end|>\n<|im_start|>assistant\n"
    assert contexts[1] == (contexts[0] + "*\n<|im_end|>\n<|im_start|>user\n<tool_response>\n4372647\n"
                           "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert traj.meta["final_response"] == "4372647" and not traj.parts  # one trajectory, both turns
    assert stats["n_agent_turns"] == 2 and stats["n_tool_calls"] == 1
    # the operator decides the calculation: the wrong one gets the wrong result
    _, contexts, _ = episode(calc_tokenizer, "4821*907", ["+", "5728"])
    assert "<tool_response>\n5728\n</tool_response>" in contexts[1]
    # the reply's first character (after whitespace) is the call: what follows it is ignored
    _, contexts, stats = episode(calc_tokenizer, "4821*907", ["\n*4+", "4372647"])
    assert "<tool_response>\n4372647\n</tool_response>" in contexts[1] and stats["n_tool_calls"] == 1


def test_a_call_on_the_last_turn_leaves_no_answer_and_scores_0(calc_tokenizer):
    # '+24' after the result is another call, not an answer with a wrong first character: with max_turns 2
    # no turn is left for its answer, the calculator is not run and the episode scores 0 (the reward service,
    # which would score '+24' as an answer, is not asked)
    traj, contexts, stats = episode(calc_tokenizer, "4821*907", ["*", "+24"])
    assert len(contexts) == 2 and traj.reward == 0.0 and stats["n_tool_calls"] == 1
    # with a third turn the second call is served and the third reply answers
    traj, contexts, stats = episode(calc_tokenizer, "4821*907", ["+", "*", "4372647"], max_turns=3)
    assert "<tool_response>\n5728\n</tool_response>" in contexts[1]
    assert contexts[2].endswith("<tool_response>\n4372647\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert traj.meta["final_response"] == "4372647" and stats["n_tool_calls"] == 2 and traj.reward is None


def test_any_other_reply_is_the_final_answer(calc_tokenizer):
    for reply in ("4372647", "4*", "", "\n12"):
        traj, contexts, stats = episode(calc_tokenizer, "4821*907", [reply])
        assert len(contexts) == 1 and traj.meta["final_response"] == reply
        assert stats["n_agent_turns"] == 1 and stats["n_tool_calls"] == 0


def test_without_the_tool_an_operator_reply_gets_an_empty_response(calc_tokenizer):
    traj, contexts, stats = episode(calc_tokenizer, "4821*907", ["*", "4372647"], agent="calculator_off")
    assert contexts[1].endswith("<tool_response>\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert stats["n_tool_calls"] == 1 and traj.meta["final_response"] == "4372647"


def test_a_whole_episode_renders_without_unk(calc_tokenizer):
    hf = calc_tokenizer.hf
    messages = [{"role": "user", "content": "4821*907"}, {"role": "assistant", "content": "*"},
                {"role": "tool", "content": "4372647"}, {"role": "assistant", "content": "4372647\n"}]
    text = calc_tokenizer.render_chat(messages)
    ids = hf.encode(text, add_special_tokens=False)
    assert hf.unk_token_id not in ids and hf.decode(ids, skip_special_tokens=False) == text
    # every prompt of the data renders without <unk> too
    for path in ("configs/data/long_arithmetic_train.jsonl", "configs/data/long_arithmetic_eval.jsonl"):
        prompts = "".join(json.loads(x)["prompt"] for x in open(path))
        assert hf.unk_token_id not in hf.encode(prompts, add_special_tokens=False)


def test_the_diagnostic_agent_always_calls_with_the_problems_operator(calc_tokenizer):
    traj, contexts, stats = episode(calc_tokenizer, "82*61", ["5002"],
                                    agent="megarl.workflows.calculator:agent_always_calls")
    assert contexts == ["<|im_start|>user\n82*61<|im_end|>\n<|im_start|>assistant\n*<|im_end|>\n<|im_start|>user\n"
                        "<tool_response>\n5002\n</tool_response><|im_end|>\n<|im_start|>assistant\n"]
    assert traj.meta["final_response"] == "5002" and stats["n_agent_turns"] == 1


def test_the_guided_agent_forces_the_call_in_half_of_the_episodes(calc_tokenizer):
    from megarl.workflows.calculator import is_guided

    ids = [f"g{g}-{i}" for g in range(64) for i in range(16)]
    share = sum(map(is_guided, ids)) / len(ids)
    assert 0.45 < share < 0.55
    # about half of each group: a group's samples are compared with each other (GRPO)
    assert all(3 <= sum(is_guided(f"g{g}-{i}") for i in range(16)) <= 13 for g in range(64))
    forced = next(t for t in ids if is_guided(t))
    free = next(t for t in ids if not is_guided(t))
    _, contexts, stats = episode(calc_tokenizer, "82*61", ["5002"], agent="calculator_guided", traj_id=forced)
    assert contexts[0].endswith("<tool_response>\n5002\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert stats["n_tool_calls"] == 0  # the forced call is not the model's choice
    _, contexts, stats = episode(calc_tokenizer, "82*61", ["*", "5002"], agent="calculator_guided", traj_id=free)
    assert contexts[0] == "<|im_start|>user\n82*61<|im_end|>\n<|im_start|>assistant\n"
    assert stats["n_tool_calls"] == 1


def test_evaluation_runs_the_agent_eval_agent_fn_names(calc_tokenizer):
    """Training with the guided mix, evaluating the free agent: eval.agent_fn picks the evaluation's agent."""
    from megarl.builder import _eval_workflow, _workflow
    from megarl.builder import load_run_config as load_config
    from megarl.workflows import calculator

    cfg = load_config("configs/tiny_calc_agent_cpu.yaml", ["agent.fn=calculator_guided", "eval.agent_fn=calculator"])
    train, evaluation = _workflow(cfg, calc_tokenizer), _eval_workflow(cfg, calc_tokenizer)
    assert train.agent_fn is calculator.agent_guided and evaluation.agent_fn is calculator.agent
    default = load_config("configs/tiny_calc_agent_cpu.yaml", ["agent.fn=calculator_guided", "eval.agent_fn="])
    assert _eval_workflow(default, calc_tokenizer).agent_fn is calculator.agent_guided  # empty: agent.fn's
    # the shipped config trains with the tool bonus and evaluates the final answer alone
    shipped = load_config("configs/tiny_calc_agent_cpu.yaml", [])
    assert _workflow(shipped, calc_tokenizer).agent_fn is calculator.agent_tool_bonus
    assert _eval_workflow(shipped, calc_tokenizer).agent_fn is calculator.agent


def test_a_bad_eval_agent_fn_is_one_config_error(tmp_path):
    from megarl.builder import load_run_config as load_config
    from megarl.errors import ConfigError
    from megarl.preflight import load_inputs

    ckpt = write_tokenizer("configs/models/tiny_qwen3_calc.yaml", tmp_path / "ckpt")
    cfg = load_config("configs/tiny_calc_agent_cpu.yaml", [f"model.checkpoint={ckpt}", "eval.agent_fn=no.such:agent"])
    with pytest.raises(ConfigError, match="eval.agent_fn"):
        load_inputs(cfg, vocab_size=64)
    cfg = load_config("configs/tiny_cpu.yaml", [f"model.checkpoint={ckpt}", "eval.agent_fn=calculator",
                                                "data.path=configs/data/long_arithmetic_train.jsonl",
                                                "eval.path=configs/data/long_arithmetic_eval.jsonl"])
    with pytest.raises(ConfigError, match="needs rollout.workflow=agent"):
        load_inputs(cfg, vocab_size=64)


def test_the_tool_bonus_agent_scores_the_final_answer_plus_the_bonus_for_a_call(calc_tokenizer):
    from megarl.workflows.calculator import TOOL_BONUS

    def reward(replies, answer="5002"):
        limits = AgentLimits(SamplingParams(temperature=1.0, max_new_tokens=12), max_turns=2, max_tokens=96)
        wf = AgentWorkflow(load_agent("megarl.workflows.calculator:agent_tool_bonus"), calc_tokenizer, None, limits)
        traj = Trajectory("g0-0", "g0", [], meta={"row": {"prompt": "82*61", "answer": answer}}, logp_old=[])
        asyncio.run(wf.run(traj, Replay(calc_tokenizer, replies)))
        return traj.reward, wf.stats()["n_tool_calls"]

    assert TOOL_BONUS == 0.3
    assert reward(["*", "5002"]) == (pytest.approx(1.3), 1)  # called, then copied the result
    assert reward(["5002"]) == (1.0, 0)  # answered directly, right
    # called, then 2 of 4 digits at their place and the right length: 0.75 * 2/4 + 0.25 + the bonus
    assert reward(["*", "5112"]) == (pytest.approx(0.375 + 0.25 + 0.3), 1)
    # called with the other operator (the result, 143, is not the answer): no bonus
    assert reward(["+", "5112"]) == (pytest.approx(0.375 + 0.25), 1)
    assert reward(["17"]) == (pytest.approx(0.25 * 0.5), 0)  # direct: no digit right, half the length
    # a right call, then another call with no turn left: no answer, so no digits reward and no bonus
    assert reward(["*", "*5002"]) == (0.0, 1)
