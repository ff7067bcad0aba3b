"""The checks ``megarl train`` runs on the `agent` section before it starts anything (megarl/preflight.py).

They cover both agent workflows: an in-process agent function (megarl/workflows/agent.py) and a command or
agent service in another process (megarl/workflows/agent_http.py, which builds on agent.py), so they live
beside both rather than in either.
"""
from __future__ import annotations

from typing import Any

from megarl.agents.tools import BUILTIN_TOOLS, tool_schema
from megarl.errors import ConfigError
from megarl.rewards import resolve_reward_fn
from megarl.workflows.agent import load_agent
from megarl.workflows.agent_http import agent_source


def check_agent_config(agent_cfg: Any, tokenizer: Any, http: bool = False) -> None:
    """What ``build_workflow("agent", ...)`` would refuse, checked before the run starts anything: the agent
    function (``http``: the agent_http workflow's command), a chat template, every tool (importable, with a
    describable signature) and the template's tool support."""
    if not tokenizer.use_template:  # an agent's conversation is rendered with it, every turn
        raise ConfigError(f"rollout.workflow=agent needs a chat template: the tokenizer in {tokenizer.source} has none "
                          f"or data.apply_chat_template=false; use a tokenizer with a chat template and "
                          f"data.apply_chat_template=auto or true")
    if http:
        agent_source(agent_cfg)
        if agent_cfg.tools:
            raise ConfigError(f"agent.tools={list(agent_cfg.tools)}: megarl runs these for rollout.workflow=agent; "
                              f"an agent_http command runs its own tools (it sends their schemas as tools=); "
                              f"set agent.tools=[]")
    else:
        load_agent(agent_cfg.fn)
    if agent_cfg.max_turns < 1:
        raise ConfigError(f"agent.max_turns={agent_cfg.max_turns} must be >= 1")
    for entry in agent_cfg.tools:
        path = BUILTIN_TOOLS.get(entry, entry)
        tool_schema(entry, resolve_reward_fn(path))
    if agent_cfg.tools and not tokenizer.supports_tools():
        raise ConfigError(f"agent.tools={list(agent_cfg.tools)} but the chat template of {tokenizer.source} does not "
                          f"show tools to the model; use a tokenizer whose template supports tools, or no tools")
    if agent_cfg.max_tokens > tokenizer.model_max_len:
        raise ConfigError(f"agent.max_tokens={agent_cfg.max_tokens} is more than the model's max_position_embeddings "
                          f"{tokenizer.model_max_len}")
