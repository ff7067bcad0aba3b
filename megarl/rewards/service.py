"""RewardService: score trajectories in worker processes, off the critical path.

The controller awaits ``score`` while generation and training go on; the
reward function runs in one of ``n_workers`` worker processes
(megarl/workers/pool.py). A reward that raises, hangs past ``timeout_s``,
exceeds ``memory_mb`` or kills its process marks that one sample failed and
never stops the run: the outcome says so, the reason is logged, ``stats``
counts it, and a hung or dead worker is killed and replaced.

``on_failure`` says what a failed sample becomes:
- ``"zero"``: ``RewardOutcome(reward=0.0, failed=True, drop=False)``, trained on
  with reward 0 (the sample stays in its group);
- ``"drop"``: ``RewardOutcome(reward=nan, failed=True, drop=True)``; the
  controller must drop the sample (NaN makes forgetting to do so loud).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from megarl.errors import ConfigError
from megarl.rewards import resolve_reward_fn, reward_kwargs
from megarl.types import RewardInput
from megarl.workers.pool import WorkerPool

logger = logging.getLogger(__name__)

ON_FAILURE = ("zero", "drop")


@dataclass(frozen=True)
class RewardOutcome:
    """The reward of one sample, or why there is none."""

    reward: float
    failed: bool = False
    reason: str | None = None
    #: True when on_failure="drop": the controller must not train on this sample.
    drop: bool = False


class RewardService:
    """A pool of reward worker processes behind ``async score(RewardInput)``."""

    def __init__(self, fn: str, n_workers: int = 2, timeout_s: float = 5.0, memory_mb: int | None = 512,
                 on_failure: str = "zero") -> None:
        if on_failure not in ON_FAILURE:
            raise ConfigError(f"on_failure={on_failure!r}; choose one of {list(ON_FAILURE)}")
        # import and check here, before any worker starts: a bad path or signature is a ConfigError before the run
        reward_kwargs(resolve_reward_fn(fn), fn)
        self.fn, self.timeout_s, self.memory_mb, self.on_failure = fn, timeout_s, memory_mb, on_failure
        self.stats = {"n_ok": 0, "n_failed_raise": 0, "n_failed_timeout": 0, "n_failed_memory": 0,
                      "n_failed_crash": 0}
        self._pool = WorkerPool("reward", fn, n_workers=n_workers, timeout_s=timeout_s, memory_mb=memory_mb,
                                label="RewardService")

    async def score(self, sample: RewardInput) -> RewardOutcome:
        """The reward of one response; never raises for a failing reward function."""
        kind, value = await self._pool.call((sample.response, sample.answer, sample.info()))
        if kind == "ok":
            self.stats["n_ok"] += 1
            return RewardOutcome(reward=float(value))
        self.stats[f"n_failed_{kind}"] += 1
        logger.warning("reward %r failed (%s): %s", self.fn, kind, value)
        reason = f"{kind}: {value}"
        if self.on_failure == "drop":
            return RewardOutcome(reward=math.nan, failed=True, reason=reason, drop=True)
        return RewardOutcome(reward=0.0, failed=True, reason=reason)

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        self._pool.close()

    def __enter__(self) -> "RewardService":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
