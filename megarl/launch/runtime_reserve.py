"""What a trainer GPU holds beside the model, its optimizer and its activations: the runtime reserve.

- the process's CUDA context (:data:`CUDA_CONTEXT`) and the caching allocator's fragmentation
  (:data:`ALLOCATOR_SLACK`);
- NCCL's communicators: NCCL allocates its buffers per communicator on its first collective, ~1.6 GB for one on
  a multi-node job and up to ~6 GB for several in one process (measured by NCCL's users, NVIDIA/nccl issue 864):
  :data:`NCCL_COMM` each, at most :data:`NCCL_CAP` per process. A trainer rank has one per parallel group of
  more than one rank it communicates in (the world, DP, TP, PP, EP, expert DP);
- on trainer rank 0 only, the weight sender (megarl/rollout/broadcast_sender.py), a process of its own on the
  same GPU: its CUDA context, its broadcast communicators (the group, and one sub-group per engine worker when
  the export is cut per worker: ``rollout.shard_weight_sync``) and its buffers: the staging buffer device
  buckets are copied into and one host bucket copied to the GPU as it is sent, one ``rollout.bucket_mb`` each.

The plan counts rank 0's reserve for every trainer GPU: a layout fits when its fullest GPU does.
"""
from __future__ import annotations

#: a CUDA context with torch's kernels and cuBLAS workspaces loaded, bytes
CUDA_CONTEXT = 0.6e9
#: the caching allocator's fragmentation at peak, bytes (assumed)
ALLOCATOR_SLACK = 1.4e9
#: bytes of one NCCL communicator (NVIDIA/nccl issue 864: ~1.6 GB)
NCCL_COMM = 1.6e9
#: NCCL bytes of all of one process's communicators (the same issue: up to ~6 GB for several)
NCCL_CAP = 6e9


def nccl_bytes(communicators: int) -> float:
    return min(communicators * NCCL_COMM, NCCL_CAP)


def trainer_communicators(t) -> int:
    """NCCL communicators of one trainer rank: one per group of more than one rank (module doc)."""
    sizes = [t.world_size, t.dp, t.tp, t.pp]
    if t.ep > 1:
        sizes += [t.ep, t.expert_dp]
    return sum(1 for s in sizes if s > 1)


def sender_communicators(cfg, plan) -> int:
    """The weight sender's NCCL communicators: the group and, cut per engine worker, one sub-group per worker."""
    if cfg.rollout.weight_sync != "broadcast":
        return 0
    cut = max((s.tp for s in plan.engines), default=1) if cfg.rollout.shard_weight_sync else 1
    return 1 + (cut if cut > 1 else 0)


def runtime_parts(cfg, plan) -> dict[str, float]:
    """Trainer rank 0's runtime reserve by part (module doc), bytes."""
    parts = {"CUDA context and allocator slack": CUDA_CONTEXT + ALLOCATOR_SLACK,
             "NCCL": nccl_bytes(trainer_communicators(plan.trainer))}
    if cfg.rollout.weight_sync == "broadcast":
        bucket = max(int(cfg.rollout.bucket_mb), 1) << 20
        parts["weight sender"] = CUDA_CONTEXT + nccl_bytes(sender_communicators(cfg, plan)) + 2 * bucket
    return parts


def describe(parts: dict[str, float]) -> str:
    return "runtime " + " + ".join(f"{k} {v / 1e9:.1f}" for k, v in parts.items())
