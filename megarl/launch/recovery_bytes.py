"""Which recovery strategies hold parameter copies, and in what dtype and place: the facts both the memory plan
(megarl/launch/memory.py) and the cost model (megarl/launch/cost.py) price, kept here so neither imports the
other."""

from __future__ import annotations

from typing import Any

#: strategies that swap other parameters into the trainer for a forward (trainer.use_params)
SWAPPING = ("ewma", "snapshot", "interrupt_sync")
FP32 = 4


def recovery_option(cfg, strategy: str, key: str, default: Any) -> Any:
    """``recovery.<strategy>.<key>`` of ``cfg`` (a dict from YAML or the strategy's config object), ``default``
    when the config has no such section or value."""
    opt = cfg.recovery.options.get(strategy)
    value = opt.get(key) if isinstance(opt, dict) else getattr(opt, key, None)
    return default if value in (None, "") else value


def ewma_phi(cfg) -> tuple[int, bool]:
    """(bytes per parameter of ewma's phi, whether it lives on the trainer's GPU) under ``cfg``: the forward's
    dtype unless ``recovery.ewma.phi_dtype=float32`` (recovery/ewma.py), ``recovery.ewma.phi_on_gpu``."""
    bf16 = cfg.model.dtype == "bfloat16" and recovery_option(cfg, "ewma", "phi_dtype", "param") == "param"
    return (2 if bf16 else FP32), bool(recovery_option(cfg, "ewma", "phi_on_gpu", False))


def snapshot_storage(cfg) -> str:
    """``recovery.snapshot.storage`` (cpu when the config has no snapshot section)."""
    return recovery_option(cfg, "snapshot", "storage", "cpu")
