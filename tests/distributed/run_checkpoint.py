"""Trainer state round trip on 2 ranks (launched by test_checkpoint_multirank.py under torchrun).

Per mode: train 2 steps, ``save_state``, train a 3rd step; a second trainer
``load_state``s and trains the same 3rd step. Each rank writes the largest
parameter difference between the two (0 = bitwise) to ``OUT/<mode>.rank<r>.json``.
The bf16 modes also run bf16 tensors through gloo's collectives (TP, the
distributed optimizer's parameter all-gather, pipeline sends).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

# mode -> (tp, pp, use_distributed_optimizer, dtype)
MODES = {"dp2_distopt": (1, 1, True, "float32"), "tp2": (2, 1, False, "float32"),
         "dp2_distopt_bf16": (1, 1, True, "bfloat16"), "tp2_bf16": (2, 1, False, "bfloat16"),
         "pp2_bf16": (1, 2, False, "bfloat16")}


def main(argv=None) -> int:
    import torch.distributed as dist
    from recovery_scorer import make_traj

    from megarl.trainer.megatron_trainer import MegatronTrainer
    from megarl.types import TrainBatch

    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    batch = TrainBatch.from_trajectories([make_traj(f"s{i}", [1, 4, 5], [("policy", 6, 0)], seed=11 + i)
                                          for i in range(4)], version=0)

    def loss_fn(logp, mb, normalizer):
        return -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"], {}

    for mode, (tp, pp, dist_opt, dtype) in MODES.items():
        def build(tp=tp, pp=pp, dist_opt=dist_opt, dtype=dtype):
            return MegatronTrainer(args.checkpoint, tp=tp, pp=pp, lr=1e-2, micro_batch_tokens=64, seed=0,
                                   use_distributed_optimizer=dist_opt, dtype=dtype)

        a = build()
        a.train_step(batch, loss_fn)
        a.train_step(batch, loss_fn)
        a.save_state(str(out / mode))
        a.train_step(batch, loss_fn)
        want = a.get_params()
        b = build()
        b.load_state(str(out / mode))
        b.train_step(batch, loss_fn)
        got = b.get_params()
        diff = max(float((want[k] - got[k]).abs().max()) for k in want)
        (out / f"{mode}.rank{dist.get_rank()}.json").write_text(json.dumps({"version": b.version, "max_diff": diff}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
