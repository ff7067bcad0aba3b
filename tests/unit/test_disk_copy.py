"""The broadcast publisher's disk copy is written beside the publish (megarl/rollout/disk_copy.py).

A writer held back on purpose shows it: the publish (export + stall) returns
while the copy is not on disk yet; an engine restarted meanwhile and a
checkpoint wait for the writer and then find the whole version.
"""
import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_publish import REPO, CheckpointExporter
from test_supervisor import make, req

import megarl.models.bridge
from megarl.checkpoint.schedule import CheckpointSchedule
from megarl.errors import EngineError
from megarl.rollout.disk_copy import DiskCopy
from megarl.rollout.publish import BroadcastPublisher
from megarl.rollout.supervisor import EngineLost


async def _until(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def hold_the_disk(monkeypatch, gates: dict) -> None:
    """The disk copy of version v waits for ``gates[v]`` before it writes (and stops if told to meanwhile)."""
    from megarl.models.safetensors_stream import WriteStopped

    real_save = megarl.models.bridge.save_file_stoppable

    def held_save(tensors, path, metadata=None, should_stop=None):  # path: weights/.v{v}.partial/...
        version = int(Path(path).parent.name.split(".")[1][1:])
        while not gates[version].wait(0.01):
            if should_stop():
                raise WriteStopped(f"version {version}'s held write stopped")
        real_save(tensors, path, metadata=metadata, should_stop=should_stop)

    monkeypatch.setattr(megarl.models.bridge, "save_file_stoppable", held_save)


def publisher(sup, ckpt, weights_dir) -> BroadcastPublisher:
    pub = BroadcastPublisher(CheckpointExporter(Path(ckpt)), sup, weights_dir, timeout_s=30)
    pub._open = lambda members, buckets: None  # the fake engine joins no group: nothing is sent
    return pub


def test_the_disk_copy_is_written_beside_the_publish_not_inside_it(tmp_path, monkeypatch):
    from megarl.models.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", tmp_path / "ckpt", seed=1)
    release = threading.Event()
    hold_the_disk(monkeypatch, {1: release})
    weights_dir = tmp_path / "weights"

    async def main():
        sup, engines, launched, _ = make(n=1)
        await sup.start()
        pub = publisher(sup, ckpt, weights_dir)
        try:
            t0 = time.perf_counter()
            await pub.prepare(1)
            await pub.apply(1)
            publish_s = time.perf_counter() - t0
            assert not (weights_dir / "v1").exists(), "the publish waited for the disk"
            assert publish_s < 5 and sup.weights == (str(weights_dir / "v1"), 1)
            # an engine restarted now waits for the copy; so does a checkpoint
            engines[0].die()
            with pytest.raises(EngineLost):
                await sup.generate(req())
            await _until(lambda: launched)
            seen = []

            class Checkpointer:
                last_step = None

                async def wait(self):
                    return None

                async def save(self, controller, background=False):
                    seen.append((weights_dir / "v1" / "config.json").is_file())

            sched = CheckpointSchedule(Checkpointer(), pub, SimpleNamespace(async_save=False, max_save_failures=3))
            saving = asyncio.create_task(sched.checkpoint(None, 1))
            await asyncio.sleep(0.3)
            assert launched[0].updates == [] and not saving.done() and seen == []
            release.set()
            await saving
            await _until(lambda: sup.stats()["n_engine_restarts"] == 1)
            assert launched[0].updates == [(str(weights_dir / "v1"), 1)] and seen == [True]
            assert sorted(p.name for p in weights_dir.iterdir()) == ["v1"]  # no partial directory left
        finally:
            pub.close()
            await sup.close()

    asyncio.run(main())
    written, exported = load_file(str(weights_dir / "v1" / "model.safetensors")), load_file(
        str(ckpt / "model.safetensors"))
    assert written.keys() == exported.keys() and all(torch.equal(written[k], exported[k]) for k in exported)


def test_a_failed_write_is_raised_to_whoever_waits_and_leaves_no_version(tmp_path):
    def broken(tensors, out, hf, should_stop=None):
        Path(out).mkdir(parents=True)
        raise OSError(28, "No space left on device")

    copy = DiskCopy(write=broken)
    copy.start(tmp_path / "v3", [([["a", [2], "float32", 0]], None, torch.zeros(16, dtype=torch.uint8))], {}, 3)
    with pytest.raises(RuntimeError, match=r"disk copy of version 3 failed: OSError: \[Errno 28\] No space"):
        asyncio.run(copy.wait())
    assert list(tmp_path.iterdir()) == []
    # an engine about to load it hears it as its own failure (the supervisor retries or drops it)
    pub = BroadcastPublisher(None, None, tmp_path)
    pub._copy = copy
    with pytest.raises(EngineError, match="disk copy of version 3 failed"):
        asyncio.run(pub._written_for_engines())


def test_the_next_publish_does_not_wait_for_the_disk_and_stops_the_older_copy(tmp_path, monkeypatch):
    """prepare(2) returns while version 1's copy is still held at the disk; an engine restarted between the two
    publishes still gets version 1 (the older write goes on until version 2 is applied); applying version 3
    stops version 2's write, which never appears, and version 3's is the one left."""
    from megarl.models.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", tmp_path / "ckpt", seed=1)
    release = {v: threading.Event() for v in (1, 2, 3)}
    hold_the_disk(monkeypatch, release)
    weights_dir = tmp_path / "weights"

    async def main():
        sup, _, _, _ = make(n=1)
        await sup.start()
        pub = publisher(sup, ckpt, weights_dir)
        try:
            await pub.prepare(1)
            await pub.apply(1)
            await asyncio.wait_for(pub.prepare(2), 10)  # version 1's copy is still held
            restarted = asyncio.ensure_future(pub._written_for_engines(1))  # what a restart now waits for
            await asyncio.sleep(0.3)
            assert not restarted.done() and not (weights_dir / "v1").exists()
            release[1].set()
            await asyncio.wait_for(restarted, 10)
            assert (weights_dir / "v1" / "config.json").is_file()
            await pub.apply(2)
            await asyncio.wait_for(pub.prepare(3), 10)  # version 2's copy is held
            release[3].set()
            await asyncio.wait_for(pub.apply(3), 10)  # stops version 2's write
            await asyncio.wait_for(pub.wait_written(), 10)
            assert pub._copy.n_superseded == 1
            assert sorted(p.name for p in weights_dir.iterdir()) == ["v3"]  # no v2, no partial directory
        finally:
            for gate in release.values():  # nothing left held (a wait that timed out still has its thread)
                gate.set()
            pub.close()
            await sup.close()

    asyncio.run(main())
    written, exported = load_file(str(weights_dir / "v3" / "model.safetensors")), load_file(
        str(ckpt / "model.safetensors"))
    assert written.keys() == exported.keys() and all(torch.equal(written[k], exported[k]) for k in exported)
