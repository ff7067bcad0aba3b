"""The trainer step time under the round-robin deal and under the packing plan, in one torchrun launch.

Launched by ``megarl bench --packing`` (megarl/bench/packing.py) on 2 CPU ranks (gloo, dp 2): both
ranks build the tiny Qwen3 with room for 2k positions, make the same batch of long-tailed rows
(the reasoning shape of megarl/bench/packing.py scaled down by 8) and run train_step alternately
with each plan, so drift of the machine hits both alike. Rank 0 prints one JSON line. The "before"
plan is put in the trainer's place for its steps (``_planner``); it is the old dealing, kept as
``round_robin_plan`` for this comparison.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

MODEL = "tiny_qwen3 (hidden 64, 2 layers) with max_position_embeddings 2048"
ROWS, BUDGET, SCALE = 32, 4096, 1 / 8


def make_batch(seed: int = 0):
    """Rows of random tokens with long-tailed lengths, as the loop builds them from trajectories."""
    from megarl.bench.packing import long_tail
    from megarl.types import TrainBatch, Trajectory

    rng = random.Random(seed)
    trajs = []
    for i in range(ROWS):
        n = min(2048, long_tail(rng, SCALE))
        prompt = max(1, min(n - 1, int(200 * SCALE)))
        ids = [rng.randrange(1, 16) for _ in range(n)]
        trajs.append(Trajectory(traj_id=str(i), group_id=str(i), prompt_ids=ids[:prompt], response_ids=ids[prompt:],
                                logp_behav=[0.0] * (n - prompt), versions=[0] * (n - prompt),
                                loss_mask=[1] * (n - prompt), advantage=1.0))
    return TrainBatch.from_trajectories(trajs, version=0)


def nll(logp, mb, normalizer):
    return -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"], {}


@contextlib.contextmanager
def _planner(old: bool):
    """The trainer's micro-batches from the round-robin deal while ``old`` (module doc)."""
    import megarl.trainer.megatron_trainer as mt
    from megarl.trainer.microbatch import microbatches_of
    from megarl.trainer.packing import round_robin_plan

    current = mt.plan_microbatches

    def round_robin(batch, dp_rank, dp, budget, device=None, **_):
        return microbatches_of(batch, round_robin_plan([int(n) for n in batch.seq_lens], dp, budget).ranks[dp_rank],
                               device)

    mt.plan_microbatches = round_robin if old else current
    try:
        yield
    finally:
        mt.plan_microbatches = current


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import torch.distributed as dist
    import yaml

    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.trainer.megatron_trainer import MegatronTrainer

    root = Path(tempfile.mkdtemp(prefix="megarl-packing-"))
    fields = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs/models/tiny_qwen3.yaml").read_text())
    fields["max_position_embeddings"] = 2048
    (root / "model.yaml").write_text(yaml.safe_dump(fields))
    ckpt = write_tiny_checkpoint(root / "model.yaml", root / "ckpt", seed=0)  # the same weights on both ranks
    trainer = MegatronTrainer(str(ckpt), lr=1e-6, micro_batch_tokens=BUDGET, seed=0)
    batch = make_batch()
    times: dict[str, list[float]] = {"before": [], "after": []}
    for i in range(args.steps + 1):
        for tag in ("before", "after"):
            with _planner(old=tag == "before"):
                dist.barrier()
                t0 = time.perf_counter()
                trainer.train_step(batch, nll)
                dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            if i:  # the first round warms up
                times[tag].append(float(dt))
    if dist.get_rank() == 0:
        before, after = statistics.median(times["before"]), statistics.median(times["after"])
        lens = [int(n) for n in batch.seq_lens]
        print(json.dumps({"model": MODEL, "rows": len(lens), "lengths": f"{min(lens)}-{max(lens)}",
                          "budget": BUDGET, "steps": args.steps, "before_s": before, "after_s": after,
                          "ratio": before / after, "times": times}))
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
