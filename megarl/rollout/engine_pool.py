"""One set of engine processes serving several runs in turn (``megarl verify-recovery``, ``megarl bench``).

Starting an engine takes tens of seconds (vLLM on CPU) to minutes (on GPUs).
The runs of one multi-run command share the model and the engine settings, so
:class:`EnginePool` starts the engines once and every run connects to them:

* a run's engines are the pool's when their launch arguments
  (:func:`engine_launch_kwargs`: checkpoint, backend, dtype, routes, KV cache,
  threads, cores, environment, port) and their number equal those of the
  engines running; otherwise the pool stops them and starts the run's own;
* before its first step a run resets every pooled engine to the base
  checkpoint at version 0 (megarl/builder.py), so it starts exactly where a
  freshly started engine would;
* an engine that dies during a run is relaunched through the pool
  (:meth:`EnginePool.relaunch`, the run's supervisor loads the current weights
  into it); one found dead when a run starts is relaunched too;
* the run's supervisor never stops a pooled engine: :meth:`EnginePool.close`
  does, at the end of the command, also after an error or Ctrl-C
  (``with EnginePool(dir) as pool:``). The engines also exit with this process.

Engine logs go to the pool's directory: ``engineN.log``, then
``engineN.launchK.log`` for the K-th later start of engine N. Every engine of
a pool has the same key (``MEGARL_ENGINE_KEY``, or a new one), so that a run
in another process (``megarl bench`` runs each in a child) reaches them with
:class:`ConnectedEngines` given only their URLs and that key.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megarl.config import MegaRLConfig
from megarl.errors import ConfigError
from megarl.platform import batch_invariant
from megarl.rollout.base import wants_routed_experts
from megarl.rollout.client import EngineClient, launch_engine_process, stop_engine_process
from megarl.rollout.engine_key import ENGINE_KEY_ENV, engine_key_from_env, new_engine_key
from megarl.rollout.local_gpus import engine_gpu_env


def engine_launch_kwargs(cfg: MegaRLConfig, ckpt: Path, i: int) -> dict[str, Any]:
    """The arguments of :func:`launch_engine_process` for engine ``i`` of a run (all but its log path); an engine
    of ``placement.engine_tp`` > 1 vLLM workers, as `megarl launch` starts it."""
    ro, tp = cfg.rollout, cfg.placement.engine_tp
    routes = ["--routed-experts"] if wants_routed_experts(ro) else []
    if tp > 1 and ro.backend != "vllm":
        raise ConfigError(f"placement.engine_tp={tp} needs rollout.backend=vllm (the {ro.backend} engine runs one "
                          f"worker); set placement.engine_tp=1")
    workers = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    return {"checkpoint": str(ckpt), "backend": ro.backend, "port": ro.base_port + i if ro.base_port else None,
            "extra_args": ["--dtype", cfg.engine_dtype, *workers, *routes], "kv_cache_gb": ro.kv_cache_gb,
            "kv_block_size": ro.kv_block_size, "cpu_threads": ro.cpu_threads,
            "cpu_cores": cfg.placement.cpu_affinity.engines,
            # engine_tp GPUs of its own on a multi-GPU machine, never the trainer's GPU 0
            "env": {**(engine_gpu_env(i, ro.n_engines, tp) or {}), **batch_invariant.engine_env(cfg)} or None}


class EnginePool:
    """The engines of a sequence of runs, started once; their logs in ``log_dir`` (module doc)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        #: launch arguments of each engine now running (None: none yet)
        self._kwargs: list[dict[str, Any]] | None = None
        self._engines: list[tuple[Any, EngineClient] | None] = []
        self._launches: dict[int, int] = {}  # engine index -> starts so far (names the logs)
        self._lock = threading.Lock()
        #: how many engines the pool started in all (tests and logs)
        self.n_started = 0
        #: the key every engine of the pool serves with (megarl/rollout/engine_key.py)
        self.key = engine_key_from_env() or new_engine_key()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def use(self, cfg: MegaRLConfig, ckpt: Path) -> None:
        """Make the pool serve ``cfg``'s engines: keep the running ones when their launch arguments are the
        same, else stop them (the next :meth:`engine` call starts the run's own)."""
        kwargs = [engine_launch_kwargs(cfg, ckpt, i) for i in range(cfg.rollout.n_engines)]
        with self._lock:
            if kwargs == self._kwargs:
                return
            self._stop_all(wait=True)  # before new engines take their memory and ports
            self._kwargs = kwargs
            self._engines = [None] * len(kwargs)

    def engine(self, i: int) -> tuple[None, EngineClient]:
        """(None, a client) of pooled engine ``i``, started now when it is not running. Blocking: run in a
        thread. The process is None for the run: its supervisor must not stop it."""
        if self._kwargs is None:
            raise RuntimeError("EnginePool.engine called before use(cfg, ckpt)")
        held = self._engines[i]
        if held is None or held[0].poll() is not None:
            return self.relaunch(i)
        return None, EngineClient(held[1].url, key=held[1].key)

    def relaunch(self, i: int) -> tuple[None, EngineClient]:
        """Stop what is left of engine ``i`` and start it again on the base checkpoint (the supervisor's
        restart of a pooled engine). Blocking: run in a thread."""
        held = self._engines[i]
        if held is not None:
            stop_engine_process(held[0], 5.0)
        n = self._launches.get(i, 0)
        self._launches[i] = n + 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / (f"engine{i}.log" if not n else f"engine{i}.launch{n}.log")
        self._engines[i] = None
        kwargs = self._kwargs[i]
        proc, client = launch_engine_process(**{**kwargs, "env": {**(kwargs["env"] or {}), ENGINE_KEY_ENV: self.key}},
                                             log_path=str(log))
        self._engines[i] = (proc, client)
        self.n_started += 1
        return None, EngineClient(client.url, key=client.key)

    def start(self, cfg: MegaRLConfig, ckpt: Path) -> list[str]:
        """:meth:`use`, then the URL of every engine, each started (in parallel) when it is not running."""
        self.use(cfg, ckpt)
        with ThreadPoolExecutor(max(1, len(self._engines))) as threads:
            return [client.url for _, client in threads.map(self.engine, range(len(self._engines)))]

    def pids(self) -> list[int]:
        """The process ids of the engines running now."""
        return [held[0].pid for held in self._engines if held is not None and held[0].poll() is None]

    def close(self) -> None:
        """Stop every engine of the pool (without waiting for their orderly shutdown)."""
        with self._lock:
            self._stop_all(wait=False)
            self._kwargs = None

    def _stop_all(self, wait: bool) -> None:
        for held in self._engines:
            if held is not None:
                stop_engine_process(held[0], 30.0, wait=wait)
        self._engines = []


class ConnectedEngines:
    """A pool's engines seen from a run in another process: their URLs (the key: ``MEGARL_ENGINE_KEY``).

    The pool's process started them and checked that their settings are the run's. A run cannot start
    them again from here: one that dies is dropped, and the run fails when none is left.
    """

    relaunch = None

    def __init__(self, urls: list[str]) -> None:
        self.urls = list(urls)

    def use(self, cfg: MegaRLConfig, ckpt: Path) -> None:
        if len(self.urls) != cfg.rollout.n_engines:
            raise ConfigError(f"{len(self.urls)} pooled engine(s) given for rollout.n_engines="
                              f"{cfg.rollout.n_engines}; start the pool with the run's config")

    def engine(self, i: int) -> tuple[None, EngineClient]:
        return None, EngineClient(self.urls[i])


#: what a run takes as its ``engine_pool`` (megarl/train.py)
PooledEngines = EnginePool | ConnectedEngines
