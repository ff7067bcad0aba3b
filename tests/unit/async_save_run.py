"""A real trainer and Checkpointer taking background checkpoints (launched by test_async_checkpoint.py).

``python async_save_run.py CKPT RUN_DIR MODE``: train 1 step and checkpoint it at once (step 1); train a step and
checkpoint it in the background (step 2) with its write held at a gate; ``kill``: write ``RUN_DIR/writing`` once
the write thread is at the gate, then wait there to be SIGKILLed; ``finish``: train step 3 while the write waits,
open the gate, wait for the write and dump the weights of steps 2 and 3 to ``RUN_DIR/weights.pt``. The gate is
the only thing not the product's: ShardedWrite.run waits for it before writing.
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import torch
from recovery_scorer import make_traj

from megarl.checkpoint.run_checkpoint import Checkpointer
from megarl.trainer.megatron_trainer import MegatronTrainer
from megarl.trainer.sharded_write import ShardedWrite
from megarl.types import TrainBatch


class Loop:
    """What a Checkpointer reads of the controller."""

    def __init__(self, trainer) -> None:
        self.trainer, self.step, self.version = trainer, 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "buffer": {"accepted_total": 0}}


class Copies:
    """A strategy holding a copy of the weights (snapshot's kind of state)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"versions": {self.trainer.version: self.trainer.get_params()}}


def main(ckpt: str, run_dir: str, mode: str) -> int:
    run = Path(run_dir)
    gate = threading.Event()
    run_write = ShardedWrite.run

    def gated(self, group=None):
        (run / "writing").write_text("at the gate")
        gate.wait()
        return run_write(self, group)

    trainer = MegatronTrainer(ckpt, lr=1e-2, micro_batch_tokens=64)
    batch = TrainBatch.from_trajectories([make_traj("s0", [1, 4, 5], [("policy", 6, 0)], seed=11),
                                          make_traj("s1", [1, 6], [("policy", 5, 0)], seed=12)], version=0)

    def step(loop) -> None:
        trainer.train_step(batch, lambda logp, mb, norm: (-(logp * mb.loss_mask).sum() / norm["n_valid_tokens"], {}))
        loop.step += 1

    async def go() -> None:
        loop = Loop(trainer)
        ck = Checkpointer(run, trainer, Copies(trainer), run / "weights", keep_last=0)
        step(loop)
        await ck.save(loop)
        step(loop)
        w2 = trainer.get_params()
        ShardedWrite.run = gated
        t0 = time.perf_counter()
        assert await ck.save(loop, background=True) is None
        print(f"background save returned in {time.perf_counter() - t0:.2f} s", flush=True)
        if mode == "kill":
            while True:
                time.sleep(1)
        step(loop)  # the loop goes on while the write waits
        assert not (run / "checkpoints" / "step_2").exists(), "step_2 appeared before its write"
        gate.set()
        path = await ck.wait()
        torch.save({"w2": w2, "w3": trainer.get_params(), "path": str(path)}, run / "weights.pt")

    asyncio.run(go())
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
