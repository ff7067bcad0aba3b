"""What a reshardable save holds on each rank beside the trainer's own state (launched by test_save_memory.py).

Under ``torchrun --nproc_per_node=2`` (gloo, CPU) each rank builds the tiny dense model at DP2 with the
distributed optimizer (its Adam state allocated), prepares the save state of megarl/trainer/dist_state.py
and measures the bytes of the optimizer state that state holds (unique storages, the sharded tensors'
data) per model parameter of the rank. At rest a rank's distributed optimizer holds 12 B per parameter of the
fp32 model over DP2: 6. Then it saves to ``OUT/ckpt``. It writes ``OUT/rank{r}.json``: ``{"bytes_per_param",
"dp_rank", "at_rest", "written"}`` (``written``: the byte size of each ``__{r}_*.distcp`` file this rank wrote).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def state_bytes(tree) -> int:
    """Bytes of the unique storages of the tensors (and megatron ShardedTensors' data) in ``tree``."""
    seen, total, stack = set(), 0, [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif torch.is_tensor(x):
            key = x.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif hasattr(x, "data") and torch.is_tensor(getattr(x, "data", None)):
            stack.append(x.data)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from megarl.trainer import dist_state
    from megarl.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(args.checkpoint, lr=1e-2, micro_batch_tokens=40, seed=0, use_distributed_optimizer=True)
    trainer._ensure_optimizer()
    dist_state._allocate_adam_state(trainer)
    n = sum(p.numel() for chunk in trainer.model for p in chunk.parameters())
    at_rest = sum(t.numel() * t.element_size() for o in trainer._optimizers() for st in o.optimizer.state.values()
                  for t in st.values() if torch.is_tensor(t) and t.dim()) + sum(
        p.numel() * 4 for o in trainer._optimizers() for g in o.optimizer.param_groups for p in g["params"])
    state = dist_state._sharded_state(trainer, is_loading=False)
    rank = torch.distributed.get_rank()
    out = {"bytes_per_param": state_bytes(state["optimizer"].get("param_state")) / n, "at_rest": at_rest / n,
           "dp_rank": rank}
    del state
    dist_state.save_reshardable(trainer, str(Path(args.out) / "ckpt"))
    out["written"] = [f.stat().st_size for f in sorted((Path(args.out) / "ckpt").glob(f"__{rank}_*.distcp"))]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
