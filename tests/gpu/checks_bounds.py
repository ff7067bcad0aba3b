"""GPU checks of what the plan and the bounds promise: the pinned bytes of kept host copies, and the deadline of
an engine's first NCCL call (tests/gpu/gpu_check.py: pinned_bytes, nccl_init_deadline)."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from check_helpers import CheckFailed, require, require_cuda

#: a Qwen3-shaped model with a real model's proportions (22.7M parameters, 27 tensors), as the unit test's
PINNED_HF = {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 64, "vocab_size": 16000, "intermediate_size": 1536, "max_position_embeddings": 4096,
             "tie_word_embeddings": False}
#: pinned_bytes: held bytes within this share of the plan
PINNED_TOLERANCE = 0.01
#: nccl_init_deadline: the receiver's step deadline, s, and what leaving may take beyond it
INIT_DEADLINE_S = 5.0
INIT_SLACK_S = 3.0


def pinned_tensors(device) -> dict:
    """PINNED_HF's tensors by Hugging Face name, bf16 on ``device`` (what the plan counts for one rank)."""
    import torch

    h, hd, ffn, v = (PINNED_HF[k] for k in ("hidden_size", "head_dim", "intermediate_size", "vocab_size"))
    q, kv = PINNED_HF["num_attention_heads"] * hd, PINNED_HF["num_key_value_heads"] * hd
    shapes = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,)}
    for i in range(PINNED_HF["num_hidden_layers"]):
        for name, shape in {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                            "q_norm": (hd,), "k_norm": (hd,), "input_layernorm": (h,),
                            "post_attention_layernorm": (h,), "gate_proj": (ffn, h), "up_proj": (ffn, h),
                            "down_proj": (h, ffn)}.items():
            shapes[f"layers.{i}.{name}.weight"] = shape
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen).to(torch.bfloat16).to(device) for n, s in shapes.items()}


def pinned_plan(strategy: str = "snapshot", eta: int = 1) -> float:
    """host_memory.pinned_bytes of PINNED_HF on one trainer rank."""
    from megarl.config import MegaRLConfig
    from megarl.launch import host_memory

    cfg = MegaRLConfig()
    cfg.model.dtype, cfg.recovery.name, cfg.rollout.eta, cfg.placement.device = "bfloat16", strategy, eta, "gpu"
    trainer = SimpleNamespace(hosts=("n0",), ranks_per_node=1, world_size=1, tp=1, pp=1, ep=1, dp=1, expert_dp=1,
                              sequence_parallel=False)
    plan = SimpleNamespace(device="gpu", trainer=trainer, engines=[SimpleNamespace(tp=1)], dedicated=None)
    return host_memory.pinned_bytes(cfg, PINNED_HF, plan)


def check_pinned_bytes(workdir: Path) -> str:
    """snapshot at eta 1 keeps two copies: the pool's two flat buffers hold the plan's pinned bytes to within 1%,
    are page-locked (is_pinned), and torch's caching host allocator took nothing (the per-parameter pinning
    this replaced rounded every parameter up to a power of two there)."""
    require_cuda()
    import torch

    from megarl.trainer.host_copies import HostCopyPool

    cuda = torch.cuda.is_available()
    tensors = pinned_tensors(torch.device("cuda") if cuda else torch.device("cpu"))
    stats = (lambda: torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)) if cuda else (lambda: 0)
    before = stats()
    pool = HostCopyPool()
    copies = [pool.copy(tensors.items()) for _ in range(2)]
    pool.ready()
    cached = stats() - before
    planned = pinned_plan()
    for copy in copies:
        require(all(torch.equal(copy[n].to(t.device), t) for n, t in tensors.items()), "a copy differs from its source")
        require(len({t.untyped_storage().data_ptr() for t in copy.values()}) == 1, "a copy is not one flat buffer")
    pinned = all(t.is_pinned() for copy in copies for t in copy.values()) if cuda else False
    detail = (f"held {pool.held_bytes:,} B vs plan {planned:,.0f} B (x{pool.held_bytes / planned:.4f}); caching host "
              f"allocator grew {cached:,} B; " + ("page-locked" if cuda else "CPU: not pinned, the bytes only"))
    require(abs(pool.held_bytes - planned) <= PINNED_TOLERANCE * planned, f"held bytes off the plan: {detail}")
    if cuda:
        require(pinned, f"a kept copy is not page-locked: {detail}")
        require(cached == 0, f"the copies went through torch's caching host allocator (power-of-two rounding): "
                             f"{detail}")
    del copies
    return detail


def check_nccl_init_deadline(workdir: Path) -> str:
    """An engine's receiver whose trainer side never sets the communicator up: NCCL creates it inside the first
    collective call, which waits for every rank; the receive must leave at its step deadline all the same
    (megarl/rollout/receiver_group.py), with the update's lock free. One GPU is enough: only the receiver
    touches NCCL. On CPU (GPU_CHECK_ALLOW_CPU=1) the same receive over gloo, whose group is set up when it
    is made: the deadline, not the init."""
    require_cuda()
    import asyncio

    import torch

    from megarl.rollout.client import free_port
    from megarl.rollout.receiver_group import POLL_S, BroadcastLeft
    from megarl.rollout.weight_sync import WeightBroadcaster, join_weight_group, receive_named_tensors

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    sender = WeightBroadcaster("127.0.0.1", free_port(), world_size=2, backend=backend, timeout_s=INIT_DEADLINE_S)
    th = threading.Thread(target=sender.connect, daemon=True)
    th.start()
    group, _store, device = join_weight_group(sender.group_info(rank=1))
    th.join(timeout=30)
    outcome: dict = {}

    async def update(lock: asyncio.Lock) -> None:
        async with lock:  # as an engine holds its own over a weight update
            try:
                list(receive_named_tensors(group, device))
                outcome["error"] = None
            except Exception as e:  # noqa: BLE001 - BroadcastLeft, or the init's own error if it gave up first
                outcome["error"] = e

    async def run() -> bool:
        lock = asyncio.Lock()
        await update(lock)
        return lock.locked()

    t0 = time.monotonic()
    try:
        locked = asyncio.run(run())
    finally:
        took = time.monotonic() - t0
        sender.close()
    detail = (f"{backend}: the receive ended after {took:.1f} s (deadline {INIT_DEADLINE_S:g} s); "
              f"{type(outcome.get('error')).__name__}: {outcome.get('error')}")
    if outcome.get("error") is None:
        raise CheckFailed(f"the receive completed with no sender: {detail}")
    require(not locked, f"the update lock is still held: {detail}")
    require(isinstance(outcome["error"], BroadcastLeft) or backend == "nccl",
            f"the gloo receive did not leave at its deadline: {detail}")
    require(took <= INIT_DEADLINE_S + POLL_S + INIT_SLACK_S, f"left too late: {detail}")
    if backend == "nccl":
        require(not group.started, f"the first call returned: was the communicator set up without the sender? {detail}")
    return detail
