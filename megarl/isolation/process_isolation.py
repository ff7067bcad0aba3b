"""Command prefixes that keep user code (agent commands, the code sandbox) away from the run's processes and files.

Code megarl runs for the model or the user must not read the memory or the
environment of the trainer, the engines or another episode's command
(``/proc/<pid>/environ``, ``/proc/<pid>/mem``, ptrace), nor change what the
run reads later: its checkpoints, its control files, the source tree and the
Python environment every later process imports. The prefix gives the command

* a PID namespace of its own (``unshare --pid --fork --mount-proc``: its
  ``/proc`` lists only its own processes);
* a mount namespace in which every mount is read-only, the run's protected
  directories (:func:`protect`: the run directory with its checkpoints, keys
  and stop marker) are covered by an empty read-only tmpfs, and ``/tmp`` and
  ``/dev/shm`` are fresh private tmpfs (its scratch space, and no view of the
  run's shared-memory weight buckets or other processes' sockets there), into
  which what it needs to run is brought back read-only (:func:`needed_to_run`:
  the interpreter, megarl, its working directory, where its script lies, when
  they lie there); a caller's ``writable`` directories (the code sandbox's
  working directory) stay writable;
* a network of its own: none at all (``network="none"``, the code sandbox),
  or only the agent endpoint (``network="endpoint"``: an empty network
  namespace whose loopback listens on the endpoint's port and is joined to the
  endpoint, and to nothing else, by a forwarder outside it), or the host's
  (``network="host"``, where a run allows it: then the command also reaches
  every port of the run's processes, the trainer world's store among them);
* no capability at all (``setpriv``), and none to gain, so that even a root
  command can neither remount anything writable nor unmount what hides the
  run; a small process 1 runs the command below it.

The programs that run inside are megarl/isolation/ (ns_setup.py, ns_init.py,
forwarder.py). As root the namespaces come directly; as another user through
a user namespace (``unshare --user --map-root-user``) where the kernel allows
one. Which prefix works is probed once per process (:func:`_probe`: a command
under it must find the filesystem read-only, a protected directory empty and
its scratch writable); () when none does, and the caller decides whether to
refuse (the default) or to run unisolated. docs/threat_model.md says what such
code can and cannot reach.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal

Network = Literal["host", "endpoint", "none"]
_HERE = Path(__file__).resolve().parent  # megarl/isolation: the programs inside the namespaces
#: drops every capability (bounding, inheritable, ambient) and forbids regaining any (no setuid, no file caps)
_DROP_CAPS = ("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs", "--")
_PY = (sys.executable, "-I", "-S")
#: MiB of the fresh tmpfs a command gets as /tmp, its scratch space (memory, used only as it writes; its
#: /dev/shm is another of 64 MiB)
SCRATCH_MB = 512
#: exit status of the set-up stage when it cannot make the filesystem or the network safe (the command did not run)
SETUP_FAILED = 125
#: the protected directories, os.pathsep-separated: in the environment, so that the run's reward workers, which
#: start the code sandbox, hide them too
PROTECTED_ENV = "MEGARL_PROTECTED_DIRS"


def protect(path: str | os.PathLike) -> None:
    """Hide directory ``path`` (and all below it) from every command isolated from now on by this process and the
    processes it starts: the run directory, whose checkpoints, keys and stop marker the run trusts on resume."""
    os.environ[PROTECTED_ENV] = os.pathsep.join(sorted({*protected(), str(Path(path).absolute())}))


def protected() -> tuple[str, ...]:
    return tuple(sorted(p for p in os.environ.get(PROTECTED_ENV, "").split(os.pathsep) if p))


def _namespaces(network: Network, user: bool) -> tuple[str, ...]:
    ns = ("--pid", "--fork", "--mount-proc", "--kill-child") + (("--net",) if network == "none" else ())
    return ("unshare", *(("--user", "--map-root-user") if user else ()), *ns)


def needed_to_run(extra=()) -> list[str]:
    """Directories an isolated command reads to run at all: the interpreter's, megarl's checkout (the programs
    in megarl/isolation/), the working directory, PYTHONPATH's, and ``extra`` (e.g. where its script lies)."""
    dirs = [sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(sys.executable).resolve().parent),
            str(_HERE.parents[1]), os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep), *extra]
    return [str(Path(d).absolute()) for d in dirs if d]


def _build(namespaces: tuple[str, ...], hide, writable, endpoint: tuple[str, int] | None,
           readable=()) -> tuple[str, ...]:
    spec = json.dumps({"hide": [str(Path(p).absolute()) for p in hide],
                       "writable": [str(Path(p).absolute()) for p in writable], "readable": needed_to_run(readable),
                       "scratch_mb": SCRATCH_MB, "endpoint": list(endpoint) if endpoint else None,
                       "drop_caps": list(_DROP_CAPS)})
    return (*namespaces, *_PY, str(_HERE / "ns_setup.py"), spec, *_DROP_CAPS, *_PY, str(_HERE / "ns_init.py"))


_PROBE = r"""
import os, socket, sys
def writes(d):
    try:
        with open(os.path.join(d, ".megarl-isolation-probe"), "w"):
            pass
        return True
    except OSError:
        return False
ok = not writes(sys.argv[1]) and not os.path.exists(sys.argv[2]) and writes("/tmp") and writes(sys.argv[3])
if len(sys.argv) > 4:  # the endpoint answers through the forwarder
    with socket.create_connection(("127.0.0.1", int(sys.argv[4])), timeout=10) as s:
        ok = ok and s.recv(5) == b"hello"
sys.exit(0 if ok else 3)
"""


def _probe(namespaces: tuple[str, ...], network: Network) -> bool:
    """Whether a command under these namespaces runs, cannot write the file system, cannot see a protected
    directory, can write its scratch and its writable directory, and (``endpoint``) reaches the endpoint."""
    # outside /tmp where there is /var/tmp: the command gets a fresh /tmp, which would hide a directory there anyway
    base = "/var/tmp" if os.path.isdir("/var/tmp") and os.access("/var/tmp", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="megarl-probe-", dir=base) as tmp, socket.socket() as server:
        hidden, mine = Path(tmp, "hidden"), Path(tmp, "mine")
        hidden.mkdir()
        mine.mkdir()
        (hidden / "secret").write_text("x")
        argv = [*_PY, "-c", _PROBE, sys.prefix, str(hidden / "secret"), str(mine)]
        endpoint = None
        if network == "endpoint":
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            endpoint = ("127.0.0.1", server.getsockname()[1])
            argv.append(str(endpoint[1]))
        try:
            proc = subprocess.Popen([*_build(namespaces, [hidden], [mine], endpoint), *argv],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:
            return False
        try:
            if endpoint is not None:
                server.settimeout(30)
                conn, _ = server.accept()
                conn.sendall(b"hello")
                conn.close()
            rc = proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
            return False
        return rc == 0 and (mine / ".megarl-isolation-probe").is_file()


def exit_status(returncode: int, prefix: tuple[str, ...]) -> int:
    """A command's exit status as if it had run without ``prefix``: 128 + N under one means killed by signal N."""
    return -(returncode - 128) if prefix and 128 < returncode < 128 + 65 else returncode


@functools.lru_cache(maxsize=4)
def _working_namespaces(network: Network) -> tuple[str, ...]:
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return ()
    for user in (False, True):
        if _probe(_namespaces(network, user), network):
            return _namespaces(network, user)
    return ()


def isolation_prefix(network: Network = "host", writable: tuple[str, ...] = (),
                     endpoint: tuple[str, int] | None = None, readable: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The prefix that isolates a command (module docstring) with ``network`` ("endpoint": ``endpoint``, the
    (host, port) the command reaches as 127.0.0.1 on the same port, and nothing else), the directories in
    ``writable`` left writable and those in ``readable`` kept in view where its fresh /tmp would cover them
    (besides :func:`needed_to_run`'s); () when no variant works here."""
    if (network == "endpoint") != (endpoint is not None):
        raise ValueError("network='endpoint' takes the endpoint's (host, port), and only it does")
    namespaces = _working_namespaces(network)
    return _build(namespaces, protected(), writable, endpoint, readable) if namespaces else ()
