"""Why episodes fail, and the errors that stop a run over it: each names what failed and the fix.

An episode's outcome fails for one of three causes (:class:`FailureWindow`):
its agent failed (an in-process agent raised, an agent command exited non-zero
or ran past a limit, an agent service did not report: ``n_agent_failed``), its
agent returned a non-finite reward, or the reward function failed to score it
(raised, ran past ``reward.timeout_s`` or ``reward.memory_mb``, crashed its
worker). When more than ``reward.max_fail_frac`` of the last batch's worth of
outcomes failed, the run stops with one failure of each cause and its fix: the
agent's failures as the workflow that ran it describes them
(``workflow.failure_help``: megarl/workflows/agent_failures.py), the reward
function's here. Reward-function hints appear only for the reward function's
own failures.

:func:`generation_failure` is the error of a run whose groups keep failing as
a whole (an engine refusing requests, a workflow raising).
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Any

from megarl.errors import AgentError, EngineError, InputError, RewardError, TrainingError

#: an episode's agent failed (it is counted in n_agent_failed)
AGENT = "agent"
#: an episode's agent returned a non-finite reward
AGENT_REWARD = "agent_reward"
#: the reward function failed to score an episode
REWARD = "reward"


class FailureWindow:
    """The causes of the last ``size`` outcomes (None: it did not fail) and the latest failure of each cause."""

    def __init__(self, size: int) -> None:
        self.recent: deque[str | None] = deque(maxlen=size)
        self.last: dict[str, str] = {}  # cause -> "trajectory <id>: <failure>"

    def add(self, cause: str | None, failure: str = "") -> None:
        self.recent.append(cause)
        if cause is not None:
            self.last[cause] = failure

    def error(self, step: int, cfg: Any, workflow: Any) -> TrainingError | None:
        """The error to stop with when more than reward.max_fail_frac of the window's outcomes failed, once the
        window is full (a step that happened to see one outcome, a failed one, is not a failing run)."""
        calls, counts = len(self.recent), Counter(c for c in self.recent if c is not None)
        failed, frac = sum(counts.values()), cfg.reward.max_fail_frac
        if calls < self.recent.maxlen or failed <= frac * calls:
            return None
        noun = "reward calls" if set(counts) == {REWARD} else "episodes"
        parts = [self._describe(cause, n, cfg, workflow) for cause, n in counts.most_common()]
        error = RewardError if counts.most_common(1)[0][0] == REWARD else AgentError
        return error(f"{failed} of {calls} {noun} failed at step {step} (more than reward.max_fail_frac={frac}): "
                     + " ".join(parts) + " Or raise reward.max_fail_frac to tolerate more failures.")

    def _describe(self, cause: str, n: int, cfg: Any, workflow: Any) -> str:
        example = self.last[cause]
        if cause == REWARD:
            return reward_help(cfg.reward, n, example)
        helper = getattr(workflow, "failure_help", None)
        if helper is not None:
            return helper(cause, n, example)
        what = "failed" if cause == AGENT else "gave a non-finite reward to"
        return (f"rollout.workflow={cfg.rollout.workflow!r} {what} {n} of them; the last: {example}. Its first "
                f"failure is logged: fix the workflow.")


def reward_help(reward_cfg: Any, n: int, example: str) -> str:
    """What failed when reward.fn failed ``n`` outcomes (``example`` one of them, as the reward service reports
    it: ``trajectory <id>: <kind>: <message>``), and the fix its kind points at."""
    kind = example.split(": ", 2)[1] if example.count(": ") >= 2 else ""
    fix = {"timeout": f"It ran past reward.timeout_s={reward_cfg.timeout_s:g}s: make it faster, or raise "
                      f"reward.timeout_s.",
           "memory": f"It used more than reward.memory_mb={reward_cfg.memory_mb}: make it use less, or raise "
                     f"reward.memory_mb.",
           "crash": "It ended its worker process (a crash in native code, os._exit): fix the reward function."}
    return (f"reward.fn={reward_cfg.fn!r} failed to score {n} of them; the last: {example}. "
            + fix.get(kind, "Fix the reward function or the data (data.answer_key names the answer field)."))


def generation_failure(n_groups: int, error: BaseException, workflow: str) -> TrainingError:
    """The error of a run whose last ``n_groups`` groups each failed as a whole, ``error`` the last one's."""
    if isinstance(error, InputError):
        fix = ("an engine refused the requests as invalid: fix the data or the setting the error names (a prompt "
               "and rollout.max_new_tokens must fit the model's context)")
    elif isinstance(error, EngineError):
        fix = "the engines failed: the error and the engines' logs say why"
    else:
        fix = (f"rollout.workflow={workflow!r} raised: each group's traceback is logged with 'group ... failed; "
               f"its samples are dropped'")
    return TrainingError(f"{n_groups} groups in a row failed in generation; the last with "
                         f"{type(error).__name__}: {error}. Cause: {fix}")
