"""What a run stopped by failing agents says about them (megarl/failure_causes.py): which agent failed (agent.fn,
agent.command or the agent service), its last failure as the episode recorded it (an agent command's carries
its exit status and the end of its stderr) and the fix that failure points at."""
from __future__ import annotations

import shlex
from typing import Any

from megarl.failure_causes import AGENT_REWARD

#: where an agent command runs (megarl/workflows/agent_http.py), for failures that name no limit
COMMAND_SANDBOX = ("It runs with the filesystem read-only except its own /tmp (agent.command_writable adds "
                   "directories), a network that reaches only megarl's endpoint (agent.command_network=host for "
                   "the internet), the limits agent.command_memory_mb, agent.command_cpu_s and "
                   "agent.command_open_files, and agent.timeout_s per episode.")


def agent_name(fn: Any, builtins: dict[str, str]) -> str:
    """``fn`` as agent.fn names it: a built-in name, else pkg.mod:function."""
    path = f"{fn.__module__}:{fn.__qualname__}"
    return next((name for name, target in builtins.items() if target == path), path)


def budget_fix(example: str, limits: Any) -> str | None:
    """The fix of an episode that went past its completions or tokens; None for any other failure."""
    if "AgentLimitError" not in example:
        return None
    return (f"An episode may ask for agent.max_turns={limits.max_turns} completions of agent.max_tokens="
            f"{limits.max_tokens} tokens in all: have the agent stop sooner, or raise agent.max_turns / "
            f"agent.max_tokens.")


def in_process_help(name: str, limits: Any, cause: str, n: int, example: str) -> str:
    """An ``async def agent(client, row)`` (rollout.workflow=agent) that failed ``n`` episodes."""
    if cause == AGENT_REWARD:
        return (f"the agent agent.fn={name!r} returned a non-finite reward on {n} of them; the last: {example}. "
                f"Return a finite number (or None: its final answer is then scored).")
    return (f"the agent agent.fn={name!r} failed {n} of them (n_agent_failed); the last: {example}. "
            + (budget_fix(example, limits) or "Fix the agent: its first failure is logged as 'agent episode ... "
                                              "failed', and a run of a few rows reproduces it."))


def command_help(argv: list[str], timeout_s: float, limits: Any, n: int, example: str) -> str:
    """An agent command (agent.command) that failed ``n`` episodes, ``limits`` its episodes' AgentLimits."""
    command = shlex.join(argv)
    if "past agent.timeout_s" in example:
        fix = f"It ran past agent.timeout_s={timeout_s:g}s: make the agent finish sooner, or raise agent.timeout_s."
    elif "agent.command_memory_mb" in example or "agent.command_cpu_s" in example:
        fix = ("It went past the limit named above: make it use less, or raise agent.command_memory_mb / "
               "agent.command_cpu_s (0 = no limit).")
    elif "printed nothing" in example:
        fix = "Its last line of stdout must be the final answer or {\"reward\": r}."
    else:
        fix = budget_fix(example, limits) or (
            f"Run it by hand with one data row as JSON on stdin (e.g. `head -n 1 ROWS.jsonl | {command}`, with "
            f"OPENAI_BASE_URL and OPENAI_API_KEY set for an OpenAI-compatible server) to see it fail.")
    end = "\n" if "\n" in example else " "  # a stderr of several lines ends on a line of its own
    return (f"the agent command `{command}` (agent.command) failed {n} of them (n_agent_failed); the last: "
            f"{example}.{end}{fix} {COMMAND_SANDBOX}")


def service_help(timeout_s: float, limits: Any, n: int, example: str) -> str:
    """The agent service (agent.serve) that failed ``n`` episodes."""
    return (f"the agent service (agent.serve=true) failed {n} of them (n_agent_failed); the last: {example}. "
            + (budget_fix(example, limits) or
               f"It must claim each episode (POST /sessions) and end it (POST /sessions/<key>/reward) within "
               f"agent.timeout_s={timeout_s:g}s: check that it runs and read its log, or raise agent.timeout_s."))
