"""Code reward: run the response's Python code against unit tests in a sandbox.

The solution is the response's last fenced code block if there is one, else
the whole response. The tests are a list of Python snippets such as
``"assert add(1, 2) == 3"``: the ground truth itself (``data.answer_key``) or
the row's ``tests`` field. Reward = fraction of tests that run without
raising. Optional row fields ``time_limit_s`` (default 2.0, wall clock for the
solution plus all tests; keep it under the service's ``timeout_s``) and
``memory_mb`` (default 512).

The sandbox is one subprocess (``python -I``) with:
- a fresh temporary directory as cwd and HOME, an environment with no
  proxies or user variables;
- setrlimit: address space (memory), CPU seconds, file size 16 MB, no core;
- its own session, killed as a group at the end (stray children included),
  and SIGKILL if the reward worker dies (PR_SET_PDEATHSIG);
- no network and no sight of other processes or of the run's files: an empty
  network namespace, a PID namespace of its own, a read-only filesystem with
  the run directory hidden and only its directory and a private /tmp
  writable, every capability dropped (megarl/isolation/process_isolation.py). Where this machine cannot make them the
  sandbox refuses to run (:class:`SandboxUnavailable`), unless
  ``reward.sandbox_allow_unisolated=true`` opted out (the run sets
  ``MEGARL_SANDBOX_ALLOW_UNISOLATED=1`` for its workers): then it runs with the
  host's network and a warning is logged once.

Limitations: the tests run in the solution's interpreter, so adversarial code
that inspects the harness's frames could forge a pass (the per-run nonce only
stops the easy hacks: printing "PASS" or exiting 0); RLIMIT_NPROC is not set
(it counts all processes of the user and is ignored for root).
"""
from __future__ import annotations

import ctypes
import functools
import json
import logging
import math
import os
import re
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from megarl.errors import ConfigError
from megarl.isolation.process_isolation import isolation_prefix

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_MEMORY_MB = 512
MAX_OUTPUT_BYTES = 16 << 20

# Runs inside the sandbox. Markers go to the real stdout with a nonce read from
# stdin, so a solution that prints "PASS" or exits 0 does not pass any test.
_HARNESS = r"""
import json, os, sys
def _run():
    nonce = sys.stdin.readline().strip()
    out = os.fdopen(os.dup(1), "w")
    with open("tests.json") as f:
        tests = json.load(f)
    with open("solution.py") as f:
        scope = {"__name__": "__main__"}
        exec(compile(f.read(), "solution.py", "exec"), scope)
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "test_%d" % i, "exec"), scope)
        except BaseException:
            continue
        out.write("%s %d\n" % (nonce, i))
        out.flush()
_run()
"""

_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.DOTALL)


@dataclass
class SandboxResult:
    n_passed: int
    n_tests: int
    timed_out: bool
    returncode: int | None
    stderr_tail: str


def extract_code(text: str) -> str:
    """The last fenced code block of ``text``, or all of it when there is none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


#: set to 1 in the run's environment by reward.sandbox_allow_unisolated=true; the workers inherit it
ALLOW_UNISOLATED_ENV = "MEGARL_SANDBOX_ALLOW_UNISOLATED"
OPT_OUT_KEY = "reward.sandbox_allow_unisolated"


class SandboxUnavailable(ConfigError):
    """The sandbox cannot cut its code off from the network and the other processes here, and nobody opted out."""


def allows_unisolated() -> bool:
    return os.environ.get(ALLOW_UNISOLATED_ENV, "") == "1"


def sandbox_prefix(workdir: str) -> tuple[str, ...]:
    """The prefix every sandboxed command runs under, ``workdir`` its one writable directory beside its scratch
    (megarl/isolation/process_isolation.py); SandboxUnavailable when there is none and the run did not opt out (then ()
    and a warning, once)."""
    prefix = isolation_prefix(network="none", writable=(workdir,))
    if prefix:
        return prefix
    if not allows_unisolated():
        raise SandboxUnavailable(
            "the code sandbox cannot isolate code here: neither 'unshare --net --pid' (root) nor a user namespace "
            "('unshare --user') works, and setpriv must be installed. Run where one works, or set "
            f"{OPT_OUT_KEY}=true to run reward and tool code WITH the host's network and its processes in view")
    _warn_unisolated()
    return ()


@functools.lru_cache(maxsize=1)
def _warn_unisolated() -> None:
    logger.warning("code sandbox runs WITH network access and other processes in view (%s=true): no network or "
                   "PID namespace can be made here", OPT_OUT_KEY)


def _limit_child(memory_mb: int, cpu_s: int) -> None:
    """preexec_fn: resource limits of the sandbox process (runs between fork and exec)."""
    mem = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_OUTPUT_BYTES, MAX_OUTPUT_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:  # die with the reward worker, which may be killed on its own timeout
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class _Run:
    stdout: str
    stderr_tail: str
    timed_out: bool
    returncode: int | None


def _run_in_sandbox(files: dict[str, str], script: str, stdin: str, time_limit_s: float, memory_mb: int) -> _Run:
    """Run ``python -I -c script`` in a fresh directory holding ``files``, with the sandbox's limits."""
    with tempfile.TemporaryDirectory(prefix="megarl-code-") as tmp:
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [*sandbox_prefix(tmp), sys.executable, "-I", "-c", script]
        out_path, err_path = os.path.join(tmp, ".stdout"), os.path.join(tmp, ".stderr")
        timed_out = False
        # output goes to files, not pipes: code printing in a loop then hits
        # RLIMIT_FSIZE instead of filling the worker's memory
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=tmp, env=env,
                                    start_new_session=True,
                                    preexec_fn=functools.partial(_limit_child, memory_mb, math.ceil(time_limit_s)))
            try:
                proc.communicate(stdin.encode(), timeout=time_limit_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        with open(out_path, "rb") as f:
            stdout = f.read(MAX_OUTPUT_BYTES).decode(errors="replace")
        with open(err_path, "rb") as f:
            stderr_tail = f.read()[-2000:].decode(errors="replace")
    return _Run(stdout, stderr_tail, timed_out, proc.returncode)


def run_sandboxed(code: str, tests: list[str], time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                  memory_mb: int = DEFAULT_MEMORY_MB) -> SandboxResult:
    """Run ``code`` then each test in a sandboxed subprocess; count the tests that pass."""
    nonce = secrets.token_hex(16)
    run = _run_in_sandbox({"solution.py": code, "tests.json": json.dumps(list(tests))}, _HARNESS, nonce + "\n",
                          time_limit_s, memory_mb)
    passed = {int(parts[1]) for parts in (ln.split() for ln in run.stdout.splitlines())
              if len(parts) == 2 and parts[0] == nonce and parts[1].isdigit()}
    return SandboxResult(n_passed=len(passed), n_tests=len(tests), timed_out=run.timed_out,
                         returncode=run.returncode, stderr_tail=run.stderr_tail)


_RUN_SCRIPT = "exec(compile(open('main.py').read(), 'main.py', 'exec'), {'__name__': '__main__'})"


def run_python(code: str, time_limit_s: float = DEFAULT_TIME_LIMIT_S, memory_mb: int = DEFAULT_MEMORY_MB) -> str:
    """Run ``code`` in the sandbox; what it printed, then its error or a note that it was stopped."""
    run = _run_in_sandbox({"main.py": code}, _RUN_SCRIPT, "", time_limit_s, memory_mb)
    text = run.stdout
    if run.timed_out:
        text += f"\n[stopped: the code ran longer than {time_limit_s:g} s]"
    elif run.returncode:
        text += ("\n" if text else "") + run.stderr_tail.strip()
    return text.strip() or "[the code printed nothing]"


def code_reward(response: str, answer: Any, *, row: dict[str, Any] | None = None, **_: Any) -> float:
    row = row or {}
    tests = answer if isinstance(answer, list) else row.get("tests")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("code reward needs tests: a non-empty list of Python test snippets as the ground truth "
                         "(data.answer_key) or in the row's 'tests' field")
    result = run_sandboxed(extract_code(response), tests,
                           time_limit_s=float(row.get("time_limit_s", DEFAULT_TIME_LIMIT_S)),
                           memory_mb=int(row.get("memory_mb", DEFAULT_MEMORY_MB)))
    return result.n_passed / result.n_tests


def uses_sandbox(cfg: Any) -> bool:
    """Whether a run's config runs code in this sandbox: the code reward or the python tool."""
    return cfg.reward.fn in ("code", "megarl.rewards.code:code_reward") or "python" in cfg.agent.tools


def prepare_sandbox(cfg: Any) -> None:
    """Before a run starts: refuse it (SandboxUnavailable) when it would run sandboxed code that cannot be
    isolated here; with ``reward.sandbox_allow_unisolated=true`` let its workers run such code (they inherit
    ``MEGARL_SANDBOX_ALLOW_UNISOLATED=1``)."""
    if cfg.reward.sandbox_allow_unisolated:
        os.environ[ALLOW_UNISOLATED_ENV] = "1"
    if uses_sandbox(cfg):
        sandbox_prefix(tempfile.gettempdir())
