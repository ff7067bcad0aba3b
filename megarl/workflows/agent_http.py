"""Agents in other processes (rollout.workflow=agent_http): ``agent.command`` runs once per episode against
megarl's OpenAI-compatible endpoint (megarl/agents/http_server.py).

The command (shell-split, run without a shell) gets the data row as JSON on
stdin and ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` in its environment, so
``openai.OpenAI()`` talks to the run's engines unchanged; the key is the
episode's own and is refused once the episode ends. The last non-empty line
of its stdout is the final answer, scored by ``reward.fn``, or a JSON object
``{"reward": r}`` that gives the reward itself. A non-zero exit, a run past
``agent.timeout_s`` (the command's process group is killed) or a completion
past ``agent.max_turns`` / ``agent.max_tokens`` fails the episode exactly as
a failing in-process agent does (megarl/workflows/agent.py: reward 0, counted
in ``n_agent_failed``). At most ``rollout.max_concurrency`` commands run at once.
Each command runs under resource limits (:class:`CommandLimits`: address space
``agent.command_memory_mb``, CPU time ``agent.command_cpu_s``, open files
``agent.command_open_files``, no core dumps); a command past one fails its
episode the same way.

Secrets and isolation. The command starts with megarl's environment minus
the run's secrets and its rendezvous, rank and job variables
(megarl/isolation/secret_env.py ``user_code_env``: no engine, scorer, service or stop
key, no ``MASTER_ADDR``), holding only its own episode key, in a PID
namespace of its own with every capability dropped, a read-only filesystem
with the run directory hidden and a private ``/tmp``, and (with
``agent.command_network=endpoint``, the default) a network in which only the
agent endpoint answers (megarl/isolation/process_isolation.py). So it can read neither
the run's processes nor another episode's command (their
``/proc/<pid>/environ`` or memory), change no checkpoint, source file or
package, plant no stop marker, and reach no store or port of the run. Where
no such namespace can be made the run refuses to start, unless
``agent.command_allow_unisolated=true``.

With ``agent.serve=true`` no command runs: each episode waits for a
long-lived agent service to claim it (megarl/agents/http_service.py) and to
report its reward or answer within ``agent.timeout_s``; with
``agent.rows_from_service=true`` the service also brings the rows
(megarl/agents/service_rows.py).

The episode is an :class:`AgentWorkflow` episode whose agent is the command:
recording, token-exactness checks and counts are the in-process workflow's.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import resource
import shlex
import shutil
import signal
from dataclasses import dataclass
from typing import Any

from megarl.agents.client import AgentClient, AgentLimits
from megarl.agents.http_server import SHARED, AgentHttpServer
from megarl.errors import ConfigError
from megarl.isolation.process_isolation import exit_status, isolation_prefix
from megarl.isolation.secret_env import AGENT_SERVICE_KEY_ENV, take_secret, user_code_env
from megarl.types import Trajectory
from megarl.workflows.agent import AgentWorkflow
from megarl.workflows.agent_failures import command_help, service_help
from megarl.workflows.base import GenerateFn

#: stderr kept in a failed command's error
STDERR_TAIL = 400
#: the environment variable holding the secret an agent service claims episodes with (agent.serve)
SERVICE_KEY_ENV = AGENT_SERVICE_KEY_ENV
logger = logging.getLogger(__name__)


class AgentCommandError(RuntimeError):
    """The agent command failed: non-zero exit, timeout, or output that names no answer."""


@dataclass(frozen=True)
class CommandLimits:
    """Resource limits of one episode's command (``agent.command_*``; 0 = none); core dumps are always off."""

    memory_mb: int = 8192
    cpu_s: int = 600
    open_files: int = 1024
    #: run without a PID namespace where none can be made (agent.command_allow_unisolated)
    allow_unisolated: bool = False
    #: "endpoint": the command reaches the agent endpoint and nothing else; "host": this machine's network
    network: str = "endpoint"
    #: directories the command may write besides its private /tmp (agent.command_writable)
    writable: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, agent_cfg: Any) -> "CommandLimits":
        for key in ("command_memory_mb", "command_cpu_s", "command_open_files"):
            if getattr(agent_cfg, key) < 0:
                raise ConfigError(f"agent.{key}={getattr(agent_cfg, key)} must be >= 0 (0 = no limit)")
        if agent_cfg.command_network not in ("endpoint", "host"):
            raise ConfigError(f"agent.command_network={agent_cfg.command_network!r}: choose endpoint (the command "
                              f"reaches the agent endpoint only) or host (this machine's network)")
        missing = [d for d in agent_cfg.command_writable if not os.path.isdir(d)]
        if missing:
            raise ConfigError(f"agent.command_writable names {missing}, which are not directories: create them "
                              f"first, or drop them from the list")
        limits = cls(agent_cfg.command_memory_mb, agent_cfg.command_cpu_s, agent_cfg.command_open_files,
                     agent_cfg.command_allow_unisolated, agent_cfg.command_network,
                     tuple(os.path.abspath(d) for d in agent_cfg.command_writable))
        if agent_cfg.command and not agent_cfg.serve:
            limits.prefix(("127.0.0.1", 1))  # refuse the run now, not at its first episode
        return limits

    def prefix(self, endpoint: tuple[str, int], argv: tuple[str, ...] = ()) -> tuple[str, ...]:
        """What the command runs under (module docstring), reaching ``endpoint`` (host, port) as 127.0.0.1 on the
        same port; () with a warning when no isolation can be made and ``allow_unisolated``, else a ConfigError
        naming the opt-out."""
        scripts = tuple(os.path.dirname(os.path.abspath(a)) for a in argv if os.path.isfile(a))  # kept in view
        if self.network == "endpoint":
            prefix = isolation_prefix(network="endpoint", writable=self.writable, endpoint=endpoint, readable=scripts)
        else:
            prefix = isolation_prefix(network="host", writable=self.writable, readable=scripts)
        if prefix or not self.allow_unisolated:
            if not prefix:
                raise ConfigError("agent.command cannot be isolated here: neither 'unshare --pid' (root) nor a user "
                                  "namespace ('unshare --user') works, and setpriv must be installed. Without it a "
                                  "command could read the run's processes and other episodes' keys; run where one "
                                  "works, or set agent.command_allow_unisolated=true to run commands anyway")
            return prefix
        _warn_unisolated()
        return ()

    def apply(self) -> None:
        """In the command's process, before it execs: lower its limits (never above megarl's own hard limits,
        which an unprivileged process cannot raise)."""
        def lower(which: int, soft: int, hard: int | None = None) -> None:
            limit = resource.getrlimit(which)[1]
            hard = soft if hard is None else hard
            if limit != resource.RLIM_INFINITY:
                soft, hard = min(soft, limit), min(hard, limit)
            resource.setrlimit(which, (soft, hard))

        lower(resource.RLIMIT_CORE, 0)
        if self.memory_mb:
            lower(resource.RLIMIT_AS, self.memory_mb << 20)
        if self.cpu_s:  # past it the kernel sends SIGXCPU, which ends the process; SIGKILL a second later
            lower(resource.RLIMIT_CPU, self.cpu_s, self.cpu_s + 1)
        if self.open_files:
            lower(resource.RLIMIT_NOFILE, self.open_files)

    def explain(self, returncode: int, stderr: str) -> str:
        """Which limit a failed command most likely hit ('' when none)."""
        if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and self.cpu_s:
            return f" (killed by signal {-returncode}: past agent.command_cpu_s={self.cpu_s}?)"
        if "MemoryError" in stderr or "Cannot allocate memory" in stderr or "bad_alloc" in stderr:
            return f" (out of memory: agent.command_memory_mb={self.memory_mb} limits its address space)"
        return ""


def parse_command(command: str) -> list[str]:
    """``agent.command`` as an argv; ConfigError when it is empty, unparsable or its program is not found."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise ConfigError(f"agent.command={command!r} cannot be split into words: {e}") from None
    if not argv:
        raise ConfigError("rollout.workflow=agent_http needs agent.command: the program that runs one episode "
                          "(e.g. agent.command='python my_agent.py')")
    if shutil.which(argv[0]) is None:
        raise ConfigError(f"agent.command={command!r}: program {argv[0]!r} is not found (not on PATH, or not "
                          f"executable)")
    return argv


def agent_source(agent_cfg: Any) -> tuple[list[str] | None, str]:
    """What runs the episodes: ``agent.command``'s argv, or None and the service key (``agent.serve``, the key
    from $MEGARL_AGENT_SERVICE_KEY); ConfigError for a setting that cannot work."""
    if not agent_cfg.serve:
        return parse_command(agent_cfg.command), ""
    if agent_cfg.command:
        raise ConfigError(f"agent.serve=true and agent.command={agent_cfg.command!r}: episodes are either run as a "
                          f"command or claimed by an agent service; set one")
    key = take_secret(SERVICE_KEY_ENV)
    if len(key) < 16:
        raise ConfigError(f"agent.serve=true needs ${SERVICE_KEY_ENV}: a secret of at least 16 characters that the "
                          f"agent service sends to claim episodes (POST /sessions)")
    if not agent_cfg.http_port:
        raise ConfigError("agent.serve=true needs a fixed agent.http_port: the agent service must know where to "
                          "claim episodes")
    return None, key


@functools.lru_cache(maxsize=1)
def _warn_unisolated() -> None:
    logger.warning("agent.command runs WITHOUT a PID namespace (agent.command_allow_unisolated=true): it can read "
                   "the environment and memory of this user's other processes")


async def run_command(argv: list[str], row: dict[str, Any], env: dict[str, str], timeout_s: float,
                      limits: CommandLimits | None = None, endpoint: tuple[str, int] = ("127.0.0.1", 1)) -> str:
    """Run one episode's command under ``limits``, isolated, reaching ``endpoint`` (host, port; the agent
    endpoint), in this environment without the run's secrets and rendezvous facts plus ``env``; its stdout.
    AgentCommandError on a non-zero exit or past ``timeout_s``."""
    limits = limits or CommandLimits()
    prefix = limits.prefix(endpoint, tuple(argv))
    proc = await asyncio.create_subprocess_exec(*prefix, *argv, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=user_code_env(**env),
                                                start_new_session=True,  # its own group: a timeout kills it all
                                                preexec_fn=limits.apply)
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(row, default=str).encode()), timeout_s)
    except asyncio.TimeoutError:
        raise AgentCommandError(f"agent.command ran past agent.timeout_s={timeout_s:g}s and was killed") from None
    finally:
        if proc.returncode is None:  # timed out or cancelled
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
    returncode = exit_status(proc.returncode, prefix)
    if returncode != 0:
        tail = err.decode(errors="replace").strip()[-STDERR_TAIL:]
        raise AgentCommandError(f"agent.command exited with status {returncode}"
                                f"{limits.explain(returncode, tail)}: {tail}")
    return out.decode(errors="replace")


def parse_answer(stdout: str) -> tuple[str, float | None]:
    """The final answer (last non-empty line of stdout) and the reward it gives, if it is ``{"reward": r}``."""
    lines = [x.strip() for x in stdout.splitlines() if x.strip()]
    if not lines:
        raise AgentCommandError("agent.command printed nothing: its last line of stdout must be the final answer "
                                "or {\"reward\": r}")
    last = lines[-1]
    if last.startswith("{"):
        try:
            obj = json.loads(last)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and "reward" in obj:
            r = obj["reward"]
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise AgentCommandError(f"agent.command's reward must be a finite number, got {r!r}")
            return last, float(r)
    return last, None


class AgentHttpWorkflow(AgentWorkflow):
    """Runs ``agent.command`` for one trajectory against the endpoint (module docstring)."""

    def __init__(self, argv: list[str] | None, tokenizer: Any, limits: AgentLimits, *, host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 300.0, max_concurrency: int = 8, service_key: str = "",
                 command_limits: CommandLimits | None = None, strict_model_name: bool = False) -> None:
        """``argv`` None: episodes wait for a long-lived agent service holding ``service_key`` (http_service.py);
        ``strict_model_name``: the endpoint refuses a model name other than the run's (agent.strict_model_name)."""
        super().__init__(self._episode, tokenizer, None, limits)
        self.strict_model_name = strict_model_name
        self.command_limits = command_limits or CommandLimits()
        self.argv, self.host, self.port, self.timeout_s = argv, host, port, timeout_s
        self.service_key = service_key
        self.max_concurrency = max_concurrency
        self.server: AgentHttpServer | None = None
        self._starting: asyncio.Lock | None = None
        self._slots: asyncio.Semaphore | None = None

    async def run(self, traj: Trajectory, generate: GenerateFn) -> Trajectory:
        await self.start()
        return await super().run(traj, generate)

    async def start(self) -> None:
        """Listen (on the running loop; the first episode does it)."""
        if self._starting is None:
            self._starting = asyncio.Lock()
            self._slots = asyncio.Semaphore(self.max_concurrency)
        async with self._starting:
            if self.server is None:
                self.server = await SHARED.acquire(self.host, self.port, self.tokenizer.source, self.service_key,
                                                   self.strict_model_name)

    async def serve_rows(self, rows: Any) -> None:
        """Listen now and roll out the rows an agent service posts into ``rows`` (a ServiceRows): nothing
        else starts the endpoint before the first row arrives."""
        await self.start()
        self.server.offers.rows = rows

    async def _episode(self, client: AgentClient, row: dict[str, Any]) -> float | None:
        session = self.server.open_session(client, self.timeout_s)
        try:
            if self.argv is None:
                answer, reward = await self._served(session, row)
            else:
                async with self._slots:
                    out = await run_command(self.argv, row, {"OPENAI_BASE_URL": self._base_url(),
                                                             "OPENAI_API_KEY": session.key}, self.timeout_s,
                                            self.command_limits, (self.server.host, self.server.port))
        finally:
            await self.server.close_session(session)
        if session.error is not None:  # a completion past the budget, or megarl failed: the episode fails
            raise AgentCommandError(session.error)
        if self.argv is not None:
            answer, reward = parse_answer(out)
        client.final_text = answer  # what reward.fn scores when the command gives no reward
        return reward

    def _base_url(self) -> str:
        """OPENAI_BASE_URL as the command sees it: 127.0.0.1 on the endpoint's port inside an endpoint-only
        network, the endpoint's own address on the host's."""
        if self.command_limits.network == "endpoint":
            return f"http://127.0.0.1:{self.server.port}/v1"
        return self.server.base_url

    async def _served(self, session, row: dict[str, Any]) -> tuple[str, float | None]:
        """Offer the episode to an agent service and wait for its outcome (at most agent.timeout_s)."""
        outcome = self.server.offers.offer(session, row)
        try:
            return await asyncio.wait_for(outcome, self.timeout_s)
        except asyncio.TimeoutError:
            raise AgentCommandError(f"no agent service claimed and ended the episode within agent.timeout_s="
                                    f"{self.timeout_s:g}s (POST /sessions, then POST /sessions/<key>/reward)") from None
        finally:
            self.server.offers.withdraw(session)

    def failure_help(self, cause: str, n: int, example: str) -> str:
        """What failed ``n`` episodes, ``example`` the last (its command's exit status and stderr), and the fix."""
        if self.argv is None:
            return service_help(self.timeout_s, self.limits, n, example)
        return command_help(self.argv, self.timeout_s, self.limits, n, example)

    async def aclose(self) -> None:
        if self.server is not None:
            await SHARED.release(self.server, self.port)
            self.server = None
