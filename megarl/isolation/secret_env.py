"""The run's secrets: one list of their variable names, how a process takes one, and the environment children get.

A run holds five secrets: the engine key (``MEGARL_ENGINE_KEY``: whoever holds
it can load weights into any engine and so poison the rollouts that become
training data), the dedicated scorer's link key (``MEGARL_DEDICATED_AUTHKEY``:
the link carries pickles, so it runs code on the scorer), the agent
service key (``MEGARL_AGENT_SERVICE_KEY``) and the stop key
(``MEGARL_STOP_KEY``: it signs the stop marker that makes `megarl launch` exit
75, a requeue) and the world key (``MEGARL_WORLD_KEY``: the trainer ranks'
store admits only its holders), the one secret every trainer rank takes. :data:`SECRET_ENV_VARS` names them;
every child megarl starts for user code (agent commands, tool and reward
workers, the code sandbox) gets :func:`scrubbed_env`, which holds none of
them nor the variables that say where to read one.

A long-lived process takes each secret once with :func:`take_secret` and
keeps it in memory only. It comes, in this order, from

* ``<NAME>_FD``: a pipe's read end the parent passed (:func:`pass_by_pipe`),
  read to its end and closed;
* ``<NAME>_FILE``: a file of mode 0600 owned by this user, read and deleted;
* ``<NAME>`` itself, as a launching shell exports it.

Each of the three variables is then removed from the environment, and the
value of ``<NAME>`` is overwritten in the process's initial environment block
first: ``/proc/<pid>/environ`` shows that block as it was at exec, whatever
``unsetenv`` does, and other processes of the same user can read it.

A file is read by exactly one process: `megarl launch` writes one per consumer
(:func:`write_secret_file`: trainer rank 0, each engine, the scorer), and the
trainer's followers, which talk to no engine, scorer or agent service, drop
the carriers without reading (:func:`take_all_secrets`), so they can never
take rank 0's file first. A missing file is an error on its one reader.
"""
from __future__ import annotations

import ctypes
import os
import stat
import tempfile
import threading
from typing import Mapping

from megarl.errors import ConfigError

ENGINE_KEY_ENV = "MEGARL_ENGINE_KEY"
DEDICATED_AUTHKEY_ENV = "MEGARL_DEDICATED_AUTHKEY"
AGENT_SERVICE_KEY_ENV = "MEGARL_AGENT_SERVICE_KEY"
#: signs the stop marker trainer rank 0 writes for `megarl launch` (megarl/stop_protocol.py)
STOP_KEY_ENV = "MEGARL_STOP_KEY"
#: the trainer world's store admits only processes holding it (megarl/trainer/world_store.py)
WORLD_KEY_ENV = "MEGARL_WORLD_KEY"
#: every secret of a run, by its environment variable
SECRET_ENV_VARS = (ENGINE_KEY_ENV, DEDICATED_AUTHKEY_ENV, AGENT_SERVICE_KEY_ENV, STOP_KEY_ENV, WORLD_KEY_ENV)
#: secrets every trainer rank takes, from one file per launched command that no reader deletes as it reads it
#: (the first rank of each node removes it once the trainer world formed: remove_shared_files); the others are
#: trainer rank 0's alone
SHARED_SECRETS = (WORLD_KEY_ENV,)
FD_SUFFIX, FILE_SUFFIX = "_FD", "_FILE"

_taken: dict[str, str] = {}
#: the files shared secrets were read from (every trainer rank reads the same one): removed once all have
_shared_files: dict[str, str] = {}
_lock = threading.Lock()


def secret_carriers(name: str) -> tuple[str, str, str]:
    """The variables that may carry secret ``name``: itself, its pipe fd and its file path."""
    return name, name + FD_SUFFIX, name + FILE_SUFFIX


def _all_carriers() -> set[str]:
    return {v for name in SECRET_ENV_VARS for v in secret_carriers(name)}


def scrubbed_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) without any secret or carrier variable, plus ``extra``."""
    drop = _all_carriers()
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in drop}
    env.update(extra)
    return env


#: variables that tell where the run's own rendezvous, ranks and job are (torchrun, MPI, Slurm): user code needs
#: none of them, and with them it finds the trainer world's store or starts steps in the run's allocation
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE")
RENDEZVOUS_PREFIXES = ("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "SLURM_")


def user_code_env(base: Mapping[str, str] | None = None, *, keep_megarl: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a process that runs user or policy code: :func:`scrubbed_env` without the rendezvous,
    rank and job variables (:data:`RENDEZVOUS_VARS`, :data:`RENDEZVOUS_PREFIXES`) and, unless ``keep_megarl``
    (the reward workers, which read the sandbox's settings there), without any ``MEGARL_*`` variable (the stop
    marker's path among them); plus ``extra``."""
    drop = RENDEZVOUS_PREFIXES if keep_megarl else (*RENDEZVOUS_PREFIXES, "MEGARL_")
    env = {k: v for k, v in scrubbed_env(base).items()
           if k not in RENDEZVOUS_VARS and not k.startswith(drop) and k != "MEGARL_STOP_MARKER"}
    env.update(extra)
    return env


def _initial_env_block() -> tuple[int, int] | None:
    """Where this process's exec-time environment lies in its memory (/proc/self/stat: env_start, env_end)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # fields 50 and 51 of proc(5)
    except (OSError, IndexError, ValueError):
        return None
    return (start, end) if 0 < start < end else None


def _wipe_initial_value(name: str) -> None:
    """Overwrite ``name``'s value in the exec-time environment block, which /proc/<pid>/environ reads. Found by
    address, not through the C ``environ`` array: code that rebuilds the environment (``os.environ.clear()``
    then ``update``) leaves the block in place but no longer points to it."""
    block = _initial_env_block()
    if block is None:
        return
    start, end = block
    raw = ctypes.string_at(start, end - start)
    prefix = (name + "=").encode()
    at = 0
    while (hit := raw.find(prefix, at)) != -1:
        if hit == 0 or raw[hit - 1] == 0:  # the start of an entry, not the middle of another's value
            value_end = raw.find(b"\0", hit)
            value_end = len(raw) if value_end == -1 else value_end
            ctypes.memset(start + hit + len(prefix), ord("x"), value_end - hit - len(prefix))
        at = hit + len(prefix)


def _read_fd(name: str, text: str) -> str:
    try:
        fd = int(text)
    except ValueError:
        raise ConfigError(f"{name}{FD_SUFFIX}={text!r} is not a file descriptor number") from None
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read().decode().strip()
    except OSError as e:
        raise ConfigError(f"{name}{FD_SUFFIX}={fd}: cannot read the secret from that descriptor ({e}); "
                          f"the process that starts this one must pass it open (pass_fds)") from None


def not_private(st: os.stat_result) -> str:
    """What makes a key file other users could read or replace ('' when it is mode 0600 and this user's)."""
    if stat.S_IMODE(st.st_mode) & 0o077 or st.st_uid != os.geteuid():
        return (f"has mode {stat.S_IMODE(st.st_mode):o} and owner uid {st.st_uid}; a key file must be mode 0600 "
                f"and owned by this user (uid {os.geteuid()})")
    return ""


def _read_file(name: str, path: str, delete: bool = True) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{name}{FILE_SUFFIX}={path!r}: the secret file does not exist. A secret file is read "
                          f"once and deleted by the one process it was written for, and `megarl launch` removes "
                          f"its files when the run ends: start each process with a file of its own, or pass the "
                          f"secret another way") from None
    except OSError as e:
        raise ConfigError(f"{name}{FILE_SUFFIX}={path!r}: cannot read the secret file ({e})") from None
    if problem := not_private(st):
        raise ConfigError(f"{name}{FILE_SUFFIX}={path!r} {problem}: `chmod 600` it, or pass the secret another way")
    with open(path) as f:
        value = f.read().strip()
    if delete:
        os.unlink(path)  # read once: nobody else finds it later
    return value


def take_secret(name: str) -> str:
    """Secret ``name`` of :data:`SECRET_ENV_VARS` ("" when none was given): taken from its carrier (module
    docstring), which is removed, then kept in this process's memory; a carrier set again later replaces it."""
    if name not in SECRET_ENV_VARS:
        raise ValueError(f"{name} is not one of megarl's secrets {SECRET_ENV_VARS}")
    with _lock:
        plain, fd_var, file_var = secret_carriers(name)
        if not any(var in os.environ for var in (plain, fd_var, file_var)):
            return _taken.get(name, "")
        if os.environ.get(fd_var):
            value = _read_fd(name, os.environ[fd_var])
        elif os.environ.get(file_var):  # a shared secret's file is every trainer rank's: remove_shared_files
            value = _read_file(name, os.environ[file_var], delete=name not in SHARED_SECRETS)
            if name in SHARED_SECRETS:
                _shared_files[name] = os.environ[file_var]
        else:
            value = os.environ.get(plain, "")
        _wipe_initial_value(plain)
        for var in (plain, fd_var, file_var):
            os.environ.pop(var, None)
        _taken[name] = value
        return value


def remove_shared_files() -> None:
    """Delete the files this process read shared secrets from: call it once every process that reads them has
    (the trainer world formed); a file already gone is no error."""
    with _lock:
        for path in _shared_files.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        _shared_files.clear()


def give_secret(name: str, value: str) -> None:
    """Hold ``value`` as secret ``name`` in this process (one this process made or was handed in code)."""
    if name not in SECRET_ENV_VARS:
        raise ValueError(f"{name} is not one of megarl's secrets {SECRET_ENV_VARS}")
    with _lock:
        _taken[name] = value


def pass_by_pipe(name: str, value: str, env: dict[str, str]) -> int:
    """Make a pipe holding ``value`` for a child: sets ``<name>_FD`` in ``env`` and returns the read end, which the
    caller passes (``pass_fds``) and closes once the child has started. The child's :func:`take_secret` reads it."""
    r, w = os.pipe()
    try:
        os.write(w, value.encode())  # far below a pipe's buffer: never blocks
    finally:
        os.close(w)
    os.set_inheritable(r, True)
    for var in secret_carriers(name):
        env.pop(var, None)
    env[name + FD_SUFFIX] = str(r)
    return r


def write_secret_file(directory: str, name: str, value: str) -> str:
    """Write ``value`` to a new file of mode 0600 in ``directory`` for one reader (its ``<name>_FILE``), which
    :func:`take_secret` deletes on read; returns its path. Never replaces a file that exists."""
    if name not in SECRET_ENV_VARS:
        raise ValueError(f"{name} is not one of megarl's secrets {SECRET_ENV_VARS}")
    fd, path = tempfile.mkstemp(prefix=name.lower() + "-", dir=directory)  # O_EXCL, mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(value)
    return path


def trainer_follower(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a trainer rank other than 0 (RANK, or the MPI rank before the bootstrap sets it)."""
    env = os.environ if env is None else env
    if env.get("MEGARL_ROLE", "trainer") != "trainer":
        return False
    rank = next((env[v] for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK") if env.get(v)), "0")
    return rank.strip() != "0"


def drop_secrets(keep: tuple[str, ...] = ()) -> None:
    """Remove every secret's carriers but those of ``keep`` from this process's environment without reading them
    (a file stays for its reader); the plain values are wiped from the exec-time block too."""
    with _lock:
        for name in SECRET_ENV_VARS:
            if name in keep:
                continue
            _wipe_initial_value(name)
            for var in secret_carriers(name):
                os.environ.pop(var, None)


def take_all_secrets() -> None:
    """At a process's start: take every secret it was given, so none stays in its environment (module docstring).
    A trainer follower takes the shared ones (:data:`SHARED_SECRETS`) and reads no other: it drops them
    (:func:`drop_secrets`)."""
    if trainer_follower():
        drop_secrets(keep=SHARED_SECRETS)
        for name in SHARED_SECRETS:
            take_secret(name)
        return
    for name in SECRET_ENV_VARS:
        take_secret(name)
