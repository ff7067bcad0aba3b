"""Rollout workflows: how a trajectory's turns are generated (see ``base.py``)."""
from __future__ import annotations

from megarl.workflows.base import GenerateFn, ToolEnv, Workflow, append_turn
from megarl.workflows.multi_turn import MultiTurnWorkflow
from megarl.workflows.registry import TOOL_ENVS, WORKFLOWS, build_workflow, sampling_from_config
from megarl.workflows.single_turn import SingleTurnWorkflow
from megarl.workflows.tool_env import DigitCountEnv

__all__ = ["DigitCountEnv", "GenerateFn", "MultiTurnWorkflow", "SingleTurnWorkflow", "TOOL_ENVS", "ToolEnv",
           "WORKFLOWS", "Workflow", "append_turn", "build_workflow", "sampling_from_config"]
