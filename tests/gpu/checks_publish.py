"""The GPU checks of a broadcast publish's memory (tests/gpu/gpu_check.py): the real publisher's three publishes
leave the trainer's GPU and shared memory at their baseline, and the CUDA-IPC buckets the broadcast sender
process receives arrive intact and are freed once it lets go of them."""
from __future__ import annotations

import asyncio
import gc
import hashlib
import math
import sys
from pathlib import Path

from check_helpers import (
    MIB,
    ROOT,
    TINY_DENSE,
    Skip,
    derived_yaml,
    make_trainer,
    model_checkpoint,
    require,
    require_cuda,
)

#: publish_memory's model: a one-layer Qwen3 of 84 MB in fp32, far above the tolerances below
PUBLISH_MODEL = {"vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 1,
                 "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}
#: how far above its baseline shared memory may stay after a publish (page-cache noise, as the unit test)
SHM_TOLERANCE = 16 * MIB
#: cuda_ipc's tensors (shape, dtype), packed into buckets of IPC_BUCKET_BYTES: [4 MiB], [1.26 MB + the two small
#: ones], [2.4 MB]: every bucket is over the 1 MiB tolerance
IPC_TENSORS = (((1024, 1024), "float32"), ((700, 900), "bfloat16"), ((5,), "float32"), ((3, 7), "int32"),
               ((300_000,), "int64"))
IPC_BUCKET_BYTES = 2 * MIB


# -- publish_memory --------------------------------------------------------------------------------------
def unit_stand_ins() -> tuple:
    """tests/unit's TwoWorkerEnginesStandIn (receiving threads standing in for engines) and shmem()."""
    unit = str(ROOT / "tests" / "unit")
    if unit not in sys.path:
        sys.path.append(unit)
    try:
        from test_engine_shards import TwoWorkerEnginesStandIn
        from test_publish_memory import shmem
    except ImportError as e:
        raise Skip(f"the stand-in engines of tests/unit do not import here ({type(e).__name__}: {e})") from None
    return TwoWorkerEnginesStandIn, shmem


def empty_pinned_cache() -> bool:
    """Give torch's cached pinned host blocks (the disk copy's mirrors of device buckets) back, where torch can."""
    import torch

    for owner, name in ((getattr(torch, "accelerator", None), "empty_host_cache"), (torch._C, "_host_emptyCache")):
        fn = getattr(owner, name, None)
        if callable(fn):
            fn()
            return True
    return False


def publish_three(publisher_cls, trainer, workdir: Path, tag: str, cuda: bool) -> dict:
    """Three publishes through ``publisher_cls`` (gloo) to one stand-in engine, then ``close``. Memory above the
    baseline is ``(CUDA bytes, shared memory bytes)``: per publish while prepared (``held``) and after it
    (``after``), with the bytes sent, the tensors received and the shared-bucket pool's ``(bytes allocated,
    bytes free)`` (megarl/rollout/bucket_pool.py: kept for the next publish); and after ``close`` (``closed``)."""
    import torch

    from megarl.rollout.publish import release_ipc_blocks

    stand_in, shmem = unit_stand_ins()
    router = stand_in(1, 1)
    pub = publisher_cls(trainer, router, workdir / f"publish_{tag}", backend="gloo", timeout_s=60)
    pub.bucket_bytes = 16 * MIB
    pool = getattr(pub, "_pool", None)

    def now() -> tuple[int, int]:
        gc.collect()
        release_ipc_blocks()
        if cuda:
            torch.cuda.synchronize()
            empty_pinned_cache()
        return (torch.cuda.memory_allocated() if cuda else 0), shmem()

    base, rows = now(), []

    def level() -> tuple[int, int]:
        cuda_bytes, shm_bytes = now()
        return cuda_bytes - base[0], shm_bytes - base[1]

    async def go():
        for version in (1, 2, 3):
            await pub.prepare(version)
            held = level()
            out = await pub.apply(version)
            await pub.wait_written()
            got = len(router.got.get(1, {}))
            router.got.clear()
            await asyncio.sleep(0.2)  # the sender's acknowledgement reaches it after it let go of the buckets
            rows.append({"held": held, "after": level(), "sent": out["weight_sync_bytes"], "tensors": got,
                         "pool": (pool.bytes_allocated, pool.free_bytes()) if pool is not None else (0, 0)})
    try:
        asyncio.run(go())
    finally:
        pub.close()
    return {"rows": rows, "closed": level()}


def check_publish_memory(workdir: Path) -> str:
    require_cuda()
    import torch

    from megarl.rollout.publish import BroadcastPublisher

    cuda = torch.cuda.is_available()
    unit_stand_ins()  # SKIP before anything is built when they do not import
    ckpt = model_checkpoint(derived_yaml(TINY_DENSE, workdir / "publish_model.yaml", **PUBLISH_MODEL),
                            workdir / "publish_model")
    trainer = make_trainer(ckpt)
    sizes = [t.numel() * t.element_size() for _, t in trainer.export_hf_weights()]
    model_bytes, n_tensors = sum(sizes), len(sizes)

    class DeviceBucketsOverGloo(BroadcastPublisher):
        """The NCCL path's device buckets (CUDA IPC handles to the sender process, pinned mirrors for the disk
        copy), sent over gloo: one GPU cannot hold NCCL ranks for both trainer and engine."""

        def _sender_device(self):
            return torch.device("cuda", torch.cuda.current_device())

    paths = [("host buckets over gloo", BroadcastPublisher, "host")]
    if cuda:
        paths.append(("device buckets (CUDA IPC to the sender) over gloo", DeviceBucketsOverGloo, "device"))
    pinned_emptied = cuda and empty_pinned_cache()
    parts = [f"{model_bytes / MIB:.0f} MiB model, {n_tensors} tensors, 3 publishes a path"]
    for label, cls, tag in paths:
        measured = publish_three(cls, trainer, workdir, tag, cuda)
        parts.append(judge_publishes(label, measured, tag, (model_bytes, n_tensors), cuda,
                                     shm_asserted=tag == "host" or pinned_emptied))
    if not cuda:
        parts.append("CUDA memory and device buckets not measured (CPU)")
    parts.append("the NCCL broadcast itself not run (its receivers would need a GPU of their own)")
    return "; ".join(parts)


def judge_publishes(label: str, m: dict, tag: str, model: tuple[int, int], cuda: bool, shm_asserted: bool) -> str:
    """publish_memory's assertions on one path's publishes (:func:`publish_three`); its line of the detail."""
    model_bytes, n_tensors = model
    rows, closed = m["rows"], m["closed"]

    def mib(key: str, i: int) -> list[float]:  # part i of each row's key: 0 CUDA, 1 shared memory / pool allocated
        return [round(r[key][i] / MIB, 2) for r in rows]

    for v, r in enumerate(rows, 1):
        require(r["sent"] == model_bytes and r["tensors"] == n_tensors,
                f"{label}, publish {v}: sent {r['sent']} bytes and {r['tensors']} tensors arrived; expected "
                f"{model_bytes} bytes, {n_tensors} tensors")
    # the measurement sees a publish's buckets: where they live (host: shared memory, device: CUDA), memory rises
    # by the model while the publish is prepared
    where = 1 if tag == "host" else 0
    require(all(r["held"][where] >= 0.9 * model_bytes for r in rows),
            f"{label}: {'shared' if where else 'CUDA'} memory did not rise by the model while a publish was "
            f"prepared ({mib('held', where)} MiB): the measurement would not see buckets left behind")
    if cuda:
        require(all(abs(r["after"][0]) <= MIB for r in rows) and abs(closed[0]) <= MIB,
                f"{label}: torch.cuda.memory_allocated() {mib('after', 0)} MiB off its baseline after publishes "
                f"1-3, {closed[0] / MIB:.2f} MiB after close (tolerance 1 MiB)")
    # the shared buckets publish 1 allocated serve publishes 2 and 3, all back in the pool after each publish
    pool = rows[0]["pool"][0]
    require(all(r["pool"] == (pool, pool) for r in rows),
            f"{label}: the shared-bucket pool's (allocated, free) bytes after publishes 1-3 are "
            f"{[r['pool'] for r in rows]}, not the same {pool} both, each time")
    if shm_asserted:
        require(all(abs(r["after"][1] - pool) < SHM_TOLERANCE for r in rows) and closed[1] < SHM_TOLERANCE,
                f"{label}: shared memory {mib('after', 1)} MiB above its baseline after publishes 1-3 (the pool "
                f"keeps {pool / MIB:.0f} MiB) and {closed[1] / MIB:.0f} MiB after close (tolerance "
                f"{SHM_TOLERANCE // MIB} MiB)")
    gpu = (f"CUDA {mib('after', 0)} MiB, ", f"CUDA {closed[0] / MIB:.2f} MiB, ") if cuda else ("", "")
    return (f"{label}: {'shared' if where else 'CUDA'} memory +{mib('held', where)} MiB while prepared; after each "
            f"publish {gpu[0]}shared memory {mib('after', 1)} MiB (pool {pool / MIB:.0f} MiB reused); after close "
            f"{gpu[1]}shared memory {closed[1] / MIB:.2f} MiB"
            + ("" if shm_asserted else " (shared memory not asserted: torch cannot empty its pinned host cache here)"))


# -- cuda_ipc ----------------------------------------------------------------------------------------------
def digest(t) -> str:
    """SHA-256 of a tensor's bytes."""
    import torch

    return hashlib.sha256(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def ipc_child(inbox, outbox) -> None:
    """cuda_ipc's consumer, a spawned process: each bucket's per-tensor digests back, then lets go of it."""
    from megarl.rollout.bucket_format import unpack

    while True:
        item = inbox.get()
        if item is None:
            break
        label, rows, payload = item
        outbox.put((label, payload.device.type, {name: digest(t) for name, t in unpack(rows, payload)}))
        del item, payload


def ipc_tensors(device) -> list:
    """cuda_ipc's named tensors (IPC_TENSORS), seeded, on ``device``."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [(f"t{i}_{dtype}", (torch.randn(shape, generator=g) * 1000).to(getattr(torch, dtype)).to(device))
            for i, (shape, dtype) in enumerate(IPC_TENSORS)]


def ipc_buckets(named: list, device) -> list:
    """The project's own packing (megarl/rollout/bucket_format.py) of ``named``: ``(meta rows, meta bytes, payload)``
    per bucket; on CPU in shared memory."""
    from megarl.rollout.bucket_format import group_tensors, pack

    return [pack(group, device, share=device.type == "cpu") for group in group_tensors(named, IPC_BUCKET_BYTES)]


def corrupted(buckets: list) -> tuple[str, list, object]:
    """A copy of the payload of the bucket with the most tensors, one byte changed in the middle of its last
    tensor: ``(that tensor's name, the bucket's meta rows, the copy)``."""
    import torch

    rows, _, payload = max(buckets, key=lambda b: len(b[0]))
    name, shape, dtype, offset = rows[-1][:4]
    bad = payload.clone()
    bad[offset + math.prod(shape) * getattr(torch, dtype).itemsize // 2].add_(1)  # uint8: 255 wraps to 0
    return name, rows, bad


def send_to_child(buckets: list, bad_rows: list, bad, timeout_s: float = 120.0) -> dict:
    """Every bucket, then the corrupted copy, to a spawned :func:`ipc_child`; its replies by label."""
    import torch.multiprocessing

    ctx = torch.multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=ipc_child, args=(inbox, outbox), daemon=True)
    child.start()
    try:
        for i, (rows, _, payload) in enumerate(buckets):
            inbox.put((f"bucket{i}", rows, payload))
        inbox.put(("corrupted", bad_rows, bad))
        inbox.put(None)
        replies = {}
        for _ in range(len(buckets) + 1):
            label, where, digests = outbox.get(timeout=timeout_s)
            replies[label] = (where, digests)
        child.join(60)
        require(child.exitcode == 0, f"the child process exited {child.exitcode}")
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
    return replies


def check_cuda_ipc(workdir: Path) -> str:
    require_cuda()
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    named = ipc_tensors(device)
    expected = {name: digest(t) for name, t in named}
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    if cuda:
        torch.cuda.synchronize()
    base = allocated()
    buckets = ipc_buckets(named, device)
    bad_name, bad_rows, bad = corrupted(buckets)
    sizes = [payload.numel() for _, _, payload in buckets] + [bad.numel()]
    require(len(buckets) >= 2 and min(sizes) > MIB, f"bucket sizes {sizes}: each must exceed the 1 MiB tolerance")
    held = allocated() - base
    replies = send_to_child(buckets, bad_rows, bad)
    names = []
    for i, (rows, _, _) in enumerate(buckets):
        where, got = replies[f"bucket{i}"]
        want = {row[0]: expected[row[0]] for row in rows}
        require(where == device.type, f"bucket {i} arrived on {where}, not {device.type}")
        require(got == want, f"bucket {i}: the child's digests differ for {[n for n in want if got.get(n) != want[n]]}")
        names += list(got)
    require(sorted(names) == sorted(expected), f"the child saw tensors {sorted(names)}, not {sorted(expected)}")
    changed = sorted(n for n, d in replies["corrupted"][1].items() if d != expected[n])
    require(changed == [bad_name], f"negative control: a byte changed in {bad_name} changed the digests of {changed}")
    total = sum(sizes)
    del buckets, bad
    gc.collect()
    detail = (f"{device.type}: {len(sizes) - 1} buckets and a corrupted copy ({total / MIB:.1f} MiB) through a spawned "
              f"process's queue; the child's digests of {len(names)} tensors match; the byte changed in {bad_name} "
              f"changed its digest only")
    if not cuda:
        return detail + "; memory_allocated not measured (CPU: shared-memory buckets)"
    torch.cuda.ipc_collect()
    torch.cuda.synchronize()
    left = allocated() - base
    require(held >= total, f"memory_allocated rose by {held} bytes with {total} bytes of buckets: it does not see them")
    require(abs(left) <= MIB, f"memory_allocated is {left / MIB:.2f} MiB off its baseline after the child let go, the "
                              f"buckets were deleted and torch.cuda.ipc_collect() ran (tolerance 1 MiB)")
    return detail + f"; memory_allocated +{held / MIB:.1f} MiB while held, {left} bytes off after ipc_collect"
