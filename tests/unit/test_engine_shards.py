"""Shard-aware weight sync (megarl/rollout/engine_shards.py): each vLLM worker's slices, by hand, and a broadcast
publish cut per worker.

The slices are checked here against numbers worked out from vLLM's loaders by hand (QKVParallelLinear's KV
replication, VocabParallelEmbedding's padded ranges, the fused experts' rows); vLLM's own loaders read them in
tests/e2e/test_vllm_engine.py (a TP2 engine, dense and MoE, against the HF model, with a swapped cut as the
negative control).
"""
import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch
import yaml
from test_publish import CheckpointExporter

from megarl.launch.placement import param_counts
from megarl.models.tiny import write_tiny_checkpoint
from megarl.rollout.engine_shards import hf_tensor_shapes, sent_elements, vllm_tp_rule
from megarl.rollout.publish import BroadcastPublisher
from megarl.rollout.weight_sync import join_weight_group, receive_named_tensors

REPO = Path(__file__).resolve().parents[2]
#: Qwen3-30B-A3B's config.json fields the rule reads
QWEN3_30B = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "vocab_size": 151936, "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
             "moe_intermediate_size": 768, "intermediate_size": 6144, "tie_word_embeddings": False}


def test_qwen3_30b_at_tp4_by_hand():
    rule = vllm_tp_rule(QWEN3_30B, 4)
    p = "model.layers.7."
    assert rule(p + "self_attn.q_proj.weight", (4096, 2048)) == [(0, t * 1024, 1024) for t in range(4)]
    assert rule(p + "self_attn.k_proj.weight", (512, 2048)) == [(0, t * 128, 128) for t in range(4)]  # one KV head
    assert rule(p + "self_attn.v_proj.weight", (512, 2048)) == [(0, t * 128, 128) for t in range(4)]
    assert rule(p + "self_attn.o_proj.weight", (2048, 4096)) == [(1, t * 1024, 1024) for t in range(4)]
    assert rule(p + "mlp.experts.93.gate_proj.weight", (768, 2048)) == [(0, t * 192, 192) for t in range(4)]
    assert rule(p + "mlp.experts.93.up_proj.weight", (768, 2048)) == [(0, t * 192, 192) for t in range(4)]
    assert rule(p + "mlp.experts.93.down_proj.weight", (2048, 768)) == [(1, t * 192, 192) for t in range(4)]
    # 151936 = 2374 * 64: no padding, 37984 rows a rank
    assert rule("model.embed_tokens.weight", (151936, 2048)) == [(0, t * 37984, 37984) for t in range(4)]
    assert rule("lm_head.weight", (151936, 2048)) == [(0, t * 37984, 37984) for t in range(4)]
    for whole in ("mlp.gate.weight", "input_layernorm.weight", "self_attn.q_norm.weight"):
        assert rule(p + whole, (128, 2048)) is None
    assert rule("model.norm.weight", (2048,)) is None


def test_kv_heads_replicated_past_their_count():
    """TP 8 over 4 KV heads: two ranks share each head (vLLM's num_kv_head_replicas = 2)."""
    rule = vllm_tp_rule(QWEN3_30B, 8)
    assert rule("model.layers.0.self_attn.k_proj.weight", (512, 2048)) == \
        [(0, 0, 128), (0, 0, 128), (0, 128, 128), (0, 128, 128), (0, 256, 128), (0, 256, 128), (0, 384, 128),
         (0, 384, 128)]
    assert rule("model.layers.0.self_attn.q_proj.weight", (4096, 2048)) == [(0, t * 512, 512) for t in range(8)]


def test_a_vocabulary_padded_to_64_may_leave_a_rank_none():
    """18 tokens pad to 64: rank 0 holds rows 0-31 (18 real), rank 1 rows 32-63 (none real)."""
    tiny = yaml.safe_load((REPO / "configs/models/tiny_qwen3_moe.yaml").read_text())
    rule = vllm_tp_rule(tiny, 2)
    assert rule("model.embed_tokens.weight", (18, 64)) == [(0, 0, 18), (0, 18, 0)]
    assert rule("lm_head.weight", (18, 64)) == [(0, 0, 18), (0, 18, 0)]
    big = vllm_tp_rule({**QWEN3_30B, "vocab_size": 151900}, 4)  # pads to 151936
    assert big("lm_head.weight", (151900, 2048)) == [(0, 0, 37984), (0, 37984, 37984), (0, 75968, 37984),
                                                     (0, 113952, 151900 - 113952)]


def test_what_the_rule_cannot_cut_goes_whole():
    rule = vllm_tp_rule(QWEN3_30B, 3)  # 3 divides neither 4096 nor the 4 KV heads
    assert rule("model.layers.0.self_attn.q_proj.weight", (4096, 2048)) is None
    assert rule("model.layers.0.self_attn.k_proj.weight", (512, 2048)) is None
    assert vllm_tp_rule(QWEN3_30B, 1)("model.layers.0.self_attn.q_proj.weight", (4096, 2048)) is None
    assert vllm_tp_rule(QWEN3_30B, 4)("model.layers.0.some_adapter.weight", (4096, 2048)) is None


def test_an_architecture_the_rules_were_not_checked_against_goes_whole():
    other = vllm_tp_rule({**QWEN3_30B, "architectures": ["LlamaForCausalLM"]}, 4)
    assert other("model.layers.0.self_attn.q_proj.weight", (4096, 2048)) is None
    moe = vllm_tp_rule({**QWEN3_30B, "architectures": ["Qwen3MoeForCausalLM"]}, 4)
    assert moe("model.layers.0.self_attn.q_proj.weight", (4096, 2048)) == [(0, t * 1024, 1024) for t in range(4)]


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_the_tensor_list_is_the_parameter_count(model):
    hf = yaml.safe_load((REPO / f"configs/models/{model}.yaml").read_text())
    assert sum(torch.Size(s).numel() for _, s in hf_tensor_shapes(hf)) == param_counts(hf)[0]
    assert sum(torch.Size(s).numel() for _, s in hf_tensor_shapes(QWEN3_30B)) == param_counts(QWEN3_30B)[0]


def test_an_engine_receives_the_model_about_once():
    """Qwen3-30B-A3B at TP 4: a full broadcast moves the model 4 times per engine, the cut once plus the
    replicated tensors three more times (norms and router gates: 0.04% of the model)."""
    total = param_counts(QWEN3_30B)[0]
    shapes = list(hf_tensor_shapes(QWEN3_30B))
    replicated = sum(torch.Size(s).numel() for n, s in shapes if vllm_tp_rule(QWEN3_30B, 4)(n, s) is None)
    assert sent_elements(shapes, vllm_tp_rule(QWEN3_30B, 4), 4) == total + 3 * replicated
    assert replicated / total < 5e-4
    assert sent_elements(shapes, vllm_tp_rule(QWEN3_30B, 1), 1) == total


class TwoWorkerEnginesStandIn:
    """Engines of two workers each, as the publisher's router sees them, each worker a thread running what a
    vLLM worker runs to receive (join_weight_group, receive_named_tensors) without vLLM, which cannot load a
    model twice in this process; the real engine is tests/e2e/test_vllm_engine.py's."""

    def __init__(self, engines: int, workers: int = 2) -> None:
        self.engines, self.workers = engines, workers
        self.got: dict[int, dict[str, torch.Tensor]] = {}
        self.disk: list[int] = []
        self._groups: dict[int, tuple] = {}  # rank -> (group id, group, device): kept while the group is, as vLLM's

    async def update_weights_from_broadcast(self, opener, specs, version, *, weights=None, weights_ready=None):
        info = opener([(i, 0, self.workers) for i in range(self.engines)])

        def worker(rank: int) -> None:
            if self._groups.get(rank, (None,))[0] != info["group_id"]:
                self._groups[rank] = (info["group_id"], *join_weight_group({**info, "rank": rank})[::2])
            _, group, device = self._groups[rank]
            self.got[rank] = {name: t.clone() for name, t in receive_named_tensors(group, device)}

        threads = [threading.Thread(target=worker, args=(1 + e * self.workers + t,), daemon=True)
                   for e in range(self.engines) for t in range(self.workers)]
        for th in threads:
            th.start()
        await asyncio.to_thread(lambda: [th.join(60) for th in threads])
        return {}

    async def health(self) -> dict:
        return {"engines": [{"ok": True, "n_workers": self.workers} for _ in range(self.engines)]}

    async def update_weights_from_disk(self, path, version):
        self.disk.append(version)
        return {}


def _published(tmp_path, engines, workers, workers_at_apply=None):
    from safetensors.torch import load_file

    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3_moe.yaml", tmp_path / "moe", seed=1)
    router = TwoWorkerEnginesStandIn(engines, workers)
    pub = BroadcastPublisher(CheckpointExporter(Path(ckpt)), router, tmp_path / "weights", timeout_s=30)
    pub.bucket_bytes = 32 << 10  # several buckets

    async def go():
        await pub.prepare(1)
        router.workers = workers_at_apply or workers
        out = await pub.apply(1)
        await pub.wait_written()
        return out
    try:
        out = asyncio.run(go())
    finally:
        pub.close()
    full = load_file(str(Path(ckpt) / "model.safetensors"))
    return router, out, full, json.loads((Path(ckpt) / "config.json").read_text())


def test_a_publish_cut_per_worker(tmp_path):
    """The real publisher and sender process, 2 engines of 2 workers: worker t of each engine receives its
    slices (the rest of each tensor zero), the trainer sends the model once plus what is replicated."""
    router, out, full, hf = _published(tmp_path, engines=2, workers=2)
    rule = vllm_tp_rule(hf, 2)
    assert sorted(router.got) == [1, 2, 3, 4] and not router.disk
    model_bytes = sum(t.numel() * t.element_size() for t in full.values())
    replicated = sum(t.numel() * t.element_size() for n, t in full.items() if rule(n, tuple(t.shape)) is None)
    assert out["weight_sync_bytes"] == model_bytes + replicated  # what left the trainer, once per sub-group
    for rank, tensors in router.got.items():
        t = (rank - 1) % 2
        assert tensors.keys() == full.keys()
        for name, x in tensors.items():
            slices = rule(name, tuple(full[name].shape))
            if slices is None:
                assert torch.equal(x, full[name]), name
                continue
            dim, start, n = slices[t]
            assert torch.equal(x.narrow(dim, start, n), full[name].narrow(dim, start, n)), name
            rest = x.clone()
            rest.narrow(dim, start, n).zero_()
            assert not rest.any(), f"{name}: worker {t} received more than its slice"
    assert any(rule(n, tuple(x.shape)) is not None for n, x in full.items())  # something was cut


def test_engines_of_one_worker_get_the_whole_tensors(tmp_path):
    router, out, full, _ = _published(tmp_path, engines=2, workers=1)
    assert sorted(router.got) == [1, 2] and not router.disk
    assert out["weight_sync_bytes"] == sum(t.numel() * t.element_size() for t in full.values())
    assert all(torch.equal(router.got[r][n], full[n]) for r in (1, 2) for n in full)


def test_engines_whose_worker_count_changed_get_the_disk_copy(tmp_path):
    """Cut for 2 workers, the engines have 1 at apply (restarted otherwise): the disk copy instead."""
    router, out, _, _ = _published(tmp_path, engines=2, workers=2, workers_at_apply=1)
    assert router.disk == [1] and not router.got
    assert out["weight_sync_fallbacks"] == 1 and out["weight_sync_bytes"] == 0
