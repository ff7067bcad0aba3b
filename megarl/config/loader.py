"""Load a :class:`MegaRLConfig` from YAML plus dotted ``key=value`` overrides.

Precedence: overrides > YAML file > dataclass defaults. Unknown keys fail with
the closest valid name; values of the wrong type fail naming the field and the
expected type. Override values are parsed as YAML scalars (``3``, ``1e-3``,
``true``, ``null``, ``[0.9, 0.99]``).

The ``recovery`` section is checked against ``strategies`` (strategy name ->
its config dataclass), which the caller passes in: the strategies are plug-ins
(the ``recovery`` package), and the one module that wires them in
(megarl/builder.py, ``load_run_config``) hands over the registry's classes.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from megarl.config.input_paths import resolve_input_paths
from megarl.config.schema import MegaRLConfig, RecoveryConfig
from megarl.errors import ConfigError


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                strategies: Mapping[str, type]) -> MegaRLConfig:
    """Resolve the config from a YAML file (optional) and dotted overrides.

    ``strategies``: recovery strategy name -> its config dataclass (the options under ``recovery.<name>.*``).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at top level, got {type(raw).__name__}")
        raw = _expand_includes(raw, path.parent)
        resolve_input_paths(raw, path)  # the same files from any working directory (megarl/config/input_paths.py)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value (e.g. trainer.lr=1e-3)")
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            parsed = value
        _set_dotted(raw, key.strip(), parsed)
    return build(MegaRLConfig, raw, prefix="", strategies=strategies)


def _expand_includes(raw: dict, base: Path) -> dict:
    """``include: [a.yaml, ...]`` merges other files first (paths relative to this file)."""
    includes = raw.pop("include", None)
    if not includes:
        return raw
    merged: dict = {}
    for inc in [includes] if isinstance(includes, str) else includes:
        p = (base / inc) if not Path(inc).is_absolute() else Path(inc)
        if not p.is_file():
            raise ConfigError(f"included config {p} does not exist")
        _deep_merge(merged, _expand_includes(yaml.safe_load(p.read_text()) or {}, p.parent))
    _deep_merge(merged, raw)
    return merged


def _deep_merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {p} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _unknown(key: str, valid: list[str], prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        hint = f"did you mean {prefix}{close[0]}?"
    else:
        hint = f"valid keys: {', '.join(valid)}" if valid else "this section takes no keys"
    return ConfigError(f"unknown config key {prefix}{key}; {hint}")


def build(cls: type, raw: Any, prefix: str, strategies: Mapping[str, type]) -> Any:
    """Build dataclass ``cls`` from a mapping, validating keys and types."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    if cls is RecoveryConfig:
        return _build_recovery(raw, prefix, strategies)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            raise _unknown(key, names, prefix)
    kwargs = {k: coerce(v, hints[k], f"{prefix}{k}", strategies) for k, v in raw.items()}
    # nested sections not given are built too, so their own defaults are resolved the same way
    for f in dataclasses.fields(cls):
        if f.name not in kwargs and dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = coerce({}, hints[f.name], f"{prefix}{f.name}", strategies)
    return cls(**kwargs)


def _build_recovery(raw: dict, prefix: str, classes: Mapping[str, type]) -> RecoveryConfig:
    name = raw.get("name", RecoveryConfig.name)
    if not isinstance(name, str) or name not in classes:
        raise ConfigError(f"{prefix}name={name!r} is not a recovery strategy; valid: {', '.join(sorted(classes))}")
    options: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "name":
            continue
        if key not in classes:
            raise _unknown(key, ["name", *sorted(classes)], prefix)
        options[key] = build(classes[key], value, f"{prefix}{key}.", classes)
    for strategy, ccls in classes.items():
        options.setdefault(strategy, ccls())
    return RecoveryConfig(name=name, options=options)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str, strategies: Mapping[str, type]) -> Any:
    """Check ``value`` against type ``tp``; return it (ints widened to float where a float is expected).

    ``strategies`` as for :func:`load_config` (reached when ``tp`` is or holds the recovery section).
    """
    def bad() -> ConfigError:
        return ConfigError(f"{key}={value!r} has the wrong type: expected {_type_name(tp)}")

    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, f"{key}.", strategies)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {_type_name(tp)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad()
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key, strategies)
            except ConfigError:
                pass
        raise bad()
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise bad()
        (item,) = typing.get_args(tp) or (Any,)
        return [coerce(v, item, f"{key}[{i}]", strategies) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad()
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads `1e-3` (no dot) as a string; accept any float literal
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad()
        return value
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def to_dict(cfg: Any) -> Any:
    """Plain nested dict of a config (recovery options flattened under their names)."""
    if isinstance(cfg, RecoveryConfig):
        out = {"name": cfg.name}
        out.update({k: to_dict(v) for k, v in sorted(cfg.options.items())})
        return out
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_yaml(cfg: MegaRLConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: MegaRLConfig, path: str | Path) -> None:
    Path(path).write_text(dump_yaml(cfg))


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right below each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


def describe(strategies: Mapping[str, type], cls: type = MegaRLConfig, prefix: str = "") -> list[str]:
    """One line per leaf field: dotted key, default and docstring (for --help-config); ``strategies`` as
    for :func:`load_config`."""
    lines: list[str] = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and tp is not RecoveryConfig:
            lines += describe(strategies, tp, f"{prefix}{f.name}.")
        elif tp is RecoveryConfig:
            lines.append(f"{prefix}{f.name}.name = {RecoveryConfig.name!r}  # {field_docs(RecoveryConfig)['name']}")
            for sname, ccls in sorted(strategies.items()):
                lines += describe(strategies, ccls, f"{prefix}{f.name}.{sname}.")
        else:
            lines.append(f"{prefix}{f.name} = {getattr(defaults, f.name)!r}  # {docs.get(f.name, '')}")
    return lines
