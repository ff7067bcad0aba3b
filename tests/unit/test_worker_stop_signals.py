"""Reward and tool workers live through a run's stop signals: a stop reaches every process of a Slurm step or a
torchrun worker's group (SIGUSR1, SIGTERM, SIGINT), and the service, not the signal, decides when workers end.
A worker killed by one would fail the reward call in flight (a sample trained with reward 0) while the run
checkpoints."""
import asyncio
import os
import signal
import time

from megarl.rewards.service import RewardService
from megarl.types import RewardInput


def test_a_stop_signal_to_a_worker_neither_kills_it_nor_fails_a_call():
    with RewardService("reverse_digits", n_workers=1, timeout_s=10.0, memory_mb=None) as service:
        first = asyncio.run(service.score(RewardInput(response="21", answer="12")))
        assert not first.failed
        (worker,) = service._pool._idle
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            os.kill(worker.proc.pid, sig)
        time.sleep(0.5)
        assert worker.proc.poll() is None, f"the worker died of a stop signal (exit {worker.proc.poll()})"
        out = asyncio.run(service.score(RewardInput(response="21", answer="12")))
        assert out == first and service.stats["n_failed_crash"] == 0
