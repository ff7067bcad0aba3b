"""Workflows and tool environments by config name."""
from __future__ import annotations

import inspect
from typing import Any, Callable

from megarl.errors import ConfigError
from megarl.tasks import TASKS, get_task
from megarl.types import SamplingParams
from megarl.workflows.base import ToolEnv, Workflow
from megarl.workflows.multi_turn import MultiTurnWorkflow
from megarl.workflows.single_turn import SingleTurnWorkflow
from megarl.workflows.tool_env import DigitCountEnv

TOOL_ENVS: dict[str, Callable[[], ToolEnv]] = {"digit_count": DigitCountEnv}


def sampling_from_config(cfg: Any) -> SamplingParams:
    """Sampling settings of ``cfg.rollout``; a built-in task adds its stop tokens (e.g. EOS)."""
    ro = cfg.rollout
    data = cfg.data
    stop: list[int] = []
    if not data.path and not data.hf_dataset and data.task in TASKS:
        stop = list(getattr(get_task(data.task), "STOP_TOKEN_IDS", ()))
    return SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                          max_new_tokens=ro.max_new_tokens, stop_token_ids=stop)


def _single_turn(cfg: Any) -> Workflow:
    return SingleTurnWorkflow(sampling_from_config(cfg))


def _multi_turn(cfg: Any, env: str | ToolEnv = "digit_count", max_turns: int = 4,
                max_response_len: int | None = None) -> Workflow:
    if isinstance(env, str):
        if env not in TOOL_ENVS:
            raise ConfigError(f"unknown tool environment {env!r}; choose one of {sorted(TOOL_ENVS)}")
        env = TOOL_ENVS[env]()
    return MultiTurnWorkflow(sampling_from_config(cfg), env, max_turns=max_turns, max_response_len=max_response_len)


WORKFLOWS: dict[str, Callable[..., Workflow]] = {"single_turn": _single_turn, "multi_turn": _multi_turn}


def build_workflow(name: str, cfg: Any, **options: Any) -> Workflow:
    """The workflow ``name`` for config ``cfg`` (``options``: multi_turn's env, max_turns, max_response_len)."""
    if name not in WORKFLOWS:
        raise ConfigError(f"unknown workflow {name!r}; choose one of {sorted(WORKFLOWS)}")
    factory = WORKFLOWS[name]
    try:
        inspect.signature(factory).bind(cfg, **options)
    except TypeError as e:  # an option this workflow does not take
        raise ConfigError(f"workflow {name!r}: {e}") from None
    return factory(cfg, **options)
