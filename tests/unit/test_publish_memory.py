"""A broadcast publish gives its shared memory back: after publish N (N = 1..3) the node's shared memory (the
Shmem line of /proc/meminfo, where the buckets the sender process reads live) is where publish 1 left it (the
buckets kept for the next publish: megarl/rollout/bucket_pool.py, nothing allocated again) and back at its
level before the first publish once the publisher closes.

The real BroadcastPublisher, its spawned sender process and its disk copy publish an 84 MB model to two engines
of two workers each (the cut buckets) or of one (the whole buckets); the engines are receiving threads
(test_engine_shards.TwoWorkerEnginesStandIn). Each publish is seen to raise shared memory by at least the model
while its buckets exist, so the measurement would see a publish's buckets left behind; holding on to them (the
negative control) is seen failing.
"""
import asyncio
import gc
from pathlib import Path

import pytest
import torch
from test_engine_shards import TwoWorkerEnginesStandIn

from megarl.rollout.engine_shards import hf_tensor_shapes
from megarl.rollout.publish import BroadcastPublisher

HF = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 4096,
      "num_hidden_layers": 1, "intermediate_size": 4096, "tie_word_embeddings": True, "dtype": "float32",
      "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
MODEL_BYTES = 4 * sum(torch.Size(s).numel() for _, s in hf_tensor_shapes(HF))
MB = 1 << 20


class RandomExporter:
    """The trainer's side of a publish, reduced to its output: fresh tensors of a one-layer Qwen3 each time."""

    def exported_hf_config(self) -> dict:
        return HF

    def export_hf_weights(self):
        for name, shape in hf_tensor_shapes(HF):
            yield name, torch.randn(shape)


def shmem() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


def publish_three_times(tmp_path, workers: int) -> dict:
    """Shared memory before (``base``), after each prepare and each publish, after ``close``, and the pool's
    bytes allocated and free after each publish."""
    router = TwoWorkerEnginesStandIn(2, workers)
    pub = BroadcastPublisher(RandomExporter(), router, tmp_path / "weights", timeout_s=60)
    pub.bucket_bytes = 16 * MB
    gc.collect()
    out = {"base": shmem(), "prepared": [], "after": [], "allocated": [], "free": []}

    async def go():
        for version in (1, 2, 3):
            await pub.prepare(version)
            out["prepared"].append(shmem())
            await pub.apply(version)
            await pub.wait_written()
            router.got.clear()
            gc.collect()
            await asyncio.sleep(0.2)  # the sender's acknowledgement reaches it after it let go of the buckets
            out["after"].append(shmem())
            out["allocated"].append(pub._pool.bytes_allocated)
            out["free"].append(pub._pool.free_bytes())
    try:
        asyncio.run(go())
    finally:
        pub.close()
    gc.collect()
    out["closed"] = shmem()
    return out


@pytest.mark.parametrize("workers", [2, 1], ids=["cut per worker", "whole"])
def test_shared_memory_is_reused_and_back_at_its_baseline_after_close(tmp_path, workers):
    m = publish_three_times(tmp_path, workers)
    base, sets = m["base"], 2 if workers > 1 else 1  # the export (the disk copy reads it) and, cut, the send buckets
    # the measurement sees a publish's buckets
    assert all(p - base >= MODEL_BYTES * sets * 0.9 for p in m["prepared"]), (base, m["prepared"])
    # publish 1 allocates one set; publishes 2 and 3 reuse it (the disk copy ended before the next prepare)
    assert m["allocated"][0] >= MODEL_BYTES * sets and m["allocated"] == [m["allocated"][0]] * 3, m["allocated"]
    assert m["free"] == m["allocated"], "every buffer is back in the pool once the sender and the disk copy let go"
    # between publishes shared memory holds that one set and no more; closing gives it back
    assert all(abs(a - base - m["allocated"][0]) < 16 * MB for a in m["after"]), \
        f"shared memory {[round((a - base) / MB) for a in m['after']]} MB above its baseline after publishes 1-3, " \
        f"the pool holds {m['allocated'][0] / MB:.0f} MB"
    assert m["closed"] - base < 16 * MB, f"{(m['closed'] - base) / MB:.0f} MB still held after close"


def test_the_check_sees_buckets_left_behind(tmp_path, monkeypatch):
    # the negative control: holders that never let go (a lease never released) leave each publish's buckets
    # behind, and the pool must allocate anew for every publish
    import megarl.rollout.bucket_pool

    held: list = []
    monkeypatch.setattr(megarl.rollout.bucket_pool.Lease, "release", lambda self, holder: held.append(self))
    m = publish_three_times(tmp_path, 2)
    assert m["after"][-1] - m["base"] > 5 * MODEL_BYTES, "three publishes' buckets left behind are not seen"
    assert m["allocated"][2] >= 3 * m["allocated"][0] * 0.99 and m["free"] == [0, 0, 0]


class EnginesLostBeforeJoiningStandIn(TwoWorkerEnginesStandIn):
    """Engines that answer /health but never join the broadcast: the sender misses its step deadline."""

    async def update_weights_from_broadcast(self, opener, specs, version, *, weights=None, weights_ready=None):
        opener([(i, 0, self.workers) for i in range(self.engines)])
        return {}


def test_a_failed_publish_gives_its_shared_memory_back_too(tmp_path):
    """The sender misses its deadline (no engine joined) and is killed: the publish's buckets still go."""
    pub = BroadcastPublisher(RandomExporter(), EnginesLostBeforeJoiningStandIn(2, 2), tmp_path / "weights",
                             timeout_s=2)
    pub.bucket_bytes = 16 * MB
    gc.collect()
    base = shmem()

    async def go():
        await pub.prepare(1)
        out = await pub.apply(1)
        await pub.wait_written()
        return out
    try:
        out = asyncio.run(go())
        gc.collect()
        allocated, free = pub._pool.bytes_allocated, pub._pool.free_bytes()
    finally:
        pub.close()
    gc.collect()
    left = shmem() - base
    assert out["weight_sync_bytes"] == 0  # nothing was sent
    assert allocated > 0 and free == allocated, "the killed sender's hold on the buckets was not released"
    assert left < 16 * MB, f"{left / MB:.0f} MB of the failed publish's shared memory is still held"


def test_the_resource_sharer_internals_close_unclaimed_shares_uses_are_there():
    """megarl/rollout/broadcast_sender.py closes a killed sender's unfetched descriptors through
    multiprocessing's private resource sharer: this fails when upstream renames what it uses."""
    from multiprocessing import resource_sharer

    from megarl.rollout.broadcast_sender import close_unclaimed_shares, shared_fd_key

    sharer = resource_sharer._resource_sharer
    assert isinstance(sharer._cache, dict) and isinstance(sharer._key, int) and hasattr(sharer._lock, "acquire")
    closed = []
    first = shared_fd_key()
    key = sharer.register(lambda conn, pid: None, lambda: closed.append(1))[1]
    assert shared_fd_key() == key == first + 1
    assert close_unclaimed_shares(first, key) == 1 and closed == [1] and key not in sharer._cache
