"""The registry of recovery strategies, keyed by ``recovery.name``.

Each strategy lives in its own module of this package and registers itself
with :func:`register`; modules are discovered automatically, so adding a
strategy touches its own file and nothing else.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import recovery
from megarl.errors import ConfigError

_REGISTRY: dict[str, type] = {}
_NOT_STRATEGIES = {"base", "registry", "verifier"}
_discovered = False


def register(cls: type) -> type:
    """Class decorator: add a strategy under ``cls.name``; duplicate names are refused."""
    name = getattr(cls, "name", "")
    if not name:
        raise ValueError(f"{cls.__qualname__} has no `name`")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"recovery strategy {name!r} is registered twice "
                         f"({_REGISTRY[name].__module__} and {cls.__module__})")
    _REGISTRY[name] = cls
    return cls


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    for mod in pkgutil.iter_modules(recovery.__path__):
        if mod.name not in _NOT_STRATEGIES and not mod.name.startswith("_"):
            importlib.import_module(f"recovery.{mod.name}")
    _discovered = True


def names() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def resolve_names(spec: str) -> list[str]:
    """``"all"`` or a comma-separated list of strategy names, checked against the registry."""
    valid = names()
    chosen = valid if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in valid]
    if unknown or not chosen:
        raise ConfigError(f"unknown strategies {unknown or spec!r}; valid: {', '.join(valid)} (or 'all')")
    return chosen


def get(name: str) -> type:
    _discover()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown recovery strategy {name!r}; valid: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def config_classes() -> dict[str, type]:
    """Strategy name -> its config dataclass."""
    _discover()
    return {n: c.Config for n, c in _REGISTRY.items()}


def build(recovery_cfg: Any, ctx: Any):
    """Instantiate the strategy chosen by ``recovery_cfg.name`` with its own options."""
    cls = get(recovery_cfg.name)
    options = recovery_cfg.options.get(recovery_cfg.name) or cls.Config()
    return cls(options, ctx)
