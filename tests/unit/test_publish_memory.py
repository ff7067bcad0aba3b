"""A broadcast publish gives its shared memory back: after publish N (N = 1..3) the node's shared memory (the
Shmem line of /proc/meminfo, where the buckets the sender process reads live) is back at its level before the
first publish.

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

from megarl.publish import BroadcastPublisher
from megarl.rollout.engine_shards import hf_tensor_shapes

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


def publish_three_times(tmp_path, workers: int, keep: list | None = None) -> tuple[int, list, list]:
    """(baseline, shared memory after each prepare, after each publish); ``keep`` collects each publish's
    buckets (the negative control: a publisher that keeps them)."""
    router = TwoWorkerEnginesStandIn(2, workers)
    pub = BroadcastPublisher(RandomExporter(), router, tmp_path / "weights", timeout_s=60)
    pub.bucket_bytes = 16 * MB
    gc.collect()
    base, prepared, after = shmem(), [], []

    async def go():
        for version in (1, 2, 3):
            await pub.prepare(version)
            if keep is not None:
                keep.append(pub._buckets)
            prepared.append(shmem())
            await pub.apply(version)
            await pub.wait_written()
            router.got.clear()
            gc.collect()
            await asyncio.sleep(0.2)  # the sender's acknowledgement reaches it after it let go of the buckets
            after.append(shmem())
    try:
        asyncio.run(go())
    finally:
        pub.close()
    return base, prepared, after


@pytest.mark.parametrize("workers", [2, 1], ids=["cut per worker", "whole"])
def test_shared_memory_is_back_at_its_baseline_after_each_publish(tmp_path, workers):
    base, prepared, after = publish_three_times(tmp_path, workers)
    # the measurement sees a publish's buckets: the export (the disk copy reads it) and, cut, the send buckets
    assert all(p - base >= MODEL_BYTES * (2 if workers > 1 else 1) * 0.9 for p in prepared), (base, prepared)
    assert all(a - base < 16 * MB for a in after), \
        f"shared memory {[round((a - base) / MB) for a in after]} MB above its baseline after publishes 1-3"


def test_the_check_sees_buckets_left_behind(tmp_path):
    kept: list = []
    base, _, after = publish_three_times(tmp_path, 2, keep=kept)
    assert after[-1] - base > 2 * MODEL_BYTES, "three publishes' kept buckets are not seen"


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
        left = shmem() - base
    finally:
        pub.close()
    assert out["weight_sync_bytes"] == 0  # nothing was sent
    assert left < 16 * MB, f"{left / MB:.0f} MB of the failed publish's shared memory is still held"
