"""Reward functions and the RewardService's failure handling.

Workers are real processes: the fixtures in reward_fixtures.py raise, hang,
allocate 2 GiB or call os._exit, and the service must mark the sample failed,
count it, and keep serving.
"""
import asyncio
import logging
import math
import sys
import time
from pathlib import Path

import pytest

# reward_fixtures lives beside this file; the service hands sys.path to its workers
sys.path.insert(0, str(Path(__file__).resolve().parent))

from megarl.errors import ConfigError  # noqa: E402
from megarl.rewards import BUILTIN_REWARDS, register_reward, resolve_reward_fn  # noqa: E402
from megarl.rewards.code import code_reward, run_sandboxed  # noqa: E402
from megarl.rewards.math import math_reward  # noqa: E402
from megarl.rewards.service import RewardService  # noqa: E402
from megarl.types import RewardInput  # noqa: E402

MISBEHAVE = "reward_fixtures:misbehave"


def run(coro):
    return asyncio.run(coro)


def R(response: str, answer=None, **info) -> RewardInput:
    return RewardInput(response=response, answer=answer, **info)


async def score_all(service, samples):
    return await asyncio.gather(*(service.score(R(text, mode)) for text, mode in samples))


@pytest.fixture(scope="module")
def service():
    with RewardService(MISBEHAVE, n_workers=2, timeout_s=1.0, memory_mb=256) as s:
        yield s


# -- names and resolution ---------------------------------------------------------
def test_builtins_resolve():
    for name in BUILTIN_REWARDS:
        assert callable(resolve_reward_fn(name))
    assert resolve_reward_fn("reward_fixtures.misbehave") is resolve_reward_fn(MISBEHAVE)


@pytest.mark.parametrize("path, match", [
    ("no_such_pkg.mod:fn", r"'no_such_pkg.mod:fn'.*cannot import module 'no_such_pkg.mod'.*No module named"),
    ("reward_fixtures:nope", r"has no attribute 'nope'"),
    ("reward_fixtures:time", r"'reward_fixtures:time' is not callable"),
    ("nodots", r"neither a built-in"),
])
def test_bad_path_is_a_config_error(path, match):
    with pytest.raises(ConfigError, match=match):
        resolve_reward_fn(path)


def test_service_validates_before_starting_workers():
    with pytest.raises(ConfigError, match="no_such_pkg"):
        RewardService("no_such_pkg:fn")
    with pytest.raises(ConfigError, match=r"'reward_fixtures:no_answer' has signature \(response.*"
                                          r"must take \(response: str, answer, \*\*info\)"):
        RewardService("reward_fixtures:no_answer")
    with pytest.raises(ConfigError, match="on_failure"):
        RewardService("reverse_digits", on_failure="ignore")


def test_register_refuses_duplicates():
    with pytest.raises(ConfigError, match="already registered"):
        register_reward("math", "x.y:z")


# -- the service ---------------------------------------------------------------------
def test_reverse_digits_through_the_service():
    with RewardService("reverse_digits", n_workers=1) as s:
        perfect = run(s.score(R("765", "765", finish_reason="stop")))
        no_eos = run(s.score(R("765", "765", finish_reason="length")))
        assert s.stats["n_ok"] == 2
    assert perfect.reward == 1.0 and not perfect.failed and perfect.reason is None
    assert no_eos.reward == 0.75


def test_info_reaches_the_reward_by_name():
    with RewardService("reward_fixtures:echo_info", n_workers=1) as s:
        every = run(s.score(R("ab", "x", prompt="P", row={"level": 3}, finish_reason="length",
                              response_ids=[1, 2], prompt_ids=[9])))
    with RewardService("reward_fixtures:only_prompt", n_workers=1) as s:
        named = run(s.score(R("ab", "x", prompt="PPP", row={"level": 3})))
    assert (every.reward, every.failed) == (7.0, False), every.reason
    assert (named.reward, named.failed) == (3.0, False), named.reason


@pytest.mark.parametrize("mode, stat, reason", [
    ("raise", "n_failed_raise", "RuntimeError: reward fixture raised on purpose"),
    ("hang", "n_failed_timeout", "timeout_s=1.0"),
    ("alloc", "n_failed_memory", "MemoryError"),
    ("exit", "n_failed_crash", "exited with code 7"),
])
def test_failures_are_marked_counted_and_survived(service, caplog, mode, stat, reason):
    before = dict(service.stats)
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.service"):
        failed = run(service.score(R("ab", mode)))
    # on_failure="zero": reward 0.0, marked failed, kept in its group
    assert (failed.reward, failed.failed, failed.drop) == (0.0, True, False)
    assert reason in failed.reason
    assert reason in caplog.text
    assert service.stats[stat] == before[stat] + 1
    # and the service keeps serving, on every worker
    after = run(score_all(service, [("abc", "ok")] * 4))
    assert [o.reward for o in after] == [3.0] * 4 and not any(o.failed for o in after)
    assert service.stats["n_ok"] == before["n_ok"] + 4


def test_a_hanging_reward_does_not_block_the_others(service):
    done = []

    async def scored(mode):
        outcome = await service.score(R("a", mode))
        done.append(mode)
        return outcome

    async def main():
        return await asyncio.gather(scored("hang"), *(scored("ok") for _ in range(5)))

    t0 = time.monotonic()
    outcomes = run(main())
    assert outcomes[0].failed and all(o.reward == 1.0 for o in outcomes[1:])
    assert done[-1] == "hang"  # the five others went through the second worker meanwhile
    assert time.monotonic() - t0 < 5.0


def test_on_failure_drop():
    with RewardService(MISBEHAVE, n_workers=1, on_failure="drop") as s:
        dropped = run(s.score(R("a", "raise")))
        kept = run(s.score(R("a", "ok")))
    # drop: failed and flagged; NaN so a controller that forgot to drop it fails loudly
    assert dropped.failed and dropped.drop and math.isnan(dropped.reward)
    assert "RuntimeError" in dropped.reason
    assert (kept.reward, kept.failed, kept.drop) == (1.0, False, False)


def test_closed_service():
    s = RewardService("reverse_digits", n_workers=1)
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        run(s.score(R("1", "1")))


# -- math ----------------------------------------------------------------------------
@pytest.mark.parametrize("answer, text, expected", [
    ("\\frac{1}{2}", "0.5", 1.0),
    ("\\frac{1}{2}", "The answer is $\\boxed{\\frac{2}{4}}$", 1.0),
    ("0.5", "$\\frac12$", 1.0),
    ("\\frac{1}{2}", "0.25", 0.0),
    ("42", "Adding them up gives 42.", 1.0),  # a plain final answer
    ("42", "\\boxed{41}", 0.0),
    ("42", "", 0.0),
])
def test_math_equivalence(answer, text, expected):
    assert math_reward(text, answer) == expected


GSM8K_EGGS = ("Janet's ducks lay 16 eggs per day. She eats 3 and bakes with 4, so she sells 16 - 3 - 4 = 9 eggs.\n"
              "At $2 per egg she makes 9 * 2 = $18 every day.\n#### 18")

#: model responses as they come, with the score a careful grader gives each (written by hand): the final
#: answer is the last \\boxed{} (or \\fbox{}), else the number after the last ``####``, else the response's
MATH_RESPONSES = [
    ("8", "First I get \\boxed{5}. No wait, I forgot the carry: \\boxed{8}", 1.0),
    ("5", "First I get \\boxed{5}. No wait, I forgot the carry: \\boxed{8}", 0.0),
    ("9", "Is it \\boxed{8} or \\boxed{9}? Checking again, it is \\boxed{9}.", 1.0),
    ("\\frac{1}{3}", "So \\boxed{\\frac{1}{2}} is wrong, the right one is \\boxed{\\frac{1}{3}}.", 1.0),
    ("8", "So 3 + 5 = 8.\n#### 8\nThat took 2 steps.", 1.0),
    ("8", "#### 8 apples, since 4 + 4 = 8 and 2 were not counted", 1.0),
    ("18", GSM8K_EGGS, 1.0),
    ("72", "Natalia sold 48/2 = 24 clips in May.\nShe sold 48 + 24 = 72 clips in April and May.\n#### 72", 1.0),
    ("1234", "The total is 1,000 + 234.\n#### 1,234", 1.0),
    ("7", "#### 8\nso 7 is not it", 0.0),
    ("\\frac{1}{2}", "The probability is $\\boxed{\\frac{1}{2}}$.", 1.0),
    ("\\frac{1}{2}", "Half of the cases: 0.5", 1.0),
    ("3", "x = 2 fails, x = 3 works.\n\nFinal answer: \\boxed{3}", 1.0),
    ("2\\sqrt{3}", "The side is \\boxed{\\sqrt{12}}", 1.0),
    ("10", "The answer is \\boxed{10}. Check: 10 - 3 = 7", 1.0),
    ("-5", "The smaller root is \\boxed{-5}", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\dfrac{3}{4}}", 1.0),
    ("(1, 2)", "The interval is \\boxed{(1,2)}", 1.0),
    ("\\frac{\\pi}{2}", "The angle is $\\boxed{\\frac{\\pi}{2}}$ radians.", 1.0),
    ("12", "\\fbox{12}", 1.0),
    ("8", "I think it is \\boxed{8", 0.0),  # cut off inside the box: no final answer
    ("42", "I am not sure how to solve this.", 0.0),
    ("42", "Adding them up gives 42.", 1.0),
    ("42", "", 0.0),
]


@pytest.mark.parametrize("answer, text, expected", MATH_RESPONSES)
def test_math_final_answer_of_real_responses(answer, text, expected):
    assert math_reward(text, answer) == expected


def test_math_needs_a_ground_truth():
    with pytest.raises(ValueError, match="ground truth"):
        math_reward("1", None)
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        math_reward("1", "\\")


# -- code ----------------------------------------------------------------------------
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


@pytest.mark.parametrize("text, expected", [
    ("def add(a, b):\n    return a + b\n", 1.0),
    ("Sure:\n```python\ndef add(a, b):\n    return a + b\n```\n", 1.0),
    ("def add(a, b):\n    return a + b if a > 0 else 99\n", 0.5),  # add(1, 2) passes, add(-1, 1) fails
    ("def add(a, b):\n    while True:\n        pass\n", 0.0),
    ("import os\nos._exit(0)\n", 0.0),  # exiting cleanly is not passing
    ("print('PASS 0')\nprint('PASS 1')\n", 0.0),  # nor is printing what looks like a pass
    ("def add(a, b:\n", 0.0),
])
def test_code_sandbox(text, expected):
    assert code_reward(text, ADD_TESTS, row={"time_limit_s": 1.0}) == expected
    assert code_reward(text, None, row={"tests": ADD_TESTS, "time_limit_s": 1.0}) == expected


def test_code_sandbox_limits():
    hog = run_sandboxed("x = bytearray(1 << 30)", ["pass"], memory_mb=256)
    assert hog.n_passed == 0 and "MemoryError" in hog.stderr_tail
    loop = run_sandboxed("while True: pass", ["pass"], time_limit_s=0.5)
    assert loop.timed_out and loop.n_passed == 0
    fresh = run_sandboxed("import os", ["assert os.path.basename(os.getcwd()).startswith('megarl-code-')",
                                        "assert 'solution.py' in os.listdir('.')",
                                        "assert os.environ.get('HTTP_PROXY') is None"])
    assert fresh.n_passed == 3


def test_code_sandbox_has_no_network():
    result = run_sandboxed("import socket", ["assert [n for _, n in socket.if_nameindex()] == ['lo']"])
    assert result.n_passed == 1


def test_code_through_the_service():
    with RewardService("code", n_workers=1, timeout_s=10.0) as s:
        outcome = run(s.score(R("def add(a, b):\n    return a + b", ADD_TESTS)))
    assert outcome.reward == 1.0 and not outcome.failed


def test_cancelled_call_replaces_its_worker(service):
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(service.score(R("a", "hang")), 0.2)
        return await score_all(service, [("ab", "ok")] * 3)

    assert [o.reward for o in run(main())] == [2.0] * 3
