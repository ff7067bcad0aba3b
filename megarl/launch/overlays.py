"""Overlay YAML files (e.g. configs/recovery/ewma.yaml) -> dotted ``key=value`` overrides.

`megarl launch --recovery ewma` (or ``--overlay FILE``) turns the overlay into
overrides placed before the user's own, so every role's command line stays
``python -m megarl.train --config RUN.yaml key=value ...``: the overlay beats
the run file, the user's overrides beat the overlay.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megarl.errors import ConfigError

RECOVERY_DIR = Path(__file__).resolve().parents[2] / "configs" / "recovery"


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        # a string that YAML would read as something else (a number, bool, null) is quoted
        if yaml.safe_load(value) == value and "\n" not in value:
            return value
        return yaml.safe_dump(value).strip().removesuffix("\n...")
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip().removesuffix("...").strip()


def flatten(raw: dict, prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in raw.items():
        if isinstance(value, dict) and value:
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={_scalar(value)}")
    return out


def overlay_overrides(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"overlay {path} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"overlay {path} must hold a mapping")
    if "include" in raw:
        raise ConfigError(f"overlay {path} may not use include")
    return flatten(raw)


def recovery_overlay(name: str) -> Path:
    path = RECOVERY_DIR / f"{name}.yaml"
    if not path.is_file():
        valid = sorted(p.stem for p in RECOVERY_DIR.glob("*.yaml"))
        raise ConfigError(f"no recovery overlay {name!r}; valid: {', '.join(valid)}")
    return path
