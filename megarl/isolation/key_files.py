"""How `megarl launch` hands the run's secrets to its roles: one file per consumer, read once and deleted.

The processes between `megarl launch` and the roles (torchrun's agent, srun,
mpirun) live as long as the run, and ``/proc/<pid>/environ`` shows the
environment each was started with to every process of the same user. So no
secret goes into an environment: `megarl launch` holds the keys in memory
(megarl/launch/engine_key_env.py) and, just before it starts a command,
writes the keys that command's role needs into files of mode 0600 in a
directory of mode 0700 of its own, and names each file in ``<NAME>_FILE`` (a
path, not a secret). The one reader deletes its file as it reads it
(megarl/isolation/secret_env.py): trainer rank 0 for the trainer command (its followers
read none), the engine or scorer for a server command. The directory lies in
the run directory (else under runs/), which multi-node runs already share, so
a rank on another node finds the file; it is removed with whatever is left
when the launch ends, however it ends.

A file is visible to processes of the same user for the seconds between its
writing and its reader's start (agent commands run as that user and see the
filesystem, though not the run's processes); an environment variable would be
visible for the whole run, in every process that inherits it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

from megarl.isolation.secret_env import (
    DEDICATED_AUTHKEY_ENV,
    ENGINE_KEY_ENV,
    FILE_SUFFIX,
    SECRET_ENV_VARS,
    scrubbed_env,
    write_secret_file,
)

#: the secrets each role's command reads (the trainer's rank 0 talks to engines, the scorer and the agent service)
ROLE_SECRETS = {"trainer": SECRET_ENV_VARS, "engine": (ENGINE_KEY_ENV,), "dedicated": (DEDICATED_AUTHKEY_ENV,)}
KEY_DIR_PREFIX = ".megarl-keys-"


def key_dir_base(cfg) -> Path:
    """Where the key directory is made: the run directory when the config names it, else runs/ (as the stop marker)."""
    base = cfg.logging.resume or cfg.logging.output_dir
    return Path(base).absolute() if base else Path("runs").absolute()


class KeyFiles:
    """The run's keys (held in memory) and the files written from them for the commands of one launch."""

    def __init__(self, keys: Mapping[str, str], base: str | os.PathLike) -> None:
        unknown = sorted(set(keys) - set(SECRET_ENV_VARS))
        if unknown:
            raise ValueError(f"{unknown} are not megarl's secrets {SECRET_ENV_VARS}")
        self.keys = {k: v for k, v in keys.items() if v}
        self.base = Path(base)
        self.directory: Path | None = None

    def _dir(self) -> Path:
        if self.directory is None:
            self.base.mkdir(parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix=KEY_DIR_PREFIX, dir=self.base))  # mode 0700
        return self.directory

    def env_for(self, role: str) -> dict[str, str]:
        """Fresh files for one command of ``role``: ``{<NAME>_FILE: path}`` for each key it reads."""
        wanted = [n for n in ROLE_SECRETS.get(role, ()) if n in self.keys]
        return {n + FILE_SUFFIX: write_secret_file(str(self._dir()), n, self.keys[n]) for n in wanted}

    def close(self) -> None:
        """Remove the directory and any file no reader took (a command that failed before it read its own)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> "KeyFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def child_env(role: str, key_files: KeyFiles | None) -> dict[str, str] | None:
    """The environment of a command of ``role``: this process's (which holds no secret) plus its key files."""
    if key_files is None:
        return None
    return scrubbed_env(**key_files.env_for(role))
