"""The loop's checkpoints under a real write fault (launched by test_save_faults.py).

``python save_fault_run.py CKPT RUN_DIR MODE``: the controller over tests/unit/loop_fixtures.py's simulated engine,
with the real Checkpointer writing a real MegatronTrainer's state through torch's distributed checkpoint, a
checkpoint every step (``logging.save_every=1``), ``logging.max_save_failures=3``. The fault is the kernel's: the
process's file-size limit (RLIMIT_FSIZE) is lowered to 4 KiB while the trainer's state of the saves numbered in
``FAIL`` (0-based) is written, so torch's writer gets EFBIG and raises its CheckpointException; the limit is
put back after. Modes (``-async``: ``logging.async_save=true``):

* ``recover[-async]``: saves 1 and 2 (steps 2, 3) fail; the run trains its 6 steps;
* ``limit[-async]``: every save from the second on fails: the third in a row stops the run;
* ``stop``: save 1 (step 2) and the stop's checkpoint fail: the stop names step_1, which stands;
* ``stop-none``: no periodic checkpoint, the stop's fails: nothing stands;
* ``stop-hang``: the stop's wait for the engines' disk copy never ends (a thread that sleeps):
  the stop still ends within ``logging.stop_grace_s``;
* ``full``: no file-size limit; the test mounted RUN_DIR as a tmpfs that two checkpoints fill, so every save
  from the third on gets ENOSPC from the filesystem itself;
* ``readonly``: no file-size limit; the test made RUN_DIR/checkpoints a read-only mount after the first
  checkpoint, so every later save gets EROFS.

Prints one JSON line (``RESULT {...}``: the exit code the CLI would return, the error, the steps reached) and
exits with that code. Only the moment of the fault is the test's; the fault, the trainer, the writer, the
Checkpointer and the loop are the product's.
"""
from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from async_save_run import Copies
from loop_fixtures import make_controller

from megarl.checkpoint.rank_state import SingleRankStates
from megarl.checkpoint.run_checkpoint import Checkpointer
from megarl.errors import MegarlError
from megarl.stop_protocol import stop_budget
from megarl.trainer.megatron_trainer import MegatronTrainer

FAIL = {"recover": {1, 2}, "limit": set(range(1, 100)), "stop": {1, 2}, "stop-none": {0}, "stop-hang": set(),
        "full": set(), "readonly": set()}
STEPS = 6
STOP_AT = 3  # the step whose boundary stops the run in the stop modes


@contextmanager
def file_size_limit(limit: int | None):
    """RLIMIT_FSIZE's soft limit lowered to ``limit`` bytes inside (None: as it is)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


class LimitedDisk(SingleRankStates):
    """The real trainer's part of every checkpoint; those numbered in ``fail`` written under a 4 KiB file limit."""

    def __init__(self, trainer, fail: set[int]) -> None:
        super().__init__(trainer)
        self.fail, self.n = fail, 0

    def _limit(self):
        n, self.n = self.n, self.n + 1
        return file_size_limit(4096 if n in self.fail else None)

    def save_rank_states(self, step_dir, strategy_state):
        with self._limit():
            super().save_rank_states(step_dir, strategy_state)

    def prepare_rank_states(self, step_dir, strategy_state):
        write, limit = super().prepare_rank_states(step_dir, strategy_state), self._limit()

        def limited(group):  # on the writer thread
            with limit:
                write(group)

        return limited


def main(ckpt: str, run_dir: str, mode: str) -> int:
    run = Path(run_dir)
    kind = mode.removesuffix("-async")
    grace = 4 if kind == "stop-hang" else 30
    overrides = ["logging.save_every=1", "logging.max_save_failures=3", f"logging.stop_grace_s={grace}",
                 f"logging.async_save={'true' if mode.endswith('-async') else 'false'}"]
    if kind == "stop-none":
        overrides[0] = "logging.save_every=0"
    real = MegatronTrainer(ckpt, lr=1e-2, micro_batch_tokens=64)
    weights = run / "weights"
    for v in range(1, 40):  # what the publisher would have written for each version
        (weights / f"v{v}").mkdir(parents=True, exist_ok=True)
        (weights / f"v{v}" / "config.json").write_text("{}")
    ck = Checkpointer(run, real, Copies(real), weights, keep_last=0, rank_states=LimitedDisk(real, FAIL[kind]))
    c, trainer, _, _ = make_controller(0, checkpointer=ck, overrides=overrides)
    stop_budget.configure(c.cfg.logging.stop_grace_s)
    if kind == "stop-hang":
        async def never_written():  # once stopping, a publish whose disk copy never completes
            if c.stop_requested:
                await asyncio.to_thread(time.sleep, 3600)

        c.publisher.wait_written = never_written

    async def go():
        if kind.startswith("stop"):
            loop, inner = asyncio.get_running_loop(), trainer.train_step

            def train_step(batch, loss_fn):
                if trainer.version == STOP_AT - 1:
                    loop.call_soon_threadsafe(c.request_stop, "SIGTERM")
                return inner(batch, loss_fn)

            trainer.train_step = train_step
        await c.train(STEPS)

    t0 = time.monotonic()
    try:
        asyncio.run(go())
        code, error = 0, ""
    except MegarlError as e:  # what `megarl train` returns (megarl/cli.py)
        code, error = getattr(e, "exit_code", 2), f"{type(e).__name__}: {e}"
    print("RESULT " + json.dumps({"code": code, "error": error, "step": c.step, "seconds": time.monotonic() - t0}),
          flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
