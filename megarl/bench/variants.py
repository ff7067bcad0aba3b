"""Strategy variants for `megarl bench --quality`: a strategy name plus options of that strategy.

``--strategies`` is a comma-separated list; an item is a strategy name, optionally
followed by ``:`` and ``key=value`` options separated by ``;``::

    behav,ewma,ewma:auto_reset=false,ewma:tau=0.3;auto_reset=true

(quote it in a shell: ``;`` ends a command there). ``ewma:auto_reset=false`` runs
with ``recovery.name=ewma recovery.ewma.auto_reset=false``. Option values cannot
contain ``,`` or ``;``. A variant is labelled ``ewma(auto_reset=false)`` in tables
and plots and its run directories are named ``ewma-auto_reset-false_eta..`` (any
character other than letters, digits, ``.`` and ``_`` becomes ``_``).

Each variant is checked by building the run config with its overrides (the
config loader names an unknown strategy, option or a value of the wrong type),
so a bad item fails before any run starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from megarl.errors import ConfigError

NAME_SEP = ":"
OPTION_SEP = ";"
_UNSAFE = re.compile(r"[^A-Za-z0-9._]")


@dataclass(frozen=True)
class Variant:
    """A recovery strategy and the options (``recovery.<name>.<key>=<value>``) it runs with."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        """``ewma(auto_reset=false)``; the bare name without options."""
        if not self.options:
            return self.name
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.options)})"

    @property
    def dirname(self) -> str:
        """The label made filesystem-safe: ``ewma-auto_reset-false``."""
        parts = [self.name, *(p for kv in self.options for p in kv)]
        return "-".join(_UNSAFE.sub("_", p) for p in parts)

    def overrides(self) -> list[str]:
        """The strategy options as dotted config overrides (``recovery.name`` is set by the run itself)."""
        return [f"recovery.{self.name}.{k}={v}" for k, v in self.options]


def parse_item(item: str) -> Variant:
    """One ``name[:key=value;...]`` item (syntax only; :func:`parse_strategies` checks names and options)."""
    name, sep, rest = item.strip().partition(NAME_SEP)
    name = name.strip()
    if not name:
        raise ConfigError(f"--strategies item {item!r} has no strategy name; write e.g. ewma:auto_reset=false")
    if sep and not rest.strip():
        raise ConfigError(f"--strategies item {item!r} has no option after {NAME_SEP!r}; write e.g. "
                          "ewma:auto_reset=false or drop the colon")
    options: list[tuple[str, str]] = []
    for opt in (rest.split(OPTION_SEP) if sep else []):
        key, eq, value = opt.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ConfigError(f"--strategies item {item!r}: option {opt.strip()!r} is not key=value; options are "
                              f"separated by {OPTION_SEP!r}, e.g. ewma:auto_reset=false{OPTION_SEP}tau=0.3")
        if key in dict(options):
            raise ConfigError(f"--strategies item {item!r} sets {key} twice")
        options.append((key, value))
    return Variant(name, tuple(options))


def parse_strategies(spec: str, check: Callable[[list[str]], Any], all_names: list[str]) -> list[Variant]:
    """``spec`` (the module doc's syntax, ``all`` or ``none``) as variants. ``check(overrides)`` builds the
    run config with ``recovery.name=<name>`` and the variant's options and raises ConfigError on a bad one;
    ``all_names`` is what ``all`` stands for."""
    if spec.strip() == "none":
        return []
    items = all_names if spec.strip() == "all" else [s for s in spec.split(",") if s.strip()]
    if not items:
        raise ConfigError(f"--strategies={spec!r} names no strategy")
    variants = [parse_item(i) for i in items]
    for item, v in zip(items, variants):
        try:
            check([f"recovery.name={v.name}", *v.overrides()])
        except ConfigError as e:
            raise ConfigError(f"--strategies item {item.strip()!r}: {e}") from None
    for attr in ("label", "dirname"):
        seen: dict[str, Variant] = {}
        for v in variants:
            key = getattr(v, attr)
            if key in seen:
                raise ConfigError(f"--strategies: {seen[key].label!r} and {v.label!r} are the same run "
                                  f"({attr} {key!r}); give each variant once")
            seen[key] = v
    return variants
