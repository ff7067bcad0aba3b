"""Publishers: which one a config gets, and a broadcast that fails mid-publish.

The whole loop with broadcast publishing is tests/e2e/test_broadcast.py.
"""
import asyncio
import json
import time
from pathlib import Path

from megarl.builder import load_run_config
from megarl.rollout.publish import BroadcastPublisher, DiskPublisher, make_publisher
from megarl.types import GenerateRequest, SamplingParams

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"
PROMPT = [1, 5, 6, 7, 8]
REQUEST = GenerateRequest("r", PROMPT, SamplingParams(max_new_tokens=12, seed=0))


def test_publisher_follows_weight_sync(tmp_path, monkeypatch):
    for key in ("MEGARL_WEIGHT_SYNC_ADDR", "MEGARL_ENGINE_ADDRS"):
        monkeypatch.delenv(key, raising=False)
    assert isinstance(make_publisher(load_run_config(TINY), None, None, tmp_path), DiskPublisher)
    cfg = load_run_config(TINY, ["rollout.weight_sync=broadcast", "rollout.bucket_mb=2"])
    pub = make_publisher(cfg, None, None, tmp_path)
    assert isinstance(pub, BroadcastPublisher) and pub.bucket_bytes == 2 << 20
    assert (pub.host, pub.port, pub.backend) == ("127.0.0.1", 0, "gloo")
    monkeypatch.setenv("MEGARL_WEIGHT_SYNC_ADDR", "node01:29600")  # a launched plan with engines elsewhere
    assert (make_publisher(cfg, None, None, tmp_path).host, make_publisher(cfg, None, None, tmp_path).port) == \
        ("node01", 29600)


class CheckpointExporter:
    """The trainer's side of a publish, reduced to its output: the HF tensors of a checkpoint."""

    def __init__(self, ckpt: Path) -> None:
        self.ckpt = ckpt
        self.hf_config = json.loads((ckpt / "config.json").read_text())

    def exported_hf_config(self) -> dict:
        return self.hf_config

    def export_hf_weights(self):
        from safetensors.torch import load_file

        yield from load_file(str(self.ckpt / "model.safetensors")).items()


def engine_matches(ckpt: Path, res) -> float:
    """Largest |engine logp_behav - teacher-forced logp of ``ckpt``| over the generated tokens."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + res.output_ids])).logits[0, len(PROMPT) - 1:-1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.output_ids)[:, None])[:, 0]
    return float((ref - torch.tensor(res.logp_behav)).abs().max())


def test_engine_lost_mid_publish_under_nccl_semantics_leaves_the_trainer_alive(tmp_path, monkeypatch):
    """Real HF engine processes; one is killed after the first bucket, and the sending side then fails
    the way NCCL does (its process ends, no ``except`` runs: broadcast_faults.WatchdogBroadcaster).

    The trainer (this process) survives; the surviving engine learns at once (the sender's sockets
    close with it; no wait for the group's timeout) and loads the disk copy, the killed one restarts
    from it; the next publish makes a new group both engines join.
    """
    from broadcast_faults import KILL_ENV, WatchdogBroadcaster

    import megarl.rollout.publish
    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.rollout.client import launch_engine_process
    from megarl.rollout.supervisor import EngineSupervisor

    model = REPO / "configs/models/tiny_qwen3.yaml"
    base, other = (write_tiny_checkpoint(model, tmp_path / name, seed=seed) for name, seed in (("v0", 0), ("v1", 1)))

    def launch(i: int):
        return launch_engine_process(str(base), "hf", log_path=str(tmp_path / f"engine{i}.log"))

    engines = [launch(0), launch(1)]
    monkeypatch.setenv(KILL_ENV, f"{engines[0][0].pid}:{tmp_path / 'killed'}")
    monkeypatch.setattr(megarl.rollout.publish, "WeightBroadcaster", WatchdogBroadcaster)

    async def main():
        sup = EngineSupervisor(engines, launch=launch, weights=(str(base), 0))
        await sup.start()
        weights_dir = tmp_path / "weights"
        pub = BroadcastPublisher(CheckpointExporter(Path(other)), sup, weights_dir, timeout_s=60)
        pub.bucket_bytes = 16 << 10  # several buckets for the tiny model, so the engine dies mid-stream
        try:
            await pub.prepare(1)
            assert len(pub._buckets) >= 3
            t0 = time.perf_counter()
            first = await pub.apply(1)
            fallback_s = time.perf_counter() - t0
            sync = {k: v for k, v in first.items() if k.startswith("weight_sync")}
            assert sync == {"weight_sync_bytes": 0, "weight_sync_groups": 1, "weight_sync_fallbacks": 1}
            assert (tmp_path / "killed").exists() and engines[0][0].poll() is not None
            for _ in range(600):  # the killed engine restarts from the disk copy
                if sup.n_restarts:
                    break
                await asyncio.sleep(0.1)
            assert sup.n_restarts == 1 and sup.weights == (str(weights_dir / "v1"), 1)
            res1 = [await sup.generate(REQUEST) for _ in range(2)]
            pub.trainer = CheckpointExporter(Path(base))
            await pub.prepare(2)
            second = await pub.apply(2)
            assert second["weight_sync_bytes"] > 0 and second["weight_sync_groups"] == 2
            assert second["weight_sync_fallbacks"] == 1
            res2 = [await sup.generate(REQUEST) for _ in range(2)]
            assert sorted(p.name for p in weights_dir.iterdir()) == ["v2"], "older disk copies are removed"
            return fallback_s, res1, res2
        finally:
            pub.close()
            await sup.close()

    fallback_s, res1, res2 = asyncio.run(main())
    print(f"\nengine lost mid-publish + disk fallback: {fallback_s:.2f} s")
    assert fallback_s < 30, f"the surviving engine waited for the group's timeout ({fallback_s:.1f} s)"
    assert all(set(r.versions) == {1} and engine_matches(Path(other), r) < 1e-4 for r in res1)
    assert all(set(r.versions) == {2} and engine_matches(Path(base), r) < 1e-4 for r in res2)


def test_engine_dtype_is_rollout_dtype_else_model_dtype(tmp_path, monkeypatch):
    for key in ("MEGARL_WEIGHT_SYNC_ADDR", "MEGARL_ENGINE_ADDRS"):
        monkeypatch.delenv(key, raising=False)
    assert load_run_config(TINY).engine_dtype == "float32"
    assert load_run_config(TINY, ["model.dtype=bfloat16"]).engine_dtype == "bfloat16"
    cfg = load_run_config(TINY, ["rollout.dtype=bfloat16"])
    assert (cfg.model.dtype, cfg.engine_dtype) == ("float32", "bfloat16")
    assert make_publisher(cfg, None, None, tmp_path).engine_dtype == "bfloat16"
    cfg = load_run_config(TINY, ["rollout.dtype=bfloat16", "rollout.weight_sync=broadcast"])
    assert make_publisher(cfg, None, None, tmp_path).engine_dtype == "bfloat16"


async def _prepared(pub, version: int) -> None:
    """``prepare``, then wait for the disk copy as every reader in megarl does: the broadcast publisher writes
    it in the background, and reading it right after ``prepare`` raced the writer (FileNotFoundError)."""
    await pub.prepare(version)
    await pub.wait_written()


def test_publishers_cast_to_the_engines_dtype_once_on_the_way(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    import megarl.rollout.publish
    from megarl.models.bridge import write_hf_checkpoint
    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.rollout.disk_copy import DiskCopy

    def slow_write(*args, **kw):  # a slow disk: a reader that does not wait for the background copy fails every time
        time.sleep(0.3)
        return write_hf_checkpoint(*args, **kw)

    monkeypatch.setattr(megarl.rollout.publish, "DiskCopy", lambda: DiskCopy(write=slow_write))

    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", tmp_path / "ckpt", seed=0)
    fp32 = load_file(str(ckpt / "model.safetensors"))
    assert {t.dtype for t in fp32.values()} == {torch.float32}
    trainer = CheckpointExporter(ckpt)
    for pub in (DiskPublisher(trainer, None, tmp_path / "disk", engine_dtype="bfloat16"),
                BroadcastPublisher(trainer, None, tmp_path / "bcast", engine_dtype="bfloat16")):
        asyncio.run(_prepared(pub, 3))
        written = load_file(str(pub.weights_dir / "v3" / "model.safetensors"))
        assert written.keys() == fp32.keys()
        assert all(torch.equal(written[k], fp32[k].to(torch.bfloat16)) for k in fp32)
        assert json.loads((pub.weights_dir / "v3" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {row[2] for _, rows, _, _ in pub._buckets for row in rows} == {"bfloat16"}  # what is sent
    assert trainer.hf_config.get("dtype", "float32") == "float32"  # the trainer's own config is left alone
    # same dtype: the trainer's own export, untouched
    same = BroadcastPublisher(trainer, None, tmp_path / "same", engine_dtype="float32")
    asyncio.run(same.prepare(1))
    assert {row[2] for _, rows, _, _ in same._buckets for row in rows} == {"float32"}
    same.close()


def test_a_sender_step_past_its_deadline_is_killed():
    """The trainer waits for each step of the sender with a deadline; a hung collective costs that
    deadline, not the trainer: the sender process is killed and the publish fails over."""
    import pytest
    from broadcast_faults import HangingBroadcaster

    from megarl.errors import EngineError
    from megarl.rollout.broadcast_sender import SenderProcess

    sender = SenderProcess(HangingBroadcaster)
    info = HangingBroadcaster("127.0.0.1", 1, 2, backend="gloo", timeout_s=2.0).group_info()
    t0 = time.perf_counter()
    with pytest.raises(EngineError, match=r"step 1 of 2 past its 2 s deadline"):
        sender.send(info, [], timeout_s=2.0).result(timeout=60)
    assert not sender.proc.is_alive() and sender.proc.exitcode == -9  # SIGKILL
    assert time.perf_counter() - t0 < 30


def test_broadcast_prepare_packs_into_shared_buckets_without_a_second_copy(tmp_path):
    """prepare() leaves the export in shared-memory buckets (the sender process reads them without a copy)
    and empties the exported list as it packs, so host memory never holds the model twice."""
    import torch

    from megarl.rollout.bucket_format import rows_bytes
    from megarl.rollout.export_buckets import pack_shared as _pack_shared

    tensors = [("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(3, 5)), ("c", torch.zeros(2, 2))]
    buckets = _pack_shared(tensors, bucket_bytes=64)
    assert tensors == []
    assert [[row[0] for row in rows] for rows, _, _ in buckets] == [["a"], ["b"], ["c"]]  # 24, 60, 16 bytes
    assert all(payload.is_shared() for _, _, payload in buckets)
    assert [rows_bytes(rows) for rows, _, _ in buckets] == [24, 60, 16]
    assert [payload.numel() for _, _, payload in buckets] == [32, 64, 16]  # each tensor 16-byte aligned
    assert torch.equal(buckets[1][2][:60].view(torch.float32).reshape(3, 5), torch.ones(3, 5))
