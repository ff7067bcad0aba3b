"""Workflows and tool environments by config name."""
from __future__ import annotations

import inspect
from typing import Any, Callable

from megarl.agents.client import AgentLimits
from megarl.agents.tools import ToolService
from megarl.errors import ConfigError
from megarl.types import SamplingParams
from megarl.workflows.agent import AgentWorkflow, load_agent
from megarl.workflows.agent_http import AgentHttpWorkflow, CommandLimits, agent_source
from megarl.workflows.base import ToolEnv, Workflow
from megarl.workflows.multi_turn import MultiTurnWorkflow
from megarl.workflows.single_turn import SingleTurnWorkflow
from megarl.workflows.tool_env import DigitCountEnv

#: tool environments by name; each is built with the run's tokenizer (megarl/tokenizer.py)
TOOL_ENVS: dict[str, Callable[[Any], ToolEnv]] = {"digit_count": DigitCountEnv}


def sampling_from_config(cfg: Any, stop_token_ids: list[int]) -> SamplingParams:
    """Sampling settings of ``cfg.rollout``, stopping at ``stop_token_ids`` (the run tokenizer's stop ids)."""
    ro = cfg.rollout
    return SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                          max_new_tokens=ro.max_new_tokens, stop_token_ids=list(stop_token_ids))


def _single_turn(cfg: Any, tokenizer: Any) -> Workflow:
    return SingleTurnWorkflow(sampling_from_config(cfg, tokenizer.stop_token_ids))


def _multi_turn(cfg: Any, tokenizer: Any, env: str | ToolEnv = "digit_count", max_turns: int = 4,
                max_response_len: int | None = None) -> Workflow:
    if isinstance(env, str):
        if env not in TOOL_ENVS:
            raise ConfigError(f"unknown tool environment {env!r}; choose one of {sorted(TOOL_ENVS)}")
        env = TOOL_ENVS[env](tokenizer)
    return MultiTurnWorkflow(sampling_from_config(cfg, tokenizer.stop_token_ids), env, max_turns=max_turns,
                             max_response_len=max_response_len)


def _agent_limits(cfg: Any, tokenizer: Any) -> AgentLimits:
    a = cfg.agent
    if a.max_turns < 1:
        raise ConfigError(f"agent.max_turns={a.max_turns} must be >= 1")
    return AgentLimits(sampling_from_config(cfg, tokenizer.stop_token_ids), max_turns=a.max_turns,
                       max_tokens=a.max_tokens or tokenizer.model_max_len, turns=a.turns)


def _agent(cfg: Any, tokenizer: Any) -> Workflow:
    a, limits = cfg.agent, _agent_limits(cfg, tokenizer)
    fn = load_agent(a.fn)
    tools = ToolService(a.tools, timeout_s=a.tool_timeout_s, memory_mb=a.tool_memory_mb,
                        n_workers=a.n_tool_workers) if a.tools else None
    try:
        return AgentWorkflow(fn, tokenizer, tools, limits, prompt_key=cfg.data.prompt_key)
    except Exception:
        if tools is not None:
            tools.close()
        raise


def _agent_http(cfg: Any, tokenizer: Any) -> Workflow:
    a = cfg.agent
    argv, service_key = agent_source(a)
    return AgentHttpWorkflow(argv, tokenizer, _agent_limits(cfg, tokenizer), host=a.http_host, port=a.http_port,
                             timeout_s=a.timeout_s, max_concurrency=cfg.rollout.max_concurrency,
                             service_key=service_key, command_limits=CommandLimits.from_config(a),
                             strict_model_name=a.strict_model_name)


WORKFLOWS: dict[str, Callable[..., Workflow]] = {"single_turn": _single_turn, "multi_turn": _multi_turn,
                                                 "agent": _agent, "agent_http": _agent_http}


def build_workflow(name: str, cfg: Any, tokenizer: Any, **options: Any) -> Workflow:
    """The workflow ``name`` for config ``cfg`` (``options``: multi_turn's env, max_turns, max_response_len)."""
    if name not in WORKFLOWS:
        raise ConfigError(f"unknown workflow {name!r}; choose one of {sorted(WORKFLOWS)}")
    factory = WORKFLOWS[name]
    try:
        inspect.signature(factory).bind(cfg, tokenizer, **options)
    except TypeError as e:  # an option this workflow does not take
        raise ConfigError(f"workflow {name!r}: {e}") from None
    return factory(cfg, tokenizer, **options)
