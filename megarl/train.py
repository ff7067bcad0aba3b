"""Train: check the inputs, build the run, run the loop, save the policy. The entry point of `megarl train`.

``python -m megarl.train --config X [key=value ...]`` is the same as ``megarl train``
(the launchers in launch/ use it; a launched server role is dispatched by the CLI,
megarl/commands/train.py). Trainer rank 0 checks everything (megarl/preflight.py),
builds the run (megarl/builder.py) and drives the loop; the other trainer ranks
replay its trainer and strategy calls (megarl/loop/spmd.py).
``train(cfg, resume=RUN_DIR)`` continues a run from its newest valid checkpoint
(megarl/checkpoint/resume.py): engines restart from the checkpoint's weights at its version,
the trainer, strategy, replay buffer, dataset and RNG continue, and the run's logs
are rewound to the checkpoint before new lines are appended.
A trainer rank that waits ``trainer.collective_timeout_s`` in a collective for
another (a trainer node lost mid-run: its network down, its host stopped)
stops the run with an error that says so and names the key; the newest
complete checkpoint stands for ``logging.resume``.

A stop signal (SIGTERM, SIGUSR1, SIGINT) on any trainer rank stops the run
cleanly with exit code 75 (megarl/stop_protocol.py): in the loop every rank
checkpoints the step reached (megarl/loop/run_stop.py); before it (imports,
preflight, engine start and model load, resume restore) the signal is latched
and the run stops before its next phase, with nothing half written.
"""
from __future__ import annotations

from megarl.stop_protocol import RunStopped, early_stop, stop_budget, write_stop_marker

if __name__ == "__main__":  # python -m megarl.train (the launchers): a stop during the imports below is latched
    early_stop.install()

import asyncio  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

from megarl.builder import Run, StrategyWrapper, build_run, run_follower  # noqa: E402
from megarl.checkpoint.resume import ResumePoint, prepare_resume  # noqa: E402
from megarl.cli import main as cli_main  # noqa: E402
from megarl.config import MegaRLConfig  # noqa: E402
from megarl.config.run_output import apply_umask  # noqa: E402
from megarl.errors import MegarlError  # noqa: E402
from megarl.isolation.process_isolation import protect  # noqa: E402
from megarl.loop.run_stop import stop_on_signals  # noqa: E402
from megarl.loop.spmd import DrivingTrainer, receive_go, share_go  # noqa: E402
from megarl.loop.stop_ready import announce_stop_ready  # noqa: E402
from megarl.platform.cpu_affinity import pin_process  # noqa: E402
from megarl.preflight import RunSetup, preflight  # noqa: E402
from megarl.rollout.engine_pool import PooledEngines  # noqa: E402
from megarl.trainer.parallel import init_ranks, lost_rank_error  # noqa: E402


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
    stop_budget.configure(cfg.logging.stop_grace_s)
    apply_umask(cfg.logging)  # the run's files are this user's alone (logging.file_umask)
    with early_stop.installed():  # a stop signal from here to the loop is latched (module doc)
        rank, world = init_ranks(cfg.trainer.collective_timeout_s)  # every rank joins after its latch is installed
        if rank == 0:
            announce_stop_ready()  # `megarl launch` passes a stop on from now (megarl/loop/stop_ready.py)
        if rank != 0:  # a follower: waits for rank 0's checks, then replays its trainer and strategy calls
            # its own stop signal reaches rank 0 at the next step boundary (megarl/loop/spmd.py)
            run_dir = Path(receive_go())
            _pin_trainer(cfg)
            with _name_a_lost_rank(cfg, run_dir):
                run_follower(cfg, run_dir)
            return run_dir
        if early_stop.received is not None:  # during the imports: nothing written yet
            share_go(world, stopped=early_stop.received)
            raise _stopped_before("the imports", 0)
        try:
            setup = preflight(cfg, resume or cfg.logging.resume or None, world)
        except MegarlError as e:
            share_go(world, error=f"{type(e).__name__}: {e}")
            raise
        if early_stop.received is not None:  # the run directory holds its config at most: no checkpoint yet
            share_go(world, stopped=early_stop.received)
            raise _stopped_before("the preflight", 0)
        share_go(world, run_dir=str(setup.run_dir))
        protect(setup.run_dir)  # hidden from agent commands and sandboxed code (megarl/isolation/process_isolation.py)
        _pin_trainer(cfg)  # checked by the preflight; every process and thread the run starts from here inherits it
        point = prepare_resume(setup.run_dir, setup.resume_from) if setup.resume_from is not None else None
        with _name_a_lost_rank(cfg, setup.run_dir):
            summary = asyncio.run(_train(cfg, setup, point, wrap_strategy, engine_pool))
    (setup.run_dir / "summary.json").write_text(json.dumps(summary) + "\n")
    return setup.run_dir


async def _train(cfg: MegaRLConfig, setup: RunSetup, resume: ResumePoint | None,
                 wrap_strategy: StrategyWrapper | None, engine_pool: PooledEngines | None = None) -> dict:
    async with await build_run(cfg, setup, resume, wrap_strategy, engine_pool) as run:
        _stop_if_latched(run, "the engine start and model load")
        if resume is not None:
            run.restore(resume)
            _stop_if_latched(run, "the resume restore")
        with stop_on_signals(run.controller):  # checkpoint, then exit with code 75 (megarl/loop/run_stop.py)
            await run.controller.train(cfg.trainer.total_steps)
        run.save_final()
    return {"steps": run.controller.step, "version": run.trainer.version}


def _stop_if_latched(run: Run, phase: str) -> None:
    """A stop signal latched before the loop: stop now (the followers too), before anything new is written."""
    if early_stop.received is None:
        return
    if isinstance(run.trainer, DrivingTrainer):
        run.trainer.stopped_by = early_stop.received
    raise _stopped_before(phase, run.controller.step)


def _stopped_before(phase: str, step: int) -> RunStopped:
    write_stop_marker(early_stop.received or "stop", step, checkpointed=False)
    return RunStopped(f"stopped by {early_stop.received} after {phase}, before the loop (step {step}): nothing "
                      f"new was written; run the same command again (a requeued job does)")


@contextmanager
def _name_a_lost_rank(cfg: MegaRLConfig, run_dir: Path):
    """A collective that waited trainer.collective_timeout_s for another trainer rank (a trainer node lost
    mid-run) stops the run with an error that says so and names the key (megarl/trainer/parallel.py)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any other error is raised as it is
        error = lost_rank_error(e, cfg.trainer.collective_timeout_s, run_dir)
        if error is None:
            raise
        raise error from e


def _pin_trainer(cfg: MegaRLConfig) -> None:
    if cfg.placement.cpu_affinity.trainer:
        pin_process(cfg.placement.cpu_affinity.trainer)


def main(argv: list[str] | None = None) -> int:
    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
