"""Moving trainer weights to rollout engines: a bucketed broadcast, or safetensors on disk.

Broadcast: the trainer is rank 0 of a process group of its own (gloo on CPU,
NCCL on GPU) that it creates with :class:`WeightBroadcaster`; engine ``i``
joins as rank ``i + 1`` (the HF engine and vLLM's workers, through
:func:`join_weight_group`). The ranks rendezvous on megarl's own store
(megarl/rollout/rendezvous.py: it listens on the one address the engines
reach, and answers only clients holding the group's secret), not on a
``TCPStore`` anyone could write. Tensors travel in buckets of at most
``bucket_bytes`` (one tensor larger than that gets a bucket of its own; packed by
megarl/rollout/bucket_format.py), each bucket as three broadcasts::

    header  int64[2]  = [payload_bytes, meta_bytes]    ([0, 0] ends the stream)
    meta    uint8[..] = JSON [[name, shape, dtype, offset], ...]  (+ [full shape, dim, start]: a slice)
    payload uint8[..] = the tensors' bytes, each at a 16-byte aligned offset

The stream describes itself, so a receiver needs no plan computed in
advance, and a receiver that refuses an update can still drain it (the
trainer never hangs on an engine that said no). A receiver never waits on a
collective without bound: it leaves a publish the trainer called off, or one
that stalled for the group's step deadline (megarl/rollout/receiver_group.py).
Nothing here imports vLLM.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch._C._distributed_c10d import ProcessGroup
from torch.distributed.distributed_c10d import ProcessGroupGloo

from megarl.errors import EngineError
from megarl.rollout.bucket_format import group_tensors, pack, rows_bytes, unpack
from megarl.rollout.engine_shards import shard_rows
from megarl.rollout.receiver_group import ReceiverGroup, communicator_timeout
from megarl.rollout.rendezvous import RendezvousServer, RendezvousStore, new_secret

DEFAULT_BUCKET_BYTES = 256 << 20


def _make_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float, secret: str,
                prefix: str = ""):
    """A process group outside torch.distributed's global state (the trainer has its own), rendezvousing on
    the group's authenticated store; its communicator outlives a receiver's bound (receiver_group.py).
    ``prefix``: the group's keys in the store (several groups share one rendezvous: one per worker shard)."""
    timeout = communicator_timeout(timeout_s)
    store = RendezvousStore(host, port, secret, timeout_s=timeout_s)
    keys = dist.PrefixStore(prefix, store) if prefix else store
    pg = ProcessGroup(keys, rank, world_size)
    if backend == "gloo":
        impl = ProcessGroupGloo(keys, rank, world_size, timeout=timeout)
        backend_type, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    elif backend == "nccl":  # GPU machines: same seam, device tensors
        from torch.distributed.distributed_c10d import ProcessGroupNCCL  # absent from CPU-only torch builds

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        impl = ProcessGroupNCCL(keys, rank, world_size, opts)
        backend_type, device = ProcessGroup.BackendType.NCCL, torch.device("cuda", torch.cuda.current_device())
    else:
        raise EngineError(f"weight broadcast backend {backend!r} unknown; use 'gloo' (CPU) or 'nccl' (GPU)")
    pg._set_default_backend(backend_type)
    impl._set_sequence_number_for_group()
    pg._register_backend(device, backend_type, impl)
    # keep the store alive as long as the group: the group's rendezvous keys live in it
    return pg, store, device


def _bcast(pg, t: torch.Tensor) -> torch.Tensor:
    pg.broadcast(t, 0).wait()
    return t


def shard_of(rank: int, world_size: int, shards: int) -> tuple[int, int, int]:
    """``(shard, rank in it, its world size)`` of a worker's ``rank`` in a group of ``world_size`` ranks cut
    into ``shards`` sub-groups: every engine has ``shards`` workers, worker t of each engine joins sub-group
    t beside the trainer (rank 0 of each); ``shards`` 1: the group itself."""
    if shards <= 1:
        return 0, rank, world_size
    if (world_size - 1) % shards:
        raise EngineError(f"a broadcast of {world_size - 1} engine worker(s) cannot be cut into {shards} shards: "
                          f"every engine needs {shards} workers")
    return (rank - 1) % shards, (rank - 1) // shards + 1, (world_size - 1) // shards + 1


class WeightBroadcaster:
    """Trainer side (rank 0) of the weight broadcast group; engines join as ranks 1..world_size-1.

    Construction only picks the group's identity (and its fresh ``secret``); the first
    :meth:`broadcast` starts the group's rendezvous, creates the group and blocks until every
    engine has joined. So: make the broadcaster, hand :meth:`group_info` to the engines'
    ``update_weights_from_broadcast`` calls (they join on their first update and keep the group
    for later ones), and broadcast concurrently. ``serve_rendezvous=False``: the rendezvous runs
    elsewhere (the publisher's process serves it; the sender process only joins, rank 0).
    ``bind_host``: the address the rendezvous listens on (default ``host``; "0.0.0.0" for all).
    ``shards`` k > 1: each engine has k workers and worker t receives only its slices
    (megarl/rollout/engine_shards.py): the group is k sub-groups on one rendezvous (:func:`shard_of`),
    sub-group t the trainer and worker t of every engine, and each bucket is sent in one of them.
    """

    def __init__(self, host: str, port: int, world_size: int, backend: str | None = None,
                 timeout_s: float = 300.0, group_id: str | None = None, secret: str | None = None,
                 serve_rendezvous: bool = True, bind_host: str | None = None, shards: int = 1) -> None:
        if world_size < 2:
            raise EngineError(f"weight broadcast needs world_size >= 2 (trainer + engines), got {world_size}")
        self.host, self.port, self.world_size = host, port, world_size
        self.shards = max(int(shards), 1)
        shard_of(1, world_size, self.shards)  # every engine has that many workers
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        # lets engines tell a new group on a reused port from the one they joined before
        self.group_id = group_id or uuid.uuid4().hex
        self.secret = secret or new_secret()
        self.serve_rendezvous, self.bind_host = serve_rendezvous, bind_host
        self.rendezvous: RendezvousServer | None = None
        self._pgs: list = []  # one group per shard
        self._stores: list = []
        self.device = None

    def start_rendezvous(self) -> RendezvousServer:
        """Serve the group's store from this process (idempotent); a port of 0 becomes a free one."""
        if self.rendezvous is None:
            self.rendezvous = RendezvousServer(self.host, self.port, self.secret, bind_host=self.bind_host,
                                               timeout_s=self.timeout_s)
            self.port = self.rendezvous.port
        return self.rendezvous

    def abort(self, reason: str) -> None:
        """Tell the engines still receiving that this publish is over (they leave, receiver_group.py)."""
        if self.rendezvous is not None:
            self.rendezvous.abort(reason)

    def connect(self) -> None:
        """Create the group (blocks until all engines joined); :meth:`broadcast` calls it when needed."""
        if not self._pgs:
            if self.serve_rendezvous:
                self.start_rendezvous()
            world = shard_of(1, self.world_size, self.shards)[2]
            for t in range(self.shards):
                pg, store, self.device = _make_group(self.host, self.port, 0, world, self.backend, self.timeout_s,
                                                     self.secret, prefix=_prefix(t, self.shards))
                self._pgs.append(pg)
                self._stores.append(store)

    def group_info(self, rank: int | None = None) -> dict:
        """What an engine needs to join (``rank`` is filled per engine by :class:`EngineRouter`); it holds the
        group's secret: hand it over the engines' authenticated API only, never log it."""
        info = {"host": self.host, "port": self.port, "world_size": self.world_size,
                "backend": self.backend, "timeout_s": self.timeout_s, "group_id": self.group_id,
                "secret": self.secret, "shards": self.shards}
        if rank is not None:
            info["rank"] = rank
        return info

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, rule=None) -> dict:
        """Send every tensor, in order, then the end marker; returns {tensors, bytes, seconds} (bytes: what
        left this rank). With shards, ``rule`` says each worker's slices (megarl/rollout/engine_shards.py)."""
        if self.shards > 1 and rule is None:
            raise EngineError(f"a broadcast to {self.shards} worker shards needs the rule that cuts the tensors")
        t0, n_tensors, n_bytes = time.perf_counter(), 0, 0
        self.connect()
        for bucket in group_tensors(named_tensors, bucket_bytes):
            for t in range(self.shards):
                rows, meta, payload = pack(shard_rows(bucket, rule, t) if self.shards > 1 else bucket, self.device)
                self.send_bucket(meta, payload, t)
                n_bytes += rows_bytes(rows)
            n_tensors += len(bucket)
        self.end_stream()
        return {"tensors": n_tensors, "bytes": n_bytes, "seconds": time.perf_counter() - t0}

    def send_bucket(self, meta: torch.Tensor, payload: torch.Tensor, shard: int = 0) -> None:
        """One packed bucket (see :func:`~megarl.rollout.bucket_format.iter_buckets`) to the workers of
        ``shard``; on CUDA, returns once the bucket has left this GPU."""
        pg = self._pgs[shard]
        meta, payload = meta.to(self.device), payload.to(self.device)
        _bcast(pg, torch.tensor([payload.numel(), meta.numel()], dtype=torch.int64, device=self.device))
        _bcast(pg, meta)
        _bcast(pg, payload)
        if self.device.type == "cuda":
            # NCCL's wait() only orders the stream: without this, timing and progress would mean nothing
            torch.cuda.synchronize(self.device)

    def end_stream(self) -> None:
        for pg in self._pgs:
            _bcast(pg, torch.zeros(2, dtype=torch.int64, device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        for pg, store in zip(self._pgs, self._stores):
            try:
                pg.shutdown()
            except Exception:  # already torn down by a failed peer; nothing left to release
                pass
            store.close()
        if self.rendezvous is not None:
            self.rendezvous.close()
        self._pgs, self._stores, self.rendezvous = [], [], None


def receive_named_tensors(pg, device) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: yield ``(name, tensor)`` from the stream until the end marker.

    Each bucket gets a fresh buffer because loaders may hold on to tensors
    until a whole layer has arrived (vLLM's layerwise reload does).
    """
    while True:
        header = _bcast(pg, torch.empty(2, dtype=torch.int64, device=device)).tolist()
        payload_bytes, meta_bytes = int(header[0]), int(header[1])
        if payload_bytes == 0 and meta_bytes == 0:
            return
        meta = json.loads(bytes(_bcast(pg, torch.empty(meta_bytes, dtype=torch.uint8, device=device)).cpu().tolist()))
        yield from unpack(meta, _bcast(pg, torch.empty(payload_bytes, dtype=torch.uint8, device=device)))


def _prefix(shard: int, shards: int) -> str:
    return f"shard{shard}/" if shards > 1 else ""


def join_weight_group(group_info: dict):
    """Join a :class:`WeightBroadcaster` group as ``group_info["rank"]`` (with shards: the sub-group of this
    worker, :func:`shard_of`); returns (group, store, device), the group a
    :class:`~megarl.rollout.receiver_group.ReceiverGroup` whose every receive is bounded."""
    backend, timeout_s = group_info.get("backend", "gloo"), float(group_info.get("timeout_s", 300.0))
    if not group_info.get("secret"):
        raise EngineError("weight broadcast group_info has no 'secret': the trainer's megarl is older than this "
                          "engine's; run the same megarl version on both sides")
    shards = int(group_info.get("shards", 1))
    shard, rank, world = shard_of(int(group_info["rank"]), int(group_info["world_size"]), shards)
    pg, store, device = _make_group(group_info["host"], int(group_info["port"]), rank, world, backend, timeout_s,
                                    group_info["secret"], prefix=_prefix(shard, shards))
    return ReceiverGroup(pg, store, backend, timeout_s), store, device


def save_for_engines(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path,
                     shard_bytes: int = 4 << 30) -> Path:
    """Write tensors as safetensors shards in ``out_dir`` for ``update_weights_from_disk``.

    Shards are written under temporary names and renamed at the end, so an
    engine never reads a half-written update.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        # safetensors refuses tensors sharing storage (tied weights): give each its own copy
        shards[-1][name] = t.detach().to("cpu").contiguous().clone()
        size += nbytes
    n = len(shards)
    tmp_paths = []
    for i, shard in enumerate(shards):
        final = out / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
        tmp = out / f".{final.name}.tmp{os.getpid()}"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        tmp_paths.append((tmp, final))
    for tmp, final in tmp_paths:
        os.replace(tmp, final)
    # shards of an earlier save into the same directory would be loaded too
    keep = {final for _, final in tmp_paths}
    for stale in out.glob("*.safetensors"):
        if stale not in keep:
            stale.unlink()
    return out
