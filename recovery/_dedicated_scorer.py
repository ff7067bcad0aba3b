"""The dedicated scorer's side: the process that holds the old-logits model (recovery/dedicated.py).

Two ways to run it, one message loop (:func:`_serve`): a child spawned beside
trainer rank 0 (:func:`_child_main`, multiprocessing queues), or a launched
role on its own node (:func:`serve_role`, an authenticated TCP link from
recovery/_dedicated_link.py). It loads each published version from an HF
checkpoint directory and scores the segments that version generated.
"""
from __future__ import annotations

import importlib
import logging
import os
import shutil
import signal
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.errors import ConfigError
from megarl.launch.listen_check import server_listen_address
from megarl.launch.memory import SCORER_MICRO_BATCH_TOKENS
from megarl.rollout.base import logprob_temperature
from megarl.rollout.client import free_port
from megarl.routes import RouteSegment, newest_routes
from megarl.trainer.megatron_trainer import MegatronTrainer
from megarl.types import TrainBatch, Trajectory
from recovery import _dedicated_link as link
from recovery import _dedicated_listener as listening

log = logging.getLogger("megarl.dedicated")


@dataclass
class DedicatedConfig:
    """Options of the dedicated scoring process."""

    scorer_factory: str = ""
    """Builder of the scoring model in the child, 'pkg.module:function' called with the checkpoint dir and temperature=T (score softmax(logits / T)); empty = MegatronTrainer (tp=pp=ep=1)."""
    master_port: int = 0
    """MASTER_PORT of the scoring process's own gloo world of one; 0 picks a free port."""
    cuda_visible_devices: str = ""
    """CUDA_VISIBLE_DEVICES of the scoring process, i.e. its own GPU(s); empty = inherit the trainer's."""
    num_threads: int = 0
    """Intra-op CPU threads of the scoring process (0 = torch's default)."""
    start_timeout_s: float = 600.0
    """Seconds to wait for the scoring process to build its model."""
    wait_timeout_s: float = 600.0
    """Seconds anchor() waits for missing segment scores before giving up with an error."""
    listen_host: str = ""
    """Scorer role with its own command: the address it listens on; empty = its node's address in the plan (MEGARL_SERVER_HOST, the one the trainer reaches), 0.0.0.0 = every interface."""
    peer_timeout_s: float = 60.0
    """Scorer role with its own command: it ends when the trainer has sent nothing, not even its heartbeat (every 5 s), for this long (the trainer's host is gone without closing the connection)."""
    micro_batch_tokens: int = SCORER_MICRO_BATCH_TOKENS
    """Token budget of one micro-batch of the default (MegatronTrainer) scorer, its own and not trainer.micro_batch_tokens; a scorer_factory builds its own. Segments are packed as the trainer packs rows and a longer row gets a micro-batch of its own, so `megarl plan` sizes the scorer's one GPU with max(this, data.max_prompt_len + rollout.max_new_tokens) tokens: all the weights, then one layer's activations or those tokens' logits (10 B per vocabulary entry). 4096 (the trainer's default) is below the Qwen3-30B-A3B config's 9216-token rows, so one row sets its peak: 61.1 GB of bf16 weights + 14.0 GB of logits + 3 GB reserve = 78.1 GB of an 80 GB GPU; a smaller budget would not shrink that row's logits, only run more forwards over short segments, and 16384 (24.9 GB of logits) would not fit."""


def _build_scorer(factory: str, checkpoint_dir: str, dtype: str = "float32", temperature: float = 1.0,
                  allow_local_spec: bool = False, batch_invariant: bool = False,
                  micro_batch_tokens: int = SCORER_MICRO_BATCH_TOKENS) -> Any:
    """The scoring model; it scores at the trainer's ``temperature`` (the engines' sampling temperature)
    and, under ``rollout.batch_invariant``, on the trainer's batch-invariant kernels, or its log-probs would
    not be the trainer's. A ``factory`` is handed ``batch_invariant=True`` when the run asks for it. The
    default scorer packs its forwards into micro-batches of ``micro_batch_tokens``
    (``recovery.dedicated.micro_batch_tokens``, the budget `megarl plan` sizes its GPU with)."""
    if factory:
        module, _, fn = factory.partition(":")
        extra = {"batch_invariant": True} if batch_invariant else {}
        return getattr(importlib.import_module(module), fn)(checkpoint_dir, temperature=temperature, **extra)
    # forward-only: no DDP gradient buffer (fp32, twice the bf16 weights) and no optimizer in a scoring process
    return MegatronTrainer(checkpoint_dir, tp=1, pp=1, ep=1, dtype=dtype, temperature=temperature, forward_only=True,
                           allow_local_spec=allow_local_spec, batch_invariant=batch_invariant,
                           micro_batch_tokens=micro_batch_tokens)


def _score(scorer: Any, jobs: list[dict]) -> list[tuple[str, int, int, list[float], Any]]:
    """One forward over the segments' sequences (prompt + response up to the segment's end), each replaying the
    routes of the request that generated it (``routes``: [positions, layers, k], or None: routed live). Each
    result carries the routes the forward replayed at the segment's positions (None without replay)."""
    trajs = [Trajectory(traj_id=j["traj_id"], group_id="", prompt_ids=j["prompt_ids"],
                        response_ids=j["response_ids"], logp_behav=[0.0] * len(j["response_ids"]),
                        versions=[j["version"]] * len(j["response_ids"]), loss_mask=[1] * len(j["response_ids"]))
             for j in jobs]
    batch = TrainBatch.from_trajectories(trajs, version=0)
    if any(j.get("routes") is not None for j in jobs):
        batch.routes = newest_routes([[] if j.get("routes") is None else [RouteSegment(0, j["routes"])]
                                      for j in jobs], batch.loss_mask.shape[1])
    logp = scorer.logprobs(batch).float().cpu()
    out = []
    for b, j in enumerate(jobs):
        base = len(j["prompt_ids"]) - 1
        lo, hi = base + j["start"], base + j["end"]
        # the routes this forward replayed at the scored positions, for the verifier to compare by id
        replayed = None if batch.routes is None else batch.routes[b, lo:hi].numpy()
        out.append((j["traj_id"], j["start"], j["end"], logp[b, lo:hi].tolist(), replayed))
    return out


def _child_main(factory: str, checkpoint_dir: str, env: dict[str, str], num_threads: int, in_q, out_q,
                dtype: str = "float32", temperature: float = 1.0, allow_local_spec: bool = False,
                batch_invariant: bool = False, micro_batch_tokens: int = SCORER_MICRO_BATCH_TOKENS) -> None:
    # a stop signal sent to trainer rank 0's process group (torchrun passes its stop on with killpg) is the
    # trainer's to handle: it still needs this process to checkpoint the strategy's state, then closes it
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    _own_world(env)
    try:
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        scorer = _build_scorer(factory, checkpoint_dir, dtype, temperature, allow_local_spec, batch_invariant,
                               micro_batch_tokens)
        _serve(scorer, in_q.get, out_q.put)
    except BaseException:  # noqa: BLE001 - the parent must hear about any failure
        out_q.put(("error", traceback.format_exc()))


def listen_address(cfg: DedicatedConfig, server_host: str = "", controller: str = "") -> str:
    """The address the scorer role binds: ``recovery.dedicated.listen_host``, else its node's in the plan
    (``server_host``, MEGARL_SERVER_HOST; this host's name without one), resolved here; refused where that is
    loopback while ``controller`` (MEGARL_CONTROLLER_HOST, trainer rank 0's node) is another node
    (megarl/launch/listen_check.py)."""
    if cfg.listen_host:
        return cfg.listen_host
    return server_listen_address(server_host or socket.gethostname(), controller)


def serve_role(run_cfg: Any, port: int, authkey: bytes | None = None, host: str | None = None,
               server_host: str = "", controller: str = "") -> None:
    """The scorer as a launched role (``MEGARL_ROLE=dedicated``): serve trainer rank 0 over TCP, then return.

    ``run_cfg`` is the run's config (the same file and overrides as the
    trainer's command): the model comes from ``model.checkpoint`` in
    ``model.dtype`` scoring at ``rollout.temperature`` (under ``rollout.batch_invariant`` on the
    batch-invariant kernels, as the trainer), the options from ``recovery.dedicated``;
    ``cuda_visible_devices`` does not apply (the launcher gives the role its
    GPUs). ``authkey`` defaults to ``MEGARL_DEDICATED_AUTHKEY``; ``host`` (the address to bind) to
    :func:`listen_address` of ``server_host`` and ``controller``.

    It listens first and accepts the trainer's connection in the background
    while it builds its model (so a wrong key fails the trainer at once, not
    after a long model load), then serves the protocol until ``stop`` or until
    the trainer hangs up.
    """
    if run_cfg.recovery.name != "dedicated":
        raise ConfigError(f"MEGARL_ROLE=dedicated with recovery.name={run_cfg.recovery.name}: the trainer would "
                          f"never connect; launch the scorer role only with recovery.name=dedicated")
    if port <= 0:
        raise ConfigError("the dedicated scorer role needs MEGARL_SERVER_PORT (the TCP port to listen on); "
                          "`megarl launch` sets it from placement.engine_port")
    checkpoint_dir = run_cfg.model.checkpoint
    if not (Path(checkpoint_dir) / "config.json").is_file():
        raise ConfigError(f"the dedicated scorer role needs model.checkpoint={checkpoint_dir!r} to hold an HF "
                          f"checkpoint (config.json) that this node can read")
    cfg: DedicatedConfig = run_cfg.recovery.options.get("dedicated") or DedicatedConfig()
    dtype = run_cfg.model.dtype
    if cfg.peer_timeout_s <= 2 * listening.HEARTBEAT_S:
        raise ConfigError(f"recovery.dedicated.peer_timeout_s={cfg.peer_timeout_s:g} must exceed twice the "
                          f"trainer's heartbeat ({listening.HEARTBEAT_S:g} s), or a quiet trainer would be dropped")
    key = link.authkey_from_env() if authkey is None else authkey
    host = listen_address(cfg, server_host, controller) if host is None else host
    listener = listening.listen(port, host)
    log.info("dedicated scorer listening on %s:%d", host, port)
    try:
        pending = listening.accept_in_background(listener, key, log.warning)
        _own_world({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cfg.master_port or free_port())})
        build_error = None
        try:
            if cfg.num_threads > 0:
                torch.set_num_threads(cfg.num_threads)
            scorer = _build_scorer(cfg.scorer_factory, checkpoint_dir, dtype,
                                   logprob_temperature(run_cfg.rollout.temperature), run_cfg.model.allow_local_spec,
                                   run_cfg.rollout.batch_invariant, cfg.micro_batch_tokens)
        except Exception:  # noqa: BLE001 - reported to the trainer below
            build_error = traceback.format_exc()
        conn = pending.get()  # the trainer connects at its first publish
        log.info("trainer connected")
        try:
            if build_error is not None:
                raise RuntimeError(f"building the scorer failed:\n{build_error}")
            _serve(scorer, listening.reader(conn, cfg.peer_timeout_s, log.warning), conn.send)
        except (ConnectionError, EOFError):  # the trainer hung up while a reply was on its way
            log.info("the trainer closed the connection")
        except BaseException:
            try:
                conn.send(("error", traceback.format_exc()))
            except (OSError, ValueError):
                pass
            raise
        finally:
            link.hang_up(conn)
    finally:
        listener.close()
    log.info("dedicated scorer done")


def _own_world(env: dict[str, str]) -> None:
    """Make this process a torch world of its own, described by ``env`` (RANK, MASTER_PORT, ...)."""
    # drop the launcher's rendezvous settings (under torchrun, TORCHELASTIC_USE_AGENT_STORE would make
    # this process join the trainer's store as a second "rank 0" and wait forever)
    for key in [k for k in os.environ if k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_", "OMPI_", "PMI_"))]:
        del os.environ[key]
    os.environ.update(env)


def _serve(scorer: Any, recv, send) -> None:
    """The protocol (recovery/_dedicated_link.py) until ``stop`` or until the trainer hangs up (``closed``)."""
    version, version_dir = None, None
    send(("ready", None))
    while True:
        kind, payload = recv()
        if kind in ("stop", "closed"):
            break
        if kind == "version":
            v, path = payload
            scorer.load_hf_checkpoint(path)
            if version_dir and version_dir != path:
                shutil.rmtree(version_dir, ignore_errors=True)
            version, version_dir = v, path
            send(("loaded", v))
        elif kind == "score":
            wrong = [j for j in payload if j["version"] != version]
            if wrong:
                send(("lost", [((j["traj_id"], j["start"], j["end"]), j["version"], version) for j in wrong]))
            ok = [j for j in payload if j["version"] == version]
            if ok:
                send(("scored", _score(scorer, ok)))
        elif kind == "state":
            send(("state", version))
