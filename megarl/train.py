"""Train: check the inputs, build the run, run the loop, save the policy. The entry point of `megarl train`.

``python -m megarl.train --config X [key=value ...]`` is the same as ``megarl train``
(the launchers in launch/ use it; a launched server role is dispatched by the CLI,
megarl/commands/train.py). Trainer rank 0 checks everything (megarl/preflight.py),
builds the run (megarl/builder.py) and drives the loop; the other trainer ranks
replay its trainer and strategy calls (megarl/trainer/spmd.py).
``train(cfg, resume=RUN_DIR)`` continues a run from its newest valid checkpoint
(megarl/resume.py): engines restart from the checkpoint's weights at its version,
the trainer, strategy, replay buffer, dataset and RNG continue, and the run's logs
are rewound to the checkpoint before new lines are appended. SIGTERM or SIGINT
checkpoints the step reached and exits with code 75 (megarl/run_stop.py).
"""
from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from megarl.builder import StrategyWrapper, build_run, run_follower
from megarl.cli import main as cli_main
from megarl.config import MegaRLConfig
from megarl.cpu_affinity import pin_process
from megarl.errors import MegarlError
from megarl.preflight import RunSetup, preflight
from megarl.resume import ResumePoint, prepare_resume
from megarl.rollout.engine_pool import PooledEngines
from megarl.run_stop import stop_on_signals
from megarl.trainer.parallel import init_ranks
from megarl.trainer.spmd import receive_go, share_go


def train(cfg: MegaRLConfig, wrap_strategy: StrategyWrapper | None = None,
          resume: str | Path | None = None, engine_pool: PooledEngines | None = None) -> Path:
    """Run the loop; ``wrap_strategy(strategy) -> strategy`` may wrap the recovery strategy (verification).

    ``engine_pool``: engines kept running between the runs of one command (megarl/rollout/engine_pool.py);
    this run resets them to the base checkpoint and leaves them running. None: the run starts its own.

    ``resume`` (default ``logging.resume``): a run directory to continue from its
    newest valid checkpoint (the run keeps writing there; ``logging.output_dir`` is ignored).
    Every input is checked before the run directory is made (or, resuming,
    before anything in it changes), so bad input leaves nothing half-written behind.
    """
    rank, world = init_ranks()
    if rank != 0:  # a follower: waits for rank 0's checks, then replays its trainer and strategy calls
        # rank 0 stops the run on SIGTERM/SIGINT and needs this rank for its checkpoint: it tells it when to exit
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        run_dir = Path(receive_go())
        _pin_trainer(cfg)
        run_follower(cfg, run_dir)
        return run_dir
    try:
        setup = preflight(cfg, resume or cfg.logging.resume or None, world)
    except MegarlError as e:
        share_go(world, error=f"{type(e).__name__}: {e}")
        raise
    share_go(world, run_dir=str(setup.run_dir))
    _pin_trainer(cfg)  # checked by the preflight; every process and thread the run starts from here inherits it
    point = prepare_resume(setup.run_dir, setup.resume_from) if setup.resume_from is not None else None
    summary = asyncio.run(_train(cfg, setup, point, wrap_strategy, engine_pool))
    (setup.run_dir / "summary.json").write_text(json.dumps(summary) + "\n")
    return setup.run_dir


async def _train(cfg: MegaRLConfig, setup: RunSetup, resume: ResumePoint | None,
                 wrap_strategy: StrategyWrapper | None, engine_pool: PooledEngines | None = None) -> dict:
    async with await build_run(cfg, setup, resume, wrap_strategy, engine_pool) as run:
        if resume is not None:
            run.restore(resume)
        with stop_on_signals(run.controller):  # checkpoint, then exit with code 75 (megarl/run_stop.py)
            await run.controller.train(cfg.trainer.total_steps)
        run.save_final()
    return {"steps": run.controller.step, "version": run.trainer.version}


def _pin_trainer(cfg: MegaRLConfig) -> None:
    if cfg.placement.cpu_affinity.trainer:
        pin_process(cfg.placement.cpu_affinity.trainer)


def main(argv: list[str] | None = None) -> int:
    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
