"""The recovery protocol: hooks the async loop calls, and nothing else.

A strategy supplies the loss anchor for each train batch: the exact
``logp_old`` (log-probs of the trainer under the version v_t that sampled each
token) or an approximate proximal anchor ``logp_prox``. The loop calls the
hooks below at fixed points; a strategy never edits the loop.

Order of calls in one step of the loop (see megarl/loop/controller.py)::

    ... engines generate; on_segment_finished(traj) per finished trajectory
    batch ready -> anchor(batch, trajs)            # before the train step
    train step (loss uses the anchor)
    after_optimizer_step(version)                  # trainer now at `version`
    publish:  abort in-flight -> on_rollout_interrupted(partials)
              before_publish(old_version, new_version)
              engines load new weights
              on_weights_published(new_version)    # generation resumes

The version-0 weights are published once at start-up through the same hooks.
"""
from __future__ import annotations

import abc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

from megarl.trainer.base import ScoringTrainer
from megarl.types import AnchorResult, TrainBatch, Trajectory


@dataclass
class RecoveryContext:
    """What a strategy may use. Built by the loop once per run."""

    #: this rank's trainer (MegatronTrainer): logprobs, get_params, set_params, use_params, version, dtype
    trainer: ScoringTrainer
    #: the policy-loss config (strategies that gate on the active-token fraction need it)
    loss_cfg: Any = None
    #: versions still referenced by a live token (in the buffer or in flight)
    live_versions: Callable[[], set[int]] = field(default_factory=lambda: (lambda: set()))
    #: live trajectories (buffer + in flight, partial ones included), for strategies that score them
    live_trajectories: Callable[[], list[Trajectory]] = field(default_factory=lambda: (lambda: []))
    #: the run directory (disk snapshots, dedicated-process files)
    run_dir: str = ""
    #: HF config of the policy and the initial checkpoint directory (dedicated process)
    checkpoint_dir: str = ""
    #: the staleness bound of the run (rollout.eta)
    eta: int = 1
    #: optimizer steps per published version (trainer.publish_every)
    publish_every: int = 1
    #: False on follower trainer ranks: they replay rank 0's hooks (trainer collectives) but run no
    #: side processes; rank 0's anchor is what every rank trains with (megarl/loop/spmd.py)
    is_driver: bool = True


class OverheadMeter:
    """Seconds, bytes and copies a strategy costs, accumulated per step."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.step: dict[str, float] = {}

    @contextmanager
    def time(self, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - t0)

    def add(self, key: str, value: float) -> None:
        self.step[key] = self.step.get(key, 0.0) + value
        self.totals[key] = self.totals.get(key, 0.0) + value

    def set(self, key: str, value: float) -> None:
        self.step[key] = value
        self.totals[key] = value

    def pop_step(self) -> dict[str, float]:
        out, self.step = self.step, {}
        return out


class RecoveryStrategy(abc.ABC):
    """Base class: default hooks do nothing. Subclasses set ``name``, ``Config``, ``exact``."""

    name: ClassVar[str] = ""
    #: the strategy's own config dataclass (options under ``recovery.<name>.*``)
    Config: ClassVar[type] = object
    #: True when ``anchor`` returns the true ``logp_old``
    exact: ClassVar[bool] = False
    #: whether hooks read ``ctx.live_trajectories()``; with several trainer ranks rank 0 then sends its
    #: live trajectories with every hook, for followers to run the same forwards (megarl/loop/spmd.py).
    #: A strategy that never reads them sets False and saves that traffic.
    uses_live_trajectories: ClassVar[bool] = True
    #: the v_theta conventions the anchor can be formed with (``anchor_with``; the interpolation
    #: strategies, recovery/loglinear.py); empty for a strategy whose anchor has none
    conventions: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Any, ctx: RecoveryContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.meter = OverheadMeter()

    # -- hooks the loop calls ---------------------------------------------------
    def on_weights_published(self, version: int) -> None:
        """The engines now generate with ``version``."""

    def before_publish(self, old_version: int, new_version: int) -> None:
        """In-flight generation is stopped; ``old_version`` is about to be replaced."""

    def on_rollout_interrupted(self, partials: list[Trajectory]) -> None:
        """Publishing aborted these trajectories; they will resume with the new weights."""

    def on_segment_finished(self, traj: Trajectory) -> None:
        """``traj`` finished generating (all its segments are final)."""

    @abc.abstractmethod
    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        """Anchor log-probs for ``batch`` (rows in the order of ``trajs``)."""

    def after_optimizer_step(self, version: int, metrics: dict[str, float]) -> None:
        """The trainer finished an optimizer step and is now at ``version``."""

    def replayed_routes(self, traj_id: str, index: int) -> Any | None:
        """The MoE routes ([layers, k]) a forward in another process replayed at input position ``index`` of
        ``traj_id`` to score the token there, for the last batch anchored; None where this strategy's forwards
        ran on ``ctx.trainer`` (the verifier sees those) or the position was not scored that way."""
        del traj_id, index

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def overhead(self) -> dict[str, float]:
        """Per-step overhead since the last call: seconds (``*_s``), bytes, copies held."""
        return self.meter.pop_step()

    def close(self) -> None:
        """Release processes and files."""


class DelegatingStrategy(RecoveryStrategy):
    """A strategy wrapped by a check (the verifier, a negative control): every hook goes to ``inner`` unless the
    subclass overrides it; it claims what ``inner`` claims."""

    def __init__(self, inner: RecoveryStrategy) -> None:
        super().__init__(inner.cfg, inner.ctx)
        self.inner = inner
        self.exact = inner.exact  # type: ignore[misc]
        self.conventions = inner.conventions  # type: ignore[misc]
        self.uses_live_trajectories = inner.uses_live_trajectories  # type: ignore[misc]

    def on_weights_published(self, version: int) -> None:
        self.inner.on_weights_published(version)

    def before_publish(self, old_version: int, new_version: int) -> None:
        self.inner.before_publish(old_version, new_version)

    def on_rollout_interrupted(self, partials: list[Trajectory]) -> None:
        self.inner.on_rollout_interrupted(partials)

    def on_segment_finished(self, traj: Trajectory) -> None:
        self.inner.on_segment_finished(traj)

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        return self.inner.anchor(batch, trajs)

    def after_optimizer_step(self, version: int, metrics: dict[str, float]) -> None:
        self.inner.after_optimizer_step(version, metrics)

    def replayed_routes(self, traj_id: str, index: int) -> Any | None:
        return self.inner.replayed_routes(traj_id, index)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def overhead(self) -> dict[str, float]:
        return self.inner.overhead()

    def close(self) -> None:
        self.inner.close()
