"""Placement and launching: allocation -> validated plan -> per-role commands (torchrun, slurm, mpirun).

Light on purpose: nothing here imports torch, Megatron or vLLM at import time.
"""
from megarl.launch.cluster import Allocation, detect, expand_nodelist
from megarl.launch.placement import Plan, load_hf_config, resolve_plan
from megarl.launch.roles import current_role
from megarl.trainer.mpi_bootstrap import bootstrap_env_from_mpi

__all__ = ["Allocation", "Plan", "bootstrap_env_from_mpi", "current_role", "detect", "expand_nodelist",
           "load_hf_config", "resolve_plan"]
