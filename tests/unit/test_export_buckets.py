"""Bucket planning and where a broadcast publish packs the export (megarl/rollout/export_buckets.py).

The device flow is the CUDA + NCCL one; here the CPU stands in for the GPU (no
pinned memory, no IPC), which checks its control flow: the export is asked to
stay on the device, buckets within the budget are packed there (not in shared
memory), the rest in shared memory, and the disk copy reads host copies.
"""
import asyncio
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_publish import REPO, CheckpointExporter

from megarl.rollout.bucket_format import iter_buckets, plan_buckets, unpack
from megarl.rollout.export_buckets import pack_export
from megarl.rollout.publish import BroadcastPublisher

#: 160 B, 16 B, 200 B, 12 B
SPECS = [("embed", [10, 4], "float32"), ("norm", [4], "float32"), ("big", [100], "bfloat16"), ("b", [3], "float32")]


def tensors():
    return [(name, torch.arange(float(torch.Size(shape).numel())).reshape(shape).to(getattr(torch, dtype)))
            for name, shape, dtype in SPECS]


def test_bucket_plan_sizes_order_and_names():
    # at most 200 B a bucket, each tensor counted with 16 B of alignment: embed + norm (160 + 16 + 16 <= 200);
    # big alone (it does not fit beside them); b after it (200 + 16 + 12 > 200)
    plan = plan_buckets(SPECS, bucket_bytes=200)
    assert plan == [([["embed", [10, 4], "float32", 0], ["norm", [4], "float32", 160]], 176),
                    ([["big", [100], "bfloat16", 0]], 208),
                    ([["b", [3], "float32", 0]], 16)]
    # the packer follows the plan, tensor for tensor
    packed = list(iter_buckets(tensors(), 200))
    assert [(rows, payload.numel()) for rows, _, payload in packed] == plan
    assert plan_buckets(SPECS, bucket_bytes=1 << 20) == [(
        [["embed", [10, 4], "float32", 0], ["norm", [4], "float32", 160], ["big", [100], "bfloat16", 176],
         ["b", [3], "float32", 384]], 400)]


def test_device_buckets_within_the_budget_the_rest_in_shared_memory():
    host_only, same = pack_export(tensors(), 200)
    assert same is host_only and all(payload.is_shared() for _, _, payload in host_only)
    # 300 B of device buckets: the first (176 B) fits, the second (208 B) does not, the third (16 B) does
    send, host = pack_export(tensors(), 200, torch.device("cpu"), budget=300)
    assert [payload.is_shared() for _, _, payload in send] == [False, True, False]
    assert [rows for rows, _, _ in send] == [rows for rows, _ in plan_buckets(SPECS, 200)]
    # host copies of the device buckets (what the disk copy reads); the shared one is read as it is
    assert [h[2] is s[2] for h, s in zip(host, send)] == [False, True, False]
    assert all(torch.equal(h[2], s[2]) for h, s in zip(host, send))


class DeviceExporter(CheckpointExporter):
    """Records whether the publisher asked for the export on the host or left on the device."""

    def __init__(self, ckpt):
        super().__init__(ckpt)
        self.asked = []

    def export_hf_weights(self, to_host=True):
        self.asked.append(to_host)
        return super().export_hf_weights()


def test_publisher_packs_on_the_senders_device_and_writes_the_disk_copy_from_host_copies(tmp_path):
    from megarl.models.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", tmp_path / "ckpt", seed=2)
    trainer = DeviceExporter(Path(ckpt))
    pub = BroadcastPublisher(trainer, None, tmp_path / "weights", bucket_mb=1)
    assert pub._sender_device() is None  # no CUDA here: host buckets, as before
    pub._sender_device = lambda: torch.device("cpu")  # the GPU flow, with the CPU standing in for the device
    pub.device_budget = 1 << 40
    try:
        asyncio.run(pub.prepare(1))
        asyncio.run(pub.wait_written())
        assert trainer.asked == [False], "the export stays on the device"
        assert pub._buckets and not any(payload.is_shared() for _, _, _, payload in pub._buckets)
        exported = load_file(str(Path(ckpt) / "model.safetensors"))
        sent = {name: t for _, rows, _, payload in pub._buckets for name, t in unpack(rows, payload)}
        written = load_file(str(tmp_path / "weights" / "v1" / "model.safetensors"))
        assert sent.keys() == written.keys() == exported.keys()
        assert all(torch.equal(sent[k], exported[k]) and torch.equal(written[k], exported[k]) for k in exported)
    finally:
        pub.close()


def test_device_budget_is_a_share_of_free_memory_alone_with_fake_cuda_counters(monkeypatch):
    """The device buckets' budget leaves out the trainer's cached blocks (the sender, another process, cannot use
    them) and what the sender allocates while it sends. CUDA's counters are fakes here (no GPU on this machine);
    gpu_check's sender_kill runs the real ones."""
    from megarl.rollout import export_buckets

    gb = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gb, 80 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gb)  # 20 GB cached, unused
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gb)
    device = torch.device("cuda", 0)
    assert export_buckets.device_budget(device) == 5 * gb, "the trainer's 20 GB of cached blocks were counted"
    assert export_buckets.device_budget(device, reserve=2 * gb) == 3 * gb
    assert export_buckets.device_budget(device, reserve=20 * gb) == 0
