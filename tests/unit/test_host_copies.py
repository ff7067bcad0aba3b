"""Kept host copies (megarl/trainer/host_copies.py): one flat buffer per copy, the bytes the host memory plan
counts as pinned (megarl/launch/host_memory.py ``pinned_bytes``) to within 1%.

Pinned memory needs a CUDA runtime; on CPU the pool allocates through the same function, ``host_buffer``,
without the registration: the bytes are the same. Per-parameter pinning through torch's caching host allocator
rounded each allocation up to a power of two; the test shows that this model's copy would then miss the plan.
"""
import gc
from types import SimpleNamespace

import pytest
import torch

from megarl.config import MegaRLConfig
from megarl.launch import host_memory
from megarl.trainer.host_copies import ALIGN, HostCopyPool, copy_bytes

#: a Qwen3-shaped model with a real model's proportions (22.7M parameters, 27 tensors): alignment is noise
HF = {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
      "head_dim": 64, "vocab_size": 16000, "intermediate_size": 1536, "max_position_embeddings": 4096,
      "tie_word_embeddings": False}


def model_tensors():
    """The tensors of HF's model, by Hugging Face name, bf16 (the plan counts the same parameters)."""
    h, hd, ffn, v = HF["hidden_size"], HF["head_dim"], HF["intermediate_size"], HF["vocab_size"]
    q, kv = HF["num_attention_heads"] * hd, HF["num_key_value_heads"] * hd
    shapes = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,)}
    for i in range(HF["num_hidden_layers"]):
        shapes |= {f"layers.{i}.{k}": s for k, s in {
            "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
            "q_norm.weight": (hd,), "k_norm.weight": (hd,), "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,), "gate_proj.weight": (ffn, h), "up_proj.weight": (ffn, h),
            "down_proj.weight": (h, ffn)}.items()}
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}


def plan_of(strategy, eta=1, storage="cpu"):
    cfg = MegaRLConfig()
    cfg.model.dtype = "bfloat16"
    cfg.recovery.name, cfg.rollout.eta = strategy, eta
    cfg.placement.device = "gpu"
    if strategy == "snapshot":
        cfg.recovery.options["snapshot"] = {"storage": storage}
    trainer = SimpleNamespace(hosts=("n0",), ranks_per_node=1, world_size=1, tp=1, pp=1, ep=1, dp=1, expert_dp=1,
                              sequence_parallel=False)
    plan = SimpleNamespace(device="gpu", trainer=trainer, engines=[SimpleNamespace(tp=1)], dedicated=None)
    return cfg, plan


@pytest.mark.parametrize("strategy,storage,copies", [("interrupt_sync", "cpu", 1), ("snapshot", "cpu", 2),
                                                     ("snapshot", "disk", 1)])
def test_the_kept_copies_are_one_flat_buffer_each_within_one_percent_of_the_plan(strategy, storage, copies):
    tensors = model_tensors()
    cfg, plan = plan_of(strategy, eta=1, storage=storage)
    planned = host_memory.pinned_bytes(cfg, HF, plan)
    pool = HostCopyPool()
    kept = [pool.copy(tensors.items()) for _ in range(copies)]  # eta 1: snapshot keeps two versions
    for copy in kept:
        assert len({t.untyped_storage().data_ptr() for t in copy.values()}) == 1  # one buffer per copy
        assert all(torch.equal(copy[n], t) and copy[n].dtype == t.dtype for n, t in tensors.items())
    own = sum(t.numel() * t.element_size() for t in tensors.values())
    assert pool.held_bytes == copies * copy_bytes(t.numel() * t.element_size() for t in tensors.values())
    assert own * copies <= pool.held_bytes <= own * copies + copies * ALIGN * len(tensors)
    print(f"{strategy} ({storage}): held {pool.held_bytes:,} B, planned {planned:,.0f} B")
    assert abs(pool.held_bytes - planned) <= 0.01 * planned
    # pinned one parameter at a time, every allocation rounded up to a power of two: far from the plan
    rounded = copies * sum(1 << (t.numel() * t.element_size() - 1).bit_length() for t in tensors.values())
    assert rounded > 1.05 * planned  # 8.7% over with these shapes
    assert host_memory.host_memory(cfg, HF, plan).pinned == planned


def test_a_released_copy_is_reused_and_a_dropped_one_freed():
    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16),
               "c": torch.zeros(0, dtype=torch.int64)}
    pool = HostCopyPool()
    first = pool.copy(tensors.items())
    ptr, held = first["a"].data_ptr(), pool.held_bytes
    assert held == copy_bytes([4000, 30, 0]) == 4096 + 512
    pool.release(first)
    del first
    second = pool.copy((n, t + 1) for n, t in tensors.items())
    assert second["a"].data_ptr() == ptr and pool.allocated == 1 and pool.held_bytes == held
    assert torch.equal(second["b"], tensors["b"] + 1)
    pool.release({"x": torch.ones(4)})  # not the pool's: left alone
    assert pool.allocated == 1 and not any(pool._free.values())
    other = pool.copy(tensors.items())  # while second is held: a buffer of its own
    assert pool.allocated == 2 and pool.held_bytes == 2 * held
    del second, other
    gc.collect()
    assert pool.held_bytes == 0  # freed with the last view of each buffer


def test_the_plan_prints_the_pinned_bytes_per_node():
    cfg, plan = plan_of("snapshot", eta=1)
    text = host_memory.host_memory(cfg, HF, plan).describe()
    pinned = host_memory.pinned_bytes(cfg, HF, plan)
    assert f"pinned (page-locked) of it, per trainer node: {pinned / 1e9:.1f} GB" in text
    assert host_memory.as_dict(host_memory.host_memory(cfg, HF, plan))["pinned_bytes"] == pinned
    cfg, plan = plan_of("recompute")
    assert host_memory.pinned_bytes(cfg, HF, plan) == 0
    assert "pinned (page-locked) of it, per trainer node: 0.0 GB (recompute keeps no pinned copies)" in (
        host_memory.host_memory(cfg, HF, plan).describe())
