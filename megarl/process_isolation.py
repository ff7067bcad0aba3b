"""Command prefixes that keep user code (agent commands, the code sandbox) away from the run's other processes.

Code megarl runs for the model or the user must not read the memory or the
environment of the trainer, the engines or another episode's command
(``/proc/<pid>/environ``, ``/proc/<pid>/mem``, ptrace). The prefix puts the
command in a PID namespace of its own (``unshare --pid --fork --mount-proc``:
its ``/proc`` lists only its own processes) and, with ``setpriv``, drops every
capability and forbids gaining new ones, so that even a root command cannot
unmount that ``/proc`` or make a namespace of its own; a small process 1
(:data:`_INIT`) runs the command below it. As root the namespaces
come directly; as another user through a user namespace (``unshare --user
--map-root-user``) where the kernel allows one. ``network=False`` adds an empty
network namespace (the code sandbox). Which prefix works is probed once per
process by running ``python -I -c pass`` under it; () when none does, and the
caller decides whether to refuse (the default) or to run unisolated.
"""
from __future__ import annotations

import functools
import shutil
import subprocess
import sys

#: drops every capability (bounding, inheritable, ambient) and forbids regaining any (no setuid, no file caps)
_DROP_CAPS = ("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs", "--")
#: the namespace's process 1: the command must not be it (the kernel spares process 1 every signal it has no
#: handler for, SIGXCPU and a self-sent SIGKILL included). It starts the command, forwards SIGTERM/SIGINT/SIGHUP,
#: reaps orphans, and exits with the command's status, 128 + N for a command killed by signal N.
_INIT = """
import os, signal, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    except OSError as e:
        sys.stderr.write("cannot run %r: %s\\n" % (sys.argv[1], e))
        os._exit(127)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda s, f: os.kill(pid, s))
while True:
    done, status = os.wait()
    if done == pid:
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
"""


def _candidates(network: bool) -> list[tuple[str, ...]]:
    ns = ("--pid", "--fork", "--mount-proc", "--kill-child") + (() if network else ("--net",))
    init = (sys.executable, "-I", "-S", "-c", _INIT)
    return [("unshare", *ns, *_DROP_CAPS, *init), ("unshare", "--user", "--map-root-user", *ns, *_DROP_CAPS, *init)]


def exit_status(returncode: int, prefix: tuple[str, ...]) -> int:
    """A command's exit status as if it had run without ``prefix``: 128 + N under one means killed by signal N."""
    return -(returncode - 128) if prefix and 128 < returncode < 128 + 65 else returncode


@functools.lru_cache(maxsize=4)
def isolation_prefix(network: bool = True) -> tuple[str, ...]:
    """The prefix that isolates a command (module docstring), without network when ``network`` is False; ()
    when neither variant works here."""
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return ()
    for prefix in _candidates(network):
        try:
            ok = subprocess.run([*prefix, sys.executable, "-I", "-c", "pass"], capture_output=True,
                                timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return prefix
    return ()
