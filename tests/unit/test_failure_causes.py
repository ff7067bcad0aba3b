"""When more than reward.max_fail_frac of the last batch's episodes fail, the run stops with an error that names
what failed (an agent command, an in-process agent, the reward function), shows one failure and gives the fix.

The controller is the real one, driven by test_controller_outcomes.py's loop (simulated engine and trainer);
agent commands run as real isolated processes.
"""
import sys

import pytest
from test_controller_outcomes import ScriptedRewards, agent_workflow, loop

from megarl.agents.client import AgentLimits
from megarl.errors import TrainingError
from megarl.types import SamplingParams
from megarl.workflows.agent_http import AgentHttpWorkflow

LIMITS = AgentLimits(SamplingParams(max_new_tokens=8), max_turns=2, max_tokens=512)


def stop_message(overrides=(), **kw) -> str:
    with pytest.raises(TrainingError) as e:
        loop(list(overrides), **kw)
    return str(e.value)


def test_failing_agent_commands_stop_the_run_naming_the_command_its_stderr_and_the_fix(text_tokenizer):
    argv = [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(1)"]
    msg = stop_message(workflow=AgentHttpWorkflow(argv, text_tokenizer, LIMITS, timeout_s=30.0))
    assert " episodes failed at step " in msg and "reward.max_fail_frac=0.5" in msg
    assert "agent.command" in msg and "sys.exit(1)" in msg  # which command
    assert "exited with status 1: boom" in msg  # how it failed: its status and the end of its stderr
    assert "on stdin" in msg and "agent.timeout_s" in msg and "agent.command_memory_mb" in msg  # the fix
    assert "reward.fn" not in msg and "reward function" not in msg and "data.answer_key" not in msg


def test_agent_commands_past_agent_timeout_s_are_told_to_raise_it(text_tokenizer):
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    msg = stop_message(["trainer.batch_size=4", "rollout.group_size=4"],
                       workflow=AgentHttpWorkflow(argv, text_tokenizer, LIMITS, timeout_s=0.5))
    assert "ran past agent.timeout_s=0.5s" in msg and "raise agent.timeout_s" in msg and "reward.fn" not in msg


def test_failing_in_process_agents_stop_the_run_naming_the_agent_not_the_reward(text_tokenizer):
    msg = stop_message(workflow=agent_workflow("raises_after_one_turn", text_tokenizer))
    assert "agent.fn='agent_fixtures:raises_after_one_turn'" in msg and "RuntimeError: the agent broke" in msg
    assert "Fix the agent" in msg and "reward.fn" not in msg and "data.answer_key" not in msg


def test_non_finite_rewards_returned_by_agents_name_the_agent(text_tokenizer):
    import agent_fixtures

    agent_fixtures._episodes["n"] = 0
    msg = stop_message(["reward.max_fail_frac=0.2"], workflow=agent_workflow("one_in_four_nan", text_tokenizer))
    assert "returned a non-finite reward" in msg and "agent.fn='agent_fixtures:one_in_four_nan'" in msg
    assert "reward.fn" not in msg


def test_a_failing_reward_function_names_the_reward_function_and_no_agent():
    msg = stop_message(rewards=ScriptedRewards(lambda t: None))
    assert "reward calls failed" in msg and "reward.fn='reverse_digits'" in msg
    assert "ValueError: no tests for this row" in msg and "data.answer_key" in msg
    assert "agent" not in msg


def test_a_reward_function_past_its_time_limit_is_told_to_raise_reward_timeout_s():
    class Slow(ScriptedRewards):
        async def score(self, traj):
            out = await super().score(traj)
            out.reason = "timeout: exceeded 10.0s"
            return out

    msg = stop_message(rewards=Slow(lambda t: None))
    assert "reward.fn='reverse_digits'" in msg and "raise reward.timeout_s" in msg and "agent" not in msg


def test_a_window_of_mixed_failures_names_each_cause_with_its_count_and_fix():
    from types import SimpleNamespace

    from megarl.errors import AgentError, RewardError
    from megarl.failure_causes import AGENT, REWARD, FailureWindow
    from megarl.workflows.agent_http import AgentHttpWorkflow

    cfg = SimpleNamespace(reward=SimpleNamespace(fn="math", max_fail_frac=0.5, timeout_s=10.0, memory_mb=1024),
                          rollout=SimpleNamespace(workflow="agent_http"))
    workflow = SimpleNamespace(failure_help=lambda cause, n, example: AgentHttpWorkflow.failure_help(
        SimpleNamespace(argv=["python", "agent.py"], timeout_s=300.0, limits=LIMITS), cause, n, example))
    window = FailureWindow(8)
    budget = "trajectory g1-0: AgentCommandError: AgentLimitError: agent.max_turns=2 completions were used"
    for cause, failure in [(None, ""), (AGENT, budget), (REWARD, "trajectory g1-1: memory: MemoryError"),
                           (AGENT, budget), (None, ""), (None, ""), (REWARD, "trajectory g2-0: memory: x")]:
        window.add(cause, failure)
    assert window.error(3, cfg, workflow) is None  # 7 outcomes: the window of 8 is not full yet
    window.add(None)
    assert window.error(3, cfg, workflow) is None  # 4 of 8 failed: not more than half
    window.add(AGENT, budget)  # the oldest outcome (a success) leaves the window: 5 of 8
    err = window.error(3, cfg, workflow)
    msg = str(err)
    assert isinstance(err, AgentError) and msg.startswith("5 of 8 episodes failed at step 3")
    agent_part, reward_part = msg.split("agent command `python agent.py` (agent.command) failed 3 of them")[1].split(
        "reward.fn='math' failed to score 2 of them")
    assert "raise agent.max_turns / agent.max_tokens" in agent_part and "reward" not in agent_part
    assert "trajectory g2-0: memory: x" in reward_part and "raise reward.memory_mb" in reward_part
    reward_only = FailureWindow(2)
    reward_only.add(REWARD, "trajectory g0-0: crash: exit code -11")
    reward_only.add(REWARD, "trajectory g0-1: crash: exit code -11")
    err = reward_only.error(0, cfg, workflow)
    assert isinstance(err, RewardError) and str(err).startswith("2 of 2 reward calls failed at step 0")
    assert "ended its worker process" in str(err) and "agent" not in str(err)
