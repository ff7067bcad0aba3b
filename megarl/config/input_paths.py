"""Where a relative input path written in a config file points: the same file whatever the working directory.

A config names files it reads (the model's shape, the data, the evaluation rows, the plan's model config). A
relative one in a config file is looked up, in this order, relative to

1. the directory of the config file given on the command line;
2. the megarl checkout (the directory holding ``megarl/`` and ``configs/``), where the shipped configs' paths
   point (``configs/data/...``);
3. the working directory (as before: a path that exists only there keeps working).

The first place where it exists wins and the config holds its absolute path from then on (the saved
``config.yaml`` of a run says which file was read). A path in none of them stays as written (a data file the
run prepares later, a cluster path a plan only names); the error of the code that then cannot read it names
each place looked (:func:`where_looked`). Paths given as ``key=value`` overrides are the user's, typed where
they stand: relative to the working directory, as a shell would take them. Outputs (``model.checkpoint``
written from ``model.init_model``, ``logging.output_dir``) are not inputs and stay relative to the working
directory.
"""
from __future__ import annotations

from pathlib import Path

#: the checkout megarl runs from (megarl/config/input_paths.py -> its grandparent's parent)
REPO_ROOT = Path(__file__).resolve().parents[2]
#: config keys that name files the run reads (section, field); "hf:..." data names are not paths
INPUT_PATHS = (("model", "init_model"), ("data", "path"), ("eval", "path"), ("placement", "model_config"))


def places(config_file: Path) -> list[Path]:
    """The directories a relative input path of ``config_file`` is looked up in, in order."""
    out: list[Path] = []
    for d in (config_file.resolve().parent, REPO_ROOT, Path.cwd()):
        if d not in out:
            out.append(d)
    return out


def resolve_input_paths(raw: dict, config_file: Path) -> None:
    """Make every relative input path of ``raw`` (a config file's mapping, includes merged) absolute (module doc)."""
    where = places(config_file)
    for section, key in INPUT_PATHS:
        value = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
        if not isinstance(value, str) or not value or value.startswith("hf:") or Path(value).is_absolute():
            continue
        found = next((d / value for d in where if (d / value).exists()), None)
        if found is None:
            _looked[value] = (f"{section}.{key} in {config_file}", [d / value for d in where])
        else:
            raw[section][key] = str(found.resolve())


#: relative input paths found nowhere: value -> (which key of which file, the places looked)
_looked: dict[str, tuple[str, list[Path]]] = {}


def where_looked(value: str) -> str:
    """For an error about input ``value``: where a config's relative path was looked for ('' when it was not)."""
    if value not in _looked:
        return ""
    what, paths = _looked[value]
    return (f" ({what}: looked for it relative to the config file's directory, the megarl checkout and the "
            f"working directory: {', '.join(str(p) for p in paths)}; fix the path, or give an absolute one)")
