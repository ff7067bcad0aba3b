"""Overlay YAML files (e.g. configs/recovery/ewma.yaml) -> dotted ``key=value`` overrides.

`megarl launch --recovery ewma` (or ``--overlay FILE``) turns the overlay into
overrides placed before the user's own, so every role's command line stays
``python -m megarl.train --config RUN.yaml key=value ...``: the overlay beats
the run file, the user's overrides beat the overlay. `megarl train` and `megarl plan`
take the same ``--recovery`` / ``--overlay`` flags through :func:`command_overrides`.

A recovery overlay (configs/recovery/NAME.yaml) chooses the strategy and what it
needs to run (its own options, ``rollout.interruptible``, the scorer's placement),
never the loss: ``loss.*`` stays the run config's, so a strategy name trains the
same loss whichever command or key (``--recovery NAME``, ``recovery.name=NAME``)
selects it. Each overlay's comments say which train-inference mask suits it.
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
    loss = [o.split("=", 1)[0] for o in overlay_overrides(path) if o.startswith("loss.")]
    if loss:
        raise ConfigError(f"recovery overlay {path} sets {', '.join(loss)}: a strategy's overlay may not change "
                          f"the loss (the same strategy name would train another loss through recovery.name=); "
                          f"put loss settings in the run config")
    return path


def command_overrides(recovery: str | None, overlays: list[str], overrides: list[str]) -> list[str]:
    """The dotted overrides of a command's ``--recovery NAME``, ``--overlay FILE ...`` and ``key=value ...``,
    in that order of precedence from lowest to highest (module doc)."""
    paths = ([recovery_overlay(recovery)] if recovery else []) + list(overlays)
    return [o for path in paths for o in overlay_overrides(path)] + list(overrides)


def add_overlay_flags(parser) -> None:
    """``--recovery NAME`` and ``--overlay FILE`` on a command's parser (train, launch, plan)."""
    parser.add_argument("--recovery", metavar="NAME",
                        help="select the strategy NAME with what it needs (configs/recovery/NAME.yaml; not the loss)")
    parser.add_argument("--overlay", action="append", default=[], metavar="FILE",
                        help="apply an overlay YAML as overrides (repeatable; before key=value overrides)")
