"""dedicated (exact): a separate old-logits model that follows the engines version by version.

::

    loop hooks (trainer process)                      scoring process (spawned)
    on_rollout_interrupted / on_segment_finished ──► ("score", segments) ─┐ FIFO: every segment
    on_weights_published(v): save HF weights    ───► ("version", v, dir) ─┤ reported before v is
                                                                          │ scored with v-1
    anchor(): join results into traj.logp_old   ◄─── ("scored", results) ◄┘

The scoring process owns its own model: by default a forward-only
``MegatronTrainer`` (weights only: no gradient buffer, no optimizer) with
tp = pp = ep = 1 in its own gloo world of size one (its own MASTER_PORT), built
from ``ctx.checkpoint_dir`` in the trainer's dtype (``ctx.trainer.dtype``: a
float32 scorer of a bf16 policy would not return the trainer's log-probs), at
its temperature (``ctx.trainer.temperature``, the engines' sampling temperature)
and in its kernel mode (``ctx.trainer.batch_invariant``: ``rollout.batch_invariant``);
``scorer_factory`` can name another builder. Its forwards are packed into micro-batches of
``micro_batch_tokens`` (its own budget, not the trainer's; a longer row is scored alone), the budget
``megarl plan`` sizes the scorer's one GPU with. The scorer's side (its message
loop, the spawned child, the launched role) is recovery/_dedicated_scorer.py.

Weights transport (chosen): at ``on_weights_published(v)`` the trainer writes
version v as an HF checkpoint (``trainer.save_hf_checkpoint``) to
``<run_dir>/dedicated/v{v}`` and the directory's path goes down the queue. The
HF layout does not depend on the trainer's TP/PP/EP sizes, so the scoring
process loads it whatever they are; it deletes a version's directory once
the next version is loaded. (Sending tensors through the queue would avoid the
disk write, but the trainer's local parameters are shards under TP/PP.)

Ordering: segments reported by ``on_rollout_interrupted`` and
``on_segment_finished`` are enqueued before the next version message, so the
process scores each one with the version that generated it before it moves on.
Results ``(traj_id, start, end, logps)`` come back on a result queue and are
joined into ``traj.logp_old`` by trajectory id and segment. ``anchor`` waits
only if the batch needs a segment that is not scored yet (overhead keys
``dedicated_wait_s``, ``n_waits``; also ``dedicated_save_s``, ``bytes_moved``,
and the scorer's lag at each step: ``pending_segments`` sent and not scored
yet, ``lag_s`` the age of the oldest of them).
The process starts at the first publish and builds its model while the loop
goes on; only ``anchor`` and ``state_dict`` wait for it.

On its own node(s): when ``MEGARL_DEDICATED_ADDR`` (host:port) is set, as
``megarl launch`` sets it for the trainer when the plan puts the scorer on a
node of its own, trainer rank 0 does not spawn the process; it connects to the
scorer role started by its own command (``MEGARL_ROLE=dedicated``, which
builds the same model with :func:`_build_scorer`, listens on
``MEGARL_SERVER_PORT`` and runs :func:`serve_role`). The connection is
retried in the background until ``start_timeout_s``; the messages are the same
as with the spawned child (recovery/_dedicated_link.py, which also says how the
connection is authenticated). Weight versions still travel as HF checkpoint
directories under ``<run_dir>/dedicated``: a cluster run directory is on a disk
every node shares (the plan's weight sync needs that too), so only paths cross
the connection. The role exits when it receives ``stop`` or when the trainer's
connection closes; a failure is sent back as ``("error", traceback)`` before
the role exits non-zero. One role serves one trainer connection.

With a multi-rank trainer only rank 0's instance (``ctx.is_driver``) starts or
connects to the scoring process: every rank takes part in ``save_hf_checkpoint``
(a collective, written by rank 0), and the followers train with the anchor rank 0
computes and shares (megarl/loop/spmd.py). One scoring process serves one run.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from megarl.errors import ScorerError
from megarl.launch.roles import current_role
from megarl.rollout.client import free_port
from megarl.stop_protocol import stop_budget
from megarl.types import AnchorResult, TrainBatch, Trajectory
from recovery._dedicated_link import QueueLink, TcpLink, authkey_from_env
from recovery._dedicated_scorer import (
    DedicatedConfig,
    _child_main,
    serve_role,  # noqa: F401  (the scorer role's entry, beside its strategy)
)
from recovery._scoring import check_rows, ensure_logp_old, logp_old_from_trajs, scoring_segments
from recovery.base import RecoveryStrategy
from recovery.registry import register

log = logging.getLogger("megarl.dedicated")

#: a segment's identity: (traj_id, start, end) in response-token indices
SegKey = tuple[str, int, int]


# -- the strategy -----------------------------------------------------------------------
@register
class Dedicated(RecoveryStrategy):
    name = "dedicated"
    Config = DedicatedConfig
    exact = True
    uses_live_trajectories = False  # only rank 0, which scores, reads them

    def __init__(self, cfg: DedicatedConfig, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        #: QueueLink (spawned child) or TcpLink (scorer role); None until the first publish
        self._link = None
        # hooks run on the event-loop thread, anchor on the train worker thread
        self._lock = threading.RLock()
        self._sent: set[SegKey] = set()
        #: segments sent to the scoring process and not scored yet -> when they were sent (perf_counter)
        self._pending: dict[SegKey, float] = {}
        self._results: dict[SegKey, list[float]] = {}
        #: the routes the scorer replayed at each segment's positions; of the last batch anchored, by
        #: (traj_id, input position) once joined (``replayed_routes``)
        self._replayed: dict[SegKey, Any] = {}
        self._replayed_at: dict[tuple[str, int], Any] = {}
        self._lost: dict[SegKey, str] = {}
        #: the last version sent to the scoring process (the one it scores new segments with)
        self.version: int | None = None
        self.loaded_version: int | None = None
        self._ready = False
        self._state_reply: Any = None

    # -- process ---------------------------------------------------------------------
    def _start(self) -> None:
        addr = current_role().dedicated_addr
        if addr:  # a scorer role on its own node: connect (in the background) instead of spawning
            self._link = TcpLink(addr, authkey_from_env(), self.cfg.start_timeout_s)
            return
        mpctx = mp.get_context("spawn")
        in_q, out_q = mpctx.Queue(), mpctx.Queue()
        port = self.cfg.master_port or free_port()
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if self.cfg.cuda_visible_devices:
            env["CUDA_VISIBLE_DEVICES"] = self.cfg.cuda_visible_devices
        proc = mpctx.Process(target=_child_main, name="megarl-dedicated-scorer", daemon=True,
                             args=(self.cfg.scorer_factory, self.ctx.checkpoint_dir, env,
                                   self.cfg.num_threads, in_q, out_q,
                                   self.ctx.trainer.dtype, self.ctx.trainer.temperature,
                                   getattr(self.ctx.trainer, "allow_local_spec", False),
                                   getattr(self.ctx.trainer, "batch_invariant", False), self.cfg.micro_batch_tokens))
        proc.start()  # builds its model while the loop goes on; messages queue up meanwhile
        self._link = QueueLink(proc, in_q, out_q)

    def _ensure_ready(self) -> None:
        self._wait_for(lambda: self._ready, self.cfg.start_timeout_s, "start")

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "ready":
            self._ready = True
        elif kind == "loaded":
            self.loaded_version = payload
        elif kind == "scored":
            for traj_id, start, end, logps, replayed in payload:
                key = (traj_id, start, end)
                self._pending.pop(key, None)
                self._results[key] = logps
                self._replayed[key] = replayed
        elif kind == "lost":
            for key, seg_version, scorer_version in payload:
                self._pending.pop(tuple(key), None)
                self._lost[tuple(key)] = (f"segment {key} of version {seg_version} reached the scoring process "
                                          f"at version {scorer_version}")
        elif kind == "state":
            self._state_reply = payload
        elif kind == "error":
            raise RuntimeError(f"dedicated scoring process failed:\n{payload}")

    def _drain(self, timeout: float | None) -> bool:
        """Handle one message (waiting up to ``timeout``; None = don't wait); False when none came."""
        msg = self._link.get(timeout)
        if msg is None:
            return False
        kind, payload = msg
        with self._lock:
            self._handle(kind, payload)
        return True

    def _wait_for(self, done, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self._drain(0.5):
                continue
            if not self._link.alive():
                while self._drain(None):  # an error message may still be in the pipe
                    pass
                raise ScorerError(f"{self._link.failure()} (during {what})")
            if time.monotonic() > deadline:
                raise ScorerError(f"dedicated scoring process: {what} did not finish within {timeout_s} s "
                                  f"(recovery.dedicated.wait_timeout_s)")

    # -- enqueueing --------------------------------------------------------------------
    def _enqueue(self, trajs: list[Trajectory]) -> None:
        jobs = []
        with self._lock:
            for t in trajs:
                for seg, owner in scoring_segments(t):
                    key = (t.traj_id, seg.start, seg.end)
                    if key in self._sent:
                        continue
                    self._sent.add(key)
                    if seg.version != self.version:
                        self._lost[key] = (f"segment {key} of version {seg.version} was reported after version "
                                           f"{self.version} was sent to the scoring process")
                        continue
                    self._pending[key] = time.perf_counter()
                    jobs.append({"traj_id": t.traj_id, "start": seg.start, "end": seg.end, "version": seg.version,
                                 "prompt_ids": list(t.prompt_ids), "response_ids": list(t.response_ids[:seg.end]),
                                 # MoE routes to replay (rollout.routing_replay): the request's that generated
                                 # the piece, as far as it reaches (megarl/routes.py)
                                 "routes": None if owner is None else owner.routes[:len(t.prompt_ids) + seg.end - 1]})
            if jobs:  # under the lock: no version message can slip in between the check and the put
                self._link.put(("score", jobs))
        while self._drain(None):
            pass

    # -- hooks -------------------------------------------------------------------------
    def on_weights_published(self, version: int) -> None:
        trainer = self.ctx.trainer
        if trainer.version != version:
            raise RuntimeError(f"dedicated: weights of version {version} published while the trainer is at "
                               f"version {trainer.version}")
        path = Path(self.ctx.run_dir) / "dedicated" / f"v{version}"
        if not self.ctx.is_driver:  # the export is a collective; the scoring process lives on rank 0 only
            trainer.save_hf_checkpoint(str(path))
            return
        if self._link is None:
            self._start()
        with self.meter.time("dedicated_save_s"):
            trainer.save_hf_checkpoint(str(path))
        self.meter.set("extra_param_copies", 1.0)  # the scoring process holds one full copy
        self.meter.add("bytes_moved", float(sum(f.stat().st_size for f in path.glob("*.safetensors"))))
        with self._lock:
            self._link.put(("version", (version, str(path))))
            self.version = version

    def on_rollout_interrupted(self, partials: list[Trajectory]) -> None:
        if self.ctx.is_driver:
            self._enqueue(partials)

    def on_segment_finished(self, traj: Trajectory) -> None:
        if self.ctx.is_driver:
            self._enqueue([traj])

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        check_rows(batch, trajs)
        if not self.ctx.is_driver:  # rank 0 scores; followers train with the anchor it broadcasts
            return AnchorResult(logp_anchor=batch.logp_behav.clone(), exact=True)
        with self.meter.time("recovery_s"):
            self._enqueue(trajs)  # segments the loop never reported (only possible for the current version)
            needed = {(t.traj_id, s.start, s.end) for t in trajs for s, _ in scoring_segments(t)}
            lost = [self._lost[k] for k in needed if k in self._lost]
            if lost:
                raise RuntimeError("dedicated: cannot score " + "; ".join(lost[:3]) + " (the loop must report "
                                   "segments before publishing the next version)")
            self._ensure_ready()
            if not needed.issubset(self._results):
                t0 = time.perf_counter()
                self._wait_for(lambda: needed.issubset(self._results) or any(k in self._lost for k in needed),
                               self.cfg.wait_timeout_s, "scoring the batch's segments")
                self.meter.add("dedicated_wait_s", time.perf_counter() - t0)
                self.meter.add("n_waits", 1.0)
                lost = [self._lost[k] for k in needed if k in self._lost]
                if lost:
                    raise RuntimeError("dedicated: cannot score " + "; ".join(lost[:3]))
            with self._lock:
                self._replayed_at = {}
                for t in trajs:
                    old = ensure_logp_old(t)
                    for s, _ in scoring_segments(t):
                        key = (t.traj_id, s.start, s.end)
                        old[s.start:s.end] = self._results.pop(key)
                        replayed = self._replayed.pop(key, None)
                        base = len(t.prompt_ids) - 1 + s.start
                        for j in range(0 if replayed is None else len(replayed)):
                            self._replayed_at[(t.traj_id, base + j)] = replayed[j]
            logp_old = logp_old_from_trajs(batch, trajs)
        return AnchorResult(logp_anchor=logp_old, exact=True)

    def replayed_routes(self, traj_id: str, index: int) -> Any | None:
        return self._replayed_at.get((traj_id, index))

    def after_optimizer_step(self, version: int, metrics: dict[str, float]) -> None:
        """Forget segments of trajectories that are gone (trained on or dropped)."""
        live = {t.traj_id for t in self.ctx.live_trajectories()}
        with self._lock:
            gone = {k for k in self._sent if k[0] not in live and k not in self._pending}
            self._sent -= gone
            for store in (self._lost, self._results, self._replayed):
                for key in gone & store.keys():
                    del store[key]

    def overhead(self) -> dict[str, float]:
        with self._lock:
            waiting = list(self._pending.values())
        self.meter.set("pending_segments", float(len(waiting)))
        # how far the scorer is behind: the age of the oldest segment it has not scored yet
        self.meter.set("lag_s", time.perf_counter() - min(waiting) if waiting else 0.0)
        return super().overhead()

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The scoring process's version and its weights, plus scores not yet joined (waits for pending ones)."""
        if self._link is None:
            return {"version": None}
        self._ensure_ready()
        self._state_reply = None
        self._link.put(("state", None))
        # a stopping run waits only for what is left of logging.stop_grace_s (megarl/stop_protocol.py)
        self._wait_for(lambda: self._state_reply is not None, stop_budget.bound(self.cfg.wait_timeout_s),
                       "state_dict")
        path = Path(self.ctx.run_dir) / "dedicated" / f"v{self._state_reply}"
        weights = {f.name: load_file(str(f)) for f in sorted(path.glob("*.safetensors"))}
        extra = {f.name: f.read_text() for f in sorted(path.glob("*.json"))}
        with self._lock:
            return {"version": self._state_reply, "weights": weights, "files": extra,
                    "results": dict(self._results), "sent": sorted(self._sent), "lost": dict(self._lost)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a follower has no scoring process; a resume with more trainer ranks hands it rank 0's state
        # (megarl/trainer/param_state.py), which only rank 0 may act on
        if state["version"] is None or not self.ctx.is_driver:
            return
        path = Path(self.ctx.run_dir) / "dedicated" / f"v{state['version']}"
        path.mkdir(parents=True, exist_ok=True)
        for name, tensors in state["weights"].items():
            save_file(tensors, str(path / name), metadata={"format": "pt"})
        for name, text in state["files"].items():
            (path / name).write_text(text)
        if self._link is None:
            self._start()
        with self._lock:
            self._results = dict(state["results"])
            self._sent = {tuple(k) for k in state["sent"]}
            self._lost = dict(state["lost"])
            self._link.put(("version", (state["version"], str(path))))
            self.version = state["version"]

    def close(self) -> None:
        if self._link is not None:
            self._link.close(stop=self._ready)  # not ready: still building its model, nothing to finish
            self._link = None
        shutil.rmtree(Path(self.ctx.run_dir) / "dedicated", ignore_errors=True)
