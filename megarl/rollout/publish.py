"""Publishers: how the training loop moves the trainer's weights to the rollout engines.

The controller calls ``await publisher.prepare(v)`` while the engines still
generate, then stops generation and calls ``await publisher.apply(v)``; only
``apply`` stalls generation (``publish_stall_s`` in the step record,
``weight_export_s`` is ``prepare``). ``apply`` returns the step record's
weight-sync numbers, and the engines' own stall phases (``engine_abort_s``,
``engine_pause_s``, ``engine_reload_s``, ``engine_cache_reset_s``,
``engine_resume_s``: the slowest engine's seconds in each).

* :class:`DiskPublisher` (``rollout.weight_sync=disk``): ``prepare`` writes an
  HF checkpoint to ``weights/v{v}``, ``apply`` has every engine load it.
* :class:`BroadcastPublisher` (``rollout.weight_sync=broadcast``): ``prepare``
  exports the HF tensors into memory, ``apply`` streams them to the engines
  over a gloo/NCCL group (megarl/rollout/weight_sync.py), from a sender process
  the trainer can kill (megarl/rollout/broadcast_sender.py), in
  ``rollout.bucket_mb`` buckets.

Both leave ``weights/v{v}`` on disk for the published version: the
checkpointer stores it as the engines' weights, and a restarted engine loads
it (megarl/rollout/supervisor.py). For the broadcast publisher that disk copy
is written at every publish, in a background thread from the buckets it
broadcasts (megarl/rollout/disk_copy.py): neither the export nor the stall
waits for the disk, nor does the next publish (an older copy still being
written when a newer version is applied is stopped at its next 64 MB piece:
only the newest is needed), and whoever reads the copy waits for its writer
(:meth:`BroadcastPublisher.wait_written`; the checkpoint does). Writing it
less often would leave a restarted engine, or a checkpoint, without the
version the other engines serve.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import socket
import time
from pathlib import Path

import torch

from megarl.errors import EngineError
from megarl.launch.roles import current_role
from megarl.rollout.broadcast_sender import SenderProcess
from megarl.rollout.bucket_format import rows_bytes
from megarl.rollout.bucket_pool import DISK, SENDER, SharedBucketPool
from megarl.rollout.disk_copy import DiskCopy
from megarl.rollout.disk_publisher import DiskPublisher, remove_other_versions
from megarl.rollout.engine_shards import vllm_tp_rule
from megarl.rollout.export_buckets import (
    consume_export,
    device_budget,
    engine_weights,
    pack_export,
    pack_shared,
    shard_buckets,
    stream_engine_weights,
)
from megarl.rollout.weight_sync import WeightBroadcaster

log = logging.getLogger("megarl.rollout.publish")


class BroadcastPublisher:
    """Weights to engines through a trainer -> engines process group (rank 0 = this trainer rank).

    ``prepare`` exports ``trainer.export_hf_weights()`` (a collective with
    several trainer ranks; they replay it, megarl/loop/spmd.py) into a list
    on this rank, packs it into the send buckets and starts writing the disk
    copy from them in the background (megarl/rollout/disk_copy.py). Holding the
    export costs one full copy of the model in host memory during a publish,
    which is what ``save_hf_checkpoint`` holds anyway while it writes
    (DiskPublisher), and it keeps the export off the generation stall.
    ``apply`` then only sends.

    The group is made for the engines live at a publish (ranks in supervisor
    order, one per engine worker) and reused while the same engine processes
    are live.
    An engine that failed and was restarted cannot join a group of fixed size:
    the next publish builds a new group (new port, new id) for the live
    engines. The restarted engine itself starts from the disk copy.
    If the broadcast fails for an engine that is still alive, the live
    engines load the disk copy instead, so the version still lands everywhere.
    ``timeout_s`` bounds each step of the group (joining, one bucket): an
    engine lost before it joined holds that publish up to this long. When the
    sender fails or misses a step's deadline, the publisher sets the abort mark
    of the group's rendezvous at once (megarl/rollout/rendezvous.py, served from
    this process): the engines still receiving leave the broadcast within a
    poll, under NCCL too, where they would not notice the sender's end, and
    their lock is free for the disk copy (megarl/rollout/receiver_group.py).

    The sending itself runs in a process of its own (megarl/rollout/broadcast_sender.py),
    which holds the group's communicator: under NCCL a lost engine aborts that process, not
    this one, and a step past its deadline gets it killed. ``prepare`` packs the export into
    shared-memory buckets the sender reads without a copy (the buckets of a former publish once its sender
    and disk copy are done with them: megarl/rollout/bucket_pool.py), and starts the sender off the stall.
    Under NCCL on CUDA the export stays on the trainer's GPU and is packed into device buckets
    there (as far as :func:`~megarl.rollout.export_buckets.device_budget` allows), which the
    sender broadcasts from that device; the disk copy is written from pinned host copies of them
    (megarl/rollout/export_buckets.py).

    ``shard_workers`` (``rollout.shard_weight_sync``): when every live engine has k > 1 workers (vLLM
    tensor parallelism: ``n_workers`` of their /health, asked in ``prepare``), each bucket is cut into
    one bucket per worker (megarl/rollout/engine_shards.py) and worker t receives only its slices,
    through sub-group t of the group: a publish moves the model about once per engine instead of k
    times. Engines whose worker count changed by ``apply`` get the disk copy (one warning).
    """

    def __init__(self, trainer, router, weights_dir: Path, *, bucket_mb: int = 256, host: str = "127.0.0.1",
                 port: int = 0, backend: str | None = None, timeout_s: float = 60.0,
                 engine_dtype: str | None = None, bind_host: str | None = None, shard_workers: bool = True) -> None:
        self.trainer = trainer
        self.shard_workers = shard_workers
        self._cut = 1  # the worker count the prepared export was cut for (1: not cut)
        self.engine_dtype = engine_dtype
        self.router = router
        self.weights_dir = weights_dir
        self.bucket_bytes = max(int(bucket_mb), 1) << 20
        self.host, self.port = host, port
        #: where the group's rendezvous listens (None: ``host``, the one address the engines reach it at)
        self.bind_host = bind_host
        self.backend = backend
        self.timeout_s = timeout_s
        self.n_groups = 0
        self.n_fallbacks = 0
        self._buckets: list | None = None  # (shard, meta rows, meta bytes, payload) of the prepared version
        self._specs: list = []  # its (name, full shape, dtype)
        self._group = None  # WeightBroadcaster naming the group; the sender process holds its communicator
        self._members: tuple | None = None  # the live engines the group was made for
        self._broadcaster_cls = WeightBroadcaster  # what the sender makes its group with
        self._proc: SenderProcess | None = None
        self._sending: concurrent.futures.Future | None = None
        self._copy = DiskCopy()  # the disk copy's writer
        #: shared-memory buckets reused from publish to publish (megarl/rollout/bucket_pool.py); the leases of the
        #: prepared version: its export (released by the sender in apply and by the disk copy when its write
        #: ends) and its buckets cut per worker (the sender's alone)
        self._pool = SharedBucketPool()
        self._leases: tuple = ()
        #: bytes of device buckets where the device is not CUDA (a CPU test of the device flow)
        self.device_budget = 0

    async def prepare(self, version: int) -> None:
        self._buckets = None  # the previous version's export is not needed here any more (its disk copy may still
        # read it: a publish does not wait for the disk, megarl/rollout/disk_copy.py)
        for lease in self._leases:  # prepared and never applied: the sender will not read them
            lease.release(SENDER)
        lease, cut = self._pool.lease(), self._pool.lease((SENDER,))
        self._leases = (lease, cut)
        device = self._sender_device()
        if device is None:
            tensors, hf = await asyncio.to_thread(engine_weights, self.trainer, self.engine_dtype)
            self._buckets = host = await asyncio.to_thread(pack_shared, tensors, self.bucket_bytes, lease.alloc)
            del tensors  # emptied by the packing: the buckets hold the only copy from here on
        else:  # CUDA + NCCL: packed on the trainer's GPU as the export streams (megarl/rollout/export_buckets.py)
            self._buckets, host, hf = await asyncio.to_thread(self._pack_on_device, device, lease.alloc)
        self._specs = [(row[0], row[1], row[2]) for rows, _, _ in host for row in rows]
        self._cut = await self._engine_workers()
        if self._cut > 1:  # the device buckets go as they are cut; the host ones are the disk copy's
            self._buckets = await asyncio.to_thread(shard_buckets, self._buckets, vllm_tp_rule(hf, self._cut),
                                                    self._cut, consume=device is not None, alloc=cut.alloc)
        else:
            self._buckets = [(0, *b) for b in self._buckets]
        self._copy.start(self.weights_dir / f"v{version}", host, hf, version,
                         on_end=functools.partial(lease.release, DISK))
        self._ensure_sender()

    async def _engine_workers(self) -> int:
        """k when cutting is on and every live engine answers /health with k > 1 workers; 1 otherwise."""
        if not self.shard_workers or self.router is None:
            return 1
        try:
            engines = (await asyncio.wait_for(self.router.health(), self.timeout_s))["engines"]
        except Exception as e:  # noqa: BLE001 - not cut this time; apply finds the live engines itself
            log.warning("no engine health before cutting the export per worker (%s: %s); sending it whole",
                        type(e).__name__, e)
            return 1
        counts = {int(h.get("n_workers", 1)) for h in engines if h.get("ok", True)}
        return counts.pop() if len(counts) == 1 and min(counts) > 1 else 1

    def _pack_on_device(self, device: torch.device, alloc) -> tuple[list, list, dict]:
        tensors, hf = stream_engine_weights(self.trainer, self.engine_dtype, to_host=False)
        budget = (device_budget(device, reserve=2 * self.bucket_bytes) if device.type == "cuda"
                  else self.device_budget)
        return *consume_export(tensors, lambda stream: pack_export(stream, self.bucket_bytes, device, budget,
                                                                   alloc)), hf

    def _sender_device(self) -> torch.device | None:
        """The device the sender broadcasts from: the trainer's GPU under NCCL, None (host) under gloo."""
        if torch.cuda.is_available() and (self.backend or "nccl") == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return None

    async def wait_written(self) -> None:
        """The published version's disk copy is complete (raises the writer's failure)."""
        await self._copy.wait()

    async def _written_for_engines(self, version: int | None = None) -> None:
        """:meth:`wait_written` (of ``version``) for an engine about to load the copy: a failed write is the
        engine's failure."""
        try:
            await self._copy.wait(version)
        except RuntimeError as e:
            raise EngineError(str(e)) from e

    async def apply(self, version: int) -> dict:
        """Send ``version``; returns the step record's ``weight_sync_bytes`` (0: no engine took the stream),
        ``weight_sync_groups`` (groups made so far), ``weight_sync_fallbacks`` (publishes that went by disk)
        and the engines' stall phases."""
        buckets, self._buckets = self._buckets, None
        leases, self._leases = self._leases, ()
        if buckets is None:
            raise RuntimeError(f"BroadcastPublisher.apply({version}) without prepare({version})")
        current = self.weights_dir / f"v{version}"
        # from here a restarted engine loads this version: an older copy still being written is not needed
        # (megarl/rollout/disk_copy.py); this one's starts at once
        self._copy.supersede(version)
        t0 = time.perf_counter()
        self._sending = None
        specs = self._specs
        try:
            # an engine restarted from here on loads the disk copy once its writer is done
            phases = await self.router.update_weights_from_broadcast(lambda members: self._open(members, buckets),
                                                                     specs, version, weights=(str(current), version),
                                                                     weights_ready=functools.partial(
                                                                         self._written_for_engines, version))
            stats = await self._sent(sum(rows_bytes(rows) for _, rows, _, _ in buckets))
        except EngineError as e:
            log.warning("version %d: broadcast failed (%s); the live engines load %s instead", version, e, current)
            self._abandon(f"version {version}: broadcast failed, load the disk copy")
            self.n_fallbacks += 1
            await self._written_for_engines(version)
            phases = await self.router.update_weights_from_disk(str(current), version)
            stats = None
        if stats:
            log.info("version %d: broadcast %d tensors, %.2f MB to %d engine(s) in %.3f s", version,
                     stats["tensors"], stats["bytes"] / 1e6, len(self._members or ()), time.perf_counter() - t0)
        await self._copy.settled_before(version)  # stopped within one piece, so nothing renames it back below
        remove_other_versions(self.weights_dir, current)
        buckets = None  # the device buckets go before the next train step (the sender has let go of them too)
        release_ipc_blocks()
        # the sender sent them or was killed (_abandon): it reads them no more; the disk copy releases its own hold
        for lease in leases:
            lease.release(SENDER)
        return {"weight_sync_bytes": stats["bytes"] if stats else 0, "weight_sync_groups": self.n_groups,
                "weight_sync_fallbacks": self.n_fallbacks, **(phases or {})}

    def _open(self, members: list, buckets: list) -> dict | None:
        """Called by the router under its publish lock with the live engines; starts sending.

        ``members``: ``(index, incarnation, n_workers)`` of each engine; a group is
        reused while they are the same engine processes.
        """
        if not members:
            return None
        if self._cut > 1 and any(n != self._cut for _, _, n in members):
            raise EngineError(f"the export was cut for engines of {self._cut} workers but the live engines have "
                              f"{[n for _, _, n in members]} now")
        self._ensure_sender()  # before the group: a sender that died took its group with it
        if self._group is None or tuple(members) != self._members or self._group.shards != self._cut:
            # the sender leaves the old group when it is handed a new group id
            self._close_group()
            port = self.port if self.port and not self.n_groups else 0  # 0: the rendezvous binds a free port
            world = 1 + sum(n_workers for _, _, n_workers in members)
            group = self._broadcaster_cls(self.host, port, world, backend=self.backend, timeout_s=self.timeout_s,
                                          bind_host=self.bind_host, shards=self._cut)
            group.start_rendezvous()  # served from this process; the sender and the engines join it
            self._group, port = group, group.port
            self._members = tuple(members)
            self.n_groups += 1
            log.info("weight broadcast group %d: %s:%d, %d engine(s), world %d, %s", self.n_groups, self.host, port,
                     len(members), world, self._group.backend)
        info = self._group.group_info()
        self._sending = self._proc.send(info, [(bytes(meta.numpy()), payload, shard)
                                               for shard, _, meta, payload in buckets], self.timeout_s)
        self._sending.add_done_callback(functools.partial(_abort_on_failure, self._group))
        return info

    def _ensure_sender(self) -> None:
        if self._proc is None or not self._proc.alive():
            if self._proc is not None:
                self._proc.kill()
                self._close_group()  # its group died with it
            device = self._sender_device()
            self._proc = SenderProcess(self._broadcaster_cls, device.index if device is not None else None)

    async def _sent(self, sent_bytes: int) -> dict | None:
        """The sender's stats once every engine that answered has the whole stream.

        An engine returns only after the end marker, so once the router call
        succeeded the sender is done or still waits on an engine lost during
        this publish (restarted from the disk copy); that group is dropped.
        Nothing here may hold the buckets: a failure's traceback, which the future keeps until the next
        publish, would keep them (a whole export of shared memory) alive with this frame.
        """
        if self._sending is None:  # no live engine: restarted ones load the disk copy
            return None
        try:
            seconds = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._sending)), 5.0)
        except Exception as e:  # noqa: BLE001 - timed out or failed on a lost engine; the others are updated
            log.warning("weight broadcast to a lost engine did not complete (%s: %s); new group next publish",
                        type(e).__name__, e)
            self._abandon("the broadcast to a lost engine did not complete")
            return None
        return {"tensors": len(self._specs), "bytes": sent_bytes, "seconds": seconds}

    def _abandon(self, reason: str) -> None:
        """Call the publish off: the engines still receiving leave the broadcast at once (the abort mark of
        the group's rendezvous, megarl/rollout/receiver_group.py), then the sender (and with it the group)
        is killed: a lost engine's group is never reused."""
        if self._group is not None:
            self._group.abort(reason)
        if self._proc is not None:
            self._proc.kill()
        self._proc = None
        self._members = None  # the next publish makes a new group; this one's rendezvous stays up till then

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = self._members = None

    def close(self) -> None:
        if self._proc is not None:
            self._proc.close()
        self._proc = None
        self._close_group()
        self._copy.join()  # a copy being written is finished, not left half-way
        self._pool.clear()


def release_ipc_blocks() -> None:
    """Free the trainer's CUDA blocks that were shared with the sender process and that it no longer
    references (torch keeps such a block until the producer collects it); nothing to do without CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


def _abort_on_failure(group, sending: concurrent.futures.Future) -> None:
    """The sender failed or missed a step deadline: the engines still receiving leave now, not at their own
    deadline (under NCCL they would not notice the sender's end), and the publish falls back to disk."""
    error = sending.exception()
    if error is not None:
        group.abort(f"the trainer's sender failed ({type(error).__name__}: {error})")


def make_publisher(cfg, trainer, router, weights_dir: Path):
    """The publisher ``rollout.weight_sync`` names."""
    if cfg.rollout.weight_sync == "disk":
        return DiskPublisher(trainer, router, weights_dir, engine_dtype=cfg.engine_dtype)
    role = current_role()
    host, port = "127.0.0.1", 0  # engines this process spawned: loopback, a free port
    if role.weight_sync_addr:  # a launched plan says where engines on other nodes reach this rank
        host, _, p = role.weight_sync_addr.rpartition(":")
        port = int(p)
    elif role.engine_addrs:
        host, port = socket.getfqdn(), cfg.placement.weight_sync_port or 29600
    return BroadcastPublisher(trainer, router, weights_dir, bucket_mb=cfg.rollout.bucket_mb, host=host, port=port,
                              backend=_backend(engines_elsewhere=bool(role.engine_addrs)),
                              engine_dtype=cfg.engine_dtype, bind_host=cfg.placement.weight_sync_bind or None,
                              shard_workers=cfg.rollout.shard_weight_sync)


def _backend(engines_elsewhere: bool) -> str:
    """NCCL when the trainer runs on CUDA and the engines run as their own commands, on GPUs of their own
    (they receive there); gloo otherwise. Engines this process spawns inherit its visible GPUs and share
    the trainer's device, where NCCL refuses a second rank; gloo passes the tensors through host memory and
    the engines copy them to their GPU."""
    return "nccl" if torch.cuda.is_available() and engines_elsewhere else "gloo"
