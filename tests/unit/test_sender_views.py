"""The weight sender holds one bucket of a publish at a time, so a sender killed at any point holds at most one.

Under NCCL each bucket is trainer GPU memory the sender sees through CUDA IPC; torch keeps a shared block alive
for as long as its producer lives once the consumer died without letting go of it, so every view a killed sender
held would stay allocated on the trainer's GPU for good. Here the real :class:`SenderProcess` (spawned) sends
shared-memory buckets through a recording group in place of the broadcast's process group (a stand-in: only the
sender's references are under test; the real group is tests/e2e/test_broadcast.py's). At each bucket the
group counts the buckets alive in the sender process; a publish whose sender is killed half-way leaves the
node's shared memory where it was before the publish. The CUDA half (the sender copies nothing of the trainer's
into views it keeps; the trainer's GPU memory after a kill) is gpu_check's ``sender_kill``.
"""
import gc
import json
import time
from pathlib import Path

import pytest
import torch

from megarl.errors import EngineError
from megarl.rollout.broadcast_sender import SenderProcess

MARK = 123_457  # the buckets' element count, which nothing else in the sender process has


def shmem() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


class CountingGroupStandIn:
    """What the sender makes its group with: at each bucket it writes how many buckets the sender process holds
    (tensors of MARK elements) to the file ``group_id`` names; at bucket ``stall`` it sleeps past any deadline."""

    stall = None

    def __init__(self, host, port, world_size, *, backend, timeout_s, group_id, secret, serve_rendezvous, shards):
        self.group_id = group_id
        self.report = Path(group_id.split("|")[0])
        self.stall = int(group_id.split("|")[1]) if "|" in group_id else None
        self.sent = 0

    def connect(self) -> None:
        pass

    def send_bucket(self, meta, payload, shard) -> None:
        gc.collect()
        held = sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.numel() == MARK)
        with self.report.open("a") as f:
            f.write(json.dumps({"bucket": self.sent, "held": held}) + "\n")
        if self.sent == self.stall:
            time.sleep(600)
        self.sent += 1

    def end_stream(self) -> None:
        pass

    def close(self) -> None:
        pass


def info(report: Path, stall: int | None = None) -> dict:
    return {"host": "127.0.0.1", "port": 0, "world_size": 2, "backend": "gloo", "timeout_s": 5.0, "secret": "s",
            "group_id": f"{report}|{stall}" if stall is not None else str(report)}


def buckets(n: int) -> list:
    return [(bytes(8), torch.full((MARK,), float(i)).share_memory_(), 0) for i in range(n)]


def test_the_sender_is_handed_one_bucket_at_a_time_and_lets_go_of_each_before_the_next(tmp_path):
    report = tmp_path / "held.jsonl"
    proc = SenderProcess(CountingGroupStandIn)
    try:
        seconds = proc.send(info(report), buckets(4), timeout_s=60).result(120)
    finally:
        proc.close()
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert seconds >= 0 and [r["bucket"] for r in rows] == [0, 1, 2, 3]
    assert [r["held"] for r in rows] == [1, 1, 1, 1], \
        f"the sender held {[r['held'] for r in rows]} buckets while sending buckets 0-3 (one at a time: 1 each)"


def test_a_sender_killed_mid_publish_leaves_shared_memory_at_its_baseline(tmp_path):
    report = tmp_path / "held.jsonl"
    proc = SenderProcess(CountingGroupStandIn)
    proc.send(info(tmp_path / "warm.jsonl"), buckets(1), timeout_s=60).result(120)  # started and in its group
    gc.collect()
    base = shmem()
    sent = buckets(64)  # 64 x 0.5 MB
    fut = proc.send(info(report, stall=2), sent, timeout_s=3)
    with pytest.raises(EngineError, match="past its 3 s deadline"):
        fut.result(120)
    assert not proc.proc.is_alive()
    proc.kill()
    del sent
    gc.collect()
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert [r["held"] for r in rows] == [1, 1, 1], rows  # killed while holding bucket 2 alone
    assert shmem() - base < 4 << 20, f"{(shmem() - base) >> 20} MB of the publish still held after the kill"
