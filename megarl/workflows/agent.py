"""Agent workflows: a user's ``async def agent(client, row) -> reward`` runs one episode per trajectory.

``agent.fn`` names the agent by a built-in name (:data:`BUILTIN_AGENTS`) or a
dotted path. It gets an :class:`megarl.agents.client.AgentClient` (an
OpenAI-style chat client whose completions are recorded token-exactly, with
per-token versions) and the data row (a dict: the prompt, the answer and every
other field; ``client.prompt`` is the prompt, from the field ``data.prompt_key``
names). It returns the episode's reward, or None to have the reward service
score its final assistant message (``reward.fn``).

Many agents run at once as asyncio tasks (the controller's groups); requests
in flight are bounded by ``rollout.max_concurrency``. An agent that raises,
goes past ``agent.max_turns`` or its token budget ends with reward 0 and its
error counted (``n_agent_failed``, the first error logged); the run goes on.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any

from megarl.agents.client import AgentClient, AgentLimits
from megarl.agents.tools import ToolService
from megarl.data import MISSING, get_dotted
from megarl.errors import ConfigError
from megarl.rewards import resolve_reward_fn
from megarl.types import NO_VERSION, Trajectory
from megarl.workflows.agent_failures import agent_name, in_process_help
from megarl.workflows.base import GenerateFn

log = logging.getLogger("megarl.agents")

BUILTIN_AGENTS: dict[str, str] = {"math_python": "megarl.workflows.math_python:agent",
                                   "calculator": "megarl.workflows.calculator:agent",
                                   "calculator_off": "megarl.workflows.calculator:agent_without_tool",
                                   "calculator_guided": "megarl.workflows.calculator:agent_guided",
                                   "calculator_bonus": "megarl.workflows.calculator:agent_tool_bonus"}


def load_agent(name: str, key: str = "agent.fn"):
    """The agent function ``name`` (built-in or dotted path); ConfigError (naming the config ``key``) unless
    it is an ``async def``."""
    fn = resolve_reward_fn(name, what=key, builtins=BUILTIN_AGENTS)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{key}={name!r} is not an async function: define it as "
                          f"`async def agent(client, row) -> float | None`")
    try:
        inspect.signature(fn).bind("client", "row")
    except TypeError:
        raise ConfigError(f"{key}={name!r} has signature {inspect.signature(fn)}; it must take "
                          f"(client, row)") from None
    return fn


class AgentWorkflow:
    """Runs ``agent_fn`` for one trajectory; counts turns, tool calls and failures (``stats``)."""

    def __init__(self, agent_fn, tokenizer: Any, tools: ToolService | None, limits: AgentLimits,
                 prompt_key: str = "prompt") -> None:
        if tools is not None and tools.names and not tokenizer.supports_tools():
            raise ConfigError(f"agent.tools={tools.names} but the chat template of {tokenizer.source} does not show "
                              f"tools to the model; use a tokenizer whose template supports tools, or no tools")
        self.agent_fn = agent_fn
        self.tokenizer = tokenizer
        self.tools = tools
        self.limits = limits
        self.prompt_key = prompt_key
        self._stats = {"n_agent_failed": 0, "n_agent_turns": 0, "n_tool_calls": 0, "n_tool_errors": 0,
                       "n_agent_new_trajectories": 0}
        self._logged_failure = False

    def client(self, traj: Trajectory, generate: GenerateFn) -> AgentClient:
        row = traj.meta.get("row") or {}
        prompt = get_dotted(row, self.prompt_key)
        return AgentClient(traj, generate, self.tokenizer, self.tools, self.limits,
                           prompt=None if prompt is MISSING else prompt)

    async def run(self, traj: Trajectory, generate: GenerateFn) -> Trajectory:
        client = self.client(traj, generate)
        row = dict(traj.meta.get("row") or {})
        try:
            reward = await self.agent_fn(client, row)
            if reward is not None:
                traj.reward = float(reward)
        except Exception as e:  # an agent's failure costs its episode, never the run
            self._stats["n_agent_failed"] += 1
            traj.meta["agent_error"] = _clip(f"{type(e).__name__}: {e}")
            traj.reward = 0.0
            if not self._logged_failure:  # once: a broken agent fails every episode the same way
                log.warning("agent episode %s failed (counted in n_agent_failed): %s", traj.traj_id,
                            traj.meta["agent_error"])
                self._logged_failure = True
        finally:
            await client.idle()  # an agent that raised may leave a completion running: its row is not done yet
            s = client.stats
            self._stats["n_agent_turns"] += s.n_turns
            self._stats["n_tool_calls"] += s.n_tool_calls
            self._stats["n_tool_errors"] += s.n_tool_errors
            self._stats["n_agent_new_trajectories"] += s.n_new_trajectories
        check_token_exact(traj, client.records)
        traj.meta["final_response"] = client.final_text
        last = traj.parts[-1] if traj.parts else traj
        traj.finish_reason = last.finish_reason or "stop"
        return traj

    def stats(self) -> dict[str, int]:
        """Totals since the start (the controller logs what each step added)."""
        return dict(self._stats)

    def failure_help(self, cause: str, n: int, example: str) -> str:
        """What failed ``n`` episodes (megarl/failure_causes.py ``cause``), ``example`` the last, and the fix."""
        return in_process_help(agent_name(self.agent_fn, BUILTIN_AGENTS), self.limits, cause, n, example)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()


def _clip(error: str, limit: int = 1000) -> str:
    """``error`` within ``limit`` characters, its start and its end kept (an agent command's error ends with the
    end of its stderr)."""
    return error if len(error) <= limit else f"{error[:200]} [...] {error[-(limit - 207):]}"


def check_token_exact(traj: Trajectory, records) -> None:
    """Every token of every training row is accounted for by the completions, in order: the row's prompt is its
    first completion's prompt; each completion's prompt and output ids, as the engine saw them, are a prefix of
    the row, its output marked as policy tokens (loss mask 1) of the versions that sampled them with their
    log-probs; the tokens between completions are template tokens (loss mask 0, no version); nothing follows
    the last completion. RuntimeError otherwise: a bug in megarl's agent client."""
    by_row: dict[str, list] = {r.traj_id: [] for r in traj.rows()}
    for i, rec in enumerate(records):
        by_row[rec.traj_id].append((i, rec))
    for row in traj.rows():
        tokens, n_row_prompt = row.tokens, len(row.prompt_ids)
        done = n_row_prompt  # tokens accounted for so far
        for k, (i, rec) in enumerate(by_row[row.traj_id]):
            n_prompt, n_out = len(rec.prompt_ids), len(rec.output_ids)
            gap = slice(done - n_row_prompt, n_prompt - n_row_prompt)  # template tokens, in response coordinates
            out = slice(n_prompt - n_row_prompt, n_prompt - n_row_prompt + n_out)
            if (n_prompt < done or (k == 0 and n_prompt != n_row_prompt) or tokens[:n_prompt] != rec.prompt_ids
                    or tokens[n_prompt:n_prompt + n_out] != rec.output_ids
                    or any(row.loss_mask[gap]) or any(v != NO_VERSION for v in row.versions[gap])
                    or row.versions[out] != rec.versions or row.logp_behav[out] != rec.logp_behav
                    or row.loss_mask[out] != [1] * n_out):
                raise RuntimeError(f"agent episode {traj.traj_id}: completion {i} is not recorded token-exactly in "
                                   f"{rec.traj_id} (a bug in megarl's agent client)")
            done = n_prompt + n_out
        if len(tokens) != done:
            raise RuntimeError(f"agent episode {traj.traj_id}: {len(tokens) - done} tokens of {row.traj_id} after "
                               f"its last completion are not recorded token-exactly (a bug in megarl's agent client)")
