"""Talking to `megarl engine` processes: an async HTTP client and a launcher.

:class:`EngineClient` implements the :class:`~megarl.rollout.base.Engine`
interface over HTTP, raising the exception class the server reported
(InputError for a prompt too long, EngineError for a refused update, ...),
and EngineError naming the URL when the engine cannot be reached.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from megarl import errors
from megarl.errors import EngineError
from megarl.isolation.secret_env import pass_by_pipe, scrubbed_env
from megarl.platform.cpu_affinity import format_cores
from megarl.rollout.engine_key import ENGINE_KEY_ENV, auth_headers, engine_key_from_env, new_engine_key
from megarl.types import GenerateRequest, GenerateResult


class EngineKeyRefused(EngineError):
    """An engine answered 401: it runs, and this process's engine key is not the run's."""


class EngineClient:
    """Async client of one engine server, e.g. ``EngineClient("http://127.0.0.1:8000")``.

    Holds one aiohttp session per event loop (tests run several ``asyncio.run``);
    call :meth:`close` from the loop that used it. Every request carries ``key``
    (default: ``MEGARL_ENGINE_KEY`` of this process; megarl/rollout/engine_key.py).
    """

    def __init__(self, url: str, timeout_s: float = 60.0, key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.key = engine_key_from_env() if key is None else key
        self._headers = auth_headers(self.key)
        self.timeout_s = timeout_s  # control calls; generate and update_weights wait as long as they take
        self._session: aiohttp.ClientSession | None = None
        self._loop = None

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(headers=self._headers)
            self._loop = loop
        return self._session

    async def _call(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = -1) -> dict:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s if timeout_s == -1 else timeout_s)
        try:
            async with self._http().request(method, self.url + path, json=body, timeout=timeout) as resp:
                try:
                    data = await resp.json(content_type=None)
                except (json.JSONDecodeError, aiohttp.ContentTypeError) as e:
                    raise EngineError(f"engine at {self.url}{path}: HTTP {resp.status}, not JSON ({e})") from e
        except aiohttp.ClientError as e:
            raise EngineError(f"engine at {self.url} unreachable ({type(e).__name__}: {e})") from e
        except asyncio.TimeoutError as e:
            raise EngineError(f"engine at {self.url}{path} did not answer within {timeout.total} s") from e
        if resp.status == 401:  # the engine is up and refuses this process's key: waiting changes nothing
            raise EngineKeyRefused(f"engine at {self.url} refused this process's key (HTTP 401): every process of "
                                   f"the run needs the same {ENGINE_KEY_ENV} (with torchrun on several nodes, export "
                                   f"the same key on every node)")
        if resp.status >= 400 or (isinstance(data, dict) and "error" in data):
            cls = getattr(errors, str(data.get("type")), None) if isinstance(data, dict) else None
            if not (isinstance(cls, type) and issubclass(cls, errors.MegarlError)):
                cls = EngineError
            msg = data.get("error") if isinstance(data, dict) else data
            raise cls(f"{msg} (engine at {self.url})")
        return data

    # -- Engine interface ----------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        return GenerateResult.from_dict(await self._call("POST", "/generate", req.to_dict(), timeout_s=None))

    async def abort_all(self) -> None:
        await self._call("POST", "/abort_all", {})

    async def update_weights_from_disk(self, path: str, version: int) -> dict[str, float] | None:
        body = {"path": str(path), "version": version}
        return (await self._call("POST", "/update_weights", body, timeout_s=None)).get("phases")

    async def update_weights_from_broadcast(self, group_info: dict, names_shapes_dtypes: list,
                                            version: int) -> dict[str, float] | None:
        body = {"group_info": group_info, "version": version,
                "names_shapes_dtypes": [[n, list(s), d] for n, s, d in names_shapes_dtypes]}
        return (await self._call("POST", "/update_weights", body, timeout_s=None)).get("phases")

    async def version(self) -> int:
        return int((await self._call("GET", "/version"))["version"])

    async def health(self) -> dict:
        return await self._call("GET", "/health")

    async def pause(self) -> None:
        await self._call("POST", "/pause", {})

    async def resume(self) -> None:
        await self._call("POST", "/resume", {})

    async def close(self) -> None:
        """Close the HTTP session (the engine process keeps running: see :func:`stop_engine_process`)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at ``host`` now (an IPv6 literal gets an IPv6 socket)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def launch_engine_process(checkpoint: str, backend: str = "vllm", port: int | None = None,
                          host: str = "127.0.0.1", *, extra_args: list[str] | tuple = (),
                          env: dict | None = None, log_path: str | None = None,
                          startup_timeout_s: float = 300.0, initial_version: int = 0,
                          exit_with_parent: bool = True, kv_cache_gb: int | None = None,
                          cpu_threads: int | None = None, kv_block_size: int = 0,
                          cpu_cores: list[int] | None = None) -> tuple[subprocess.Popen, EngineClient]:
    """Start ``python -m megarl.cli engine ...`` and wait until its /health answers.

    The process gets its own session (process group), so :func:`stop_engine_process`
    also ends vLLM's engine-core child. With ``exit_with_parent`` (default) it
    shuts itself down when this process dies, however it dies (``--parent-pid``).
    ``initial_version`` is the weight version the checkpoint holds (a restart
    or a resume from later weights). Output goes to ``log_path`` (a temp file
    by default, ``proc.log_path``); its tail is in the EngineError if start fails.
    ``kv_cache_gb`` and ``cpu_threads`` become the engine's ``--kv-cache-gb`` and
    ``--cpu-threads`` (rollout.kv_cache_gb, rollout.cpu_threads; None: the flags'
    defaults); ``kv_block_size`` (rollout.kv_block_size) its ``--kv-block-size`` when set. ``cpu_cores``
    become ``--cpu-cores`` (placement.cpu_affinity.engines): the engine pins itself and vLLM's processes to them.
    ``env`` adds to this process's environment; a variable set to None is removed.
    The engine's key (``MEGARL_ENGINE_KEY`` of ``env`` or of this process, else a new one) goes to it through a
    pipe (megarl/isolation/secret_env.py: never in its environment, where /proc shows it), and the returned client
    sends it;
    the run's other secrets do not go to it at all.
    """
    port = port or free_port(host)
    log = Path(log_path or tempfile.mkstemp(prefix=f"megarl-engine-{port}-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "megarl.cli", "engine", "--checkpoint", str(checkpoint), "--backend", backend,
           "--host", host, "--port", str(port), *extra_args]
    if initial_version:
        cmd += ["--initial-version", str(initial_version)]
    if kv_cache_gb is not None:
        cmd += ["--kv-cache-gb", str(kv_cache_gb)]
    if cpu_threads is not None:
        cmd += ["--cpu-threads", str(cpu_threads)]
    if kv_block_size:
        cmd += ["--kv-block-size", str(kv_block_size)]
    if cpu_cores:
        cmd += ["--cpu-cores", format_cores(cpu_cores)]
    key = (env or {}).get(ENGINE_KEY_ENV) or engine_key_from_env() or new_engine_key()
    child_env = scrubbed_env({**os.environ, **(env or {})})  # no secret but its own key, which goes by a pipe
    key_fd = pass_by_pipe(ENGINE_KEY_ENV, key, child_env)
    if exit_with_parent:
        cmd += ["--parent-pid", str(os.getpid())]
    with open(log, "wb") as out:
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, pass_fds=(key_fd,),
                                    env={k: v for k, v in child_env.items() if v is not None}, start_new_session=True)
        finally:
            os.close(key_fd)
    proc.log_path = str(log)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + startup_timeout_s
    while True:
        rc = proc.poll()
        if rc is not None:
            raise EngineError(f"engine process for {checkpoint} exited with code {rc} before serving "
                              f"(log {log}):\n{_tail(log)}")
        try:
            health = urllib.request.Request(url + "/health", headers=auth_headers(key))
            with urllib.request.urlopen(health, timeout=2) as resp:
                if json.loads(resp.read()).get("ok"):
                    return proc, EngineClient(url, key=key)
        except (OSError, ValueError):
            pass  # not listening yet
        if time.monotonic() > deadline:
            stop_engine_process(proc)
            raise EngineError(f"engine at {url} not healthy after {startup_timeout_s:.0f} s (log {log}):\n"
                              f"{_tail(log)}")
        time.sleep(0.25)


#: run detached by :func:`stop_engine_process` with ``wait=False``: waits until the server (argv[1]) has
#: exited or argv[2] seconds have passed, then SIGKILLs what is left of its process group
_REAPER = """
import os, signal, sys, time
pid, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
def running():
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
while running() and time.monotonic() < deadline:
    time.sleep(0.2)
try:
    os.killpg(pid, signal.SIGKILL)
except (ProcessLookupError, PermissionError):
    pass
"""


def stop_engine_process(proc: subprocess.Popen, timeout_s: float = 30.0, wait: bool = True) -> int | None:
    """SIGTERM the server (it shuts its engine down cleanly), then SIGKILL whatever is left of its group.

    ``wait=False`` (the end of a run) returns at once: vLLM's orderly shutdown takes seconds that nothing
    waits on, so a small detached process waits for it (``timeout_s`` at most) and then SIGKILLs what is left.
    """
    if not wait and proc.poll() is None:
        proc.terminate()
        subprocess.Popen([sys.executable, "-c", _REAPER, str(proc.pid), str(timeout_s)], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return None
    if proc.poll() is None:
        # the server only: signalling vLLM's children too makes them die under the server's
        # orderly shutdown, which then waits on them for seconds
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # engine-core/worker processes left behind, if any
    except (ProcessLookupError, PermissionError):
        pass
    return proc.returncode


async def connect_engine(addr: str, timeout_s: float = 600.0):
    """(None, client) for an engine another process started; waits until it is healthy."""
    client = EngineClient(addr if addr.startswith("http") else f"http://{addr}")
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await client.health()
            return None, client
        except EngineKeyRefused:
            await client.close()
            raise
        except EngineError:
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError(f"engine at {addr} did not become healthy within {timeout_s:.0f} s") from None
            await asyncio.sleep(2.0)
