"""interrupt_sync (exact): score a version's tokens before that version is dropped.

Where the version-v weights come from: one CPU copy of the trainer's
parameters taken at ``on_weights_published(v)`` (the trainer is then exactly
at v). It is needed because by ``before_publish(v, v')`` the optimizer has
already moved the trainer past v. Only this one copy is ever held.

``after_optimizer_step``: the engines still generate; tokens of the published
version in trajectories that have finished (``traj.finished``: the workflow
returned, so the event loop no longer appends to them, which a multi-turn
trajectory between turns does) are scored now, off the stall.

``before_publish(old, new)``: the loop has stopped the engines; every policy
token of version ``old`` in the live trajectories (finished and partial, plus
the partials reported by ``on_rollout_interrupted``) whose ``logp_old`` is
still unknown is scored with the kept copy in one forward and written into
``traj.logp_old``. The time spent there is the generation stall (key
``gen_stall_s``): the engines wait for it.

``anchor``: tokens still unknown must be of the currently published version
(generated since the last publish); they are scored with the kept copy (or the
current parameters when the trainer has not stepped since), and the anchor is
the batch's ``logp_old`` rebuilt from the trajectories.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megarl.types import AnchorResult, TrainBatch, Trajectory
from recovery._scoring import check_rows, ensure_logp_old, logp_old_from_trajs, params_nbytes, score_at, unscored
from recovery.base import RecoveryStrategy
from recovery.registry import register


@dataclass
class InterruptSyncConfig:
    """interrupt_sync has no options."""


@register
class InterruptSync(RecoveryStrategy):
    name = "interrupt_sync"
    Config = InterruptSyncConfig
    exact = True

    def __init__(self, cfg: InterruptSyncConfig, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        self._kept: dict[str, torch.Tensor] | None = None
        self._kept_version: int | None = None
        self._interrupted: dict[str, Trajectory] = {}

    def _params_of_kept(self) -> dict[str, torch.Tensor] | None:
        """The kept copy, or None when the trainer's current parameters are the kept version."""
        return None if self.ctx.trainer.version == self._kept_version else self._kept

    def _score(self, trajs: list[Trajectory], version: int) -> int:
        """Fill ``logp_old`` of the unscored policy tokens of ``version`` in ``trajs``; returns how many."""
        todo = [(t, [i for i in unscored(t) if t.versions[i] == version]) for t in trajs]
        todo = [(t, idx) for t, idx in todo if idx]
        if not todo:
            return 0
        if version != self._kept_version:
            raise RuntimeError(f"interrupt_sync: tokens of version {version} need scoring but the kept weights "
                               f"are version {self._kept_version}")
        batch = TrainBatch.from_trajectories([t for t, _ in todo], version=self.ctx.trainer.version)
        wanted = torch.zeros(batch.loss_mask.shape, dtype=torch.bool)
        for b, (_, idx) in enumerate(todo):
            wanted[b, int(batch.prompt_lens[b]) - 1 + torch.tensor(idx)] = True
        logp = torch.full(batch.loss_mask.shape, math.nan)
        # with routing replay each token replays the routes of the request that generated it (megarl/routes.py)
        score_at(batch, self.ctx.trainer, version, self._params_of_kept(), logp, wanted)
        for b, (t, idx) in enumerate(todo):
            old = ensure_logp_old(t)
            base = int(batch.prompt_lens[b]) - 1
            for i in idx:
                old[i] = float(logp[b, base + i])
        return sum(len(idx) for _, idx in todo)

    def _report(self) -> None:
        self.meter.set("bytes_held", float(params_nbytes(self._kept)) if self._kept is not None else 0.0)
        self.meter.set("extra_param_copies", 1.0 if self._kept is not None else 0.0)

    def overhead(self) -> dict[str, float]:
        self._report()
        return super().overhead()

    # -- hooks -------------------------------------------------------------------
    def on_weights_published(self, version: int) -> None:
        trainer = self.ctx.trainer
        if trainer.version != version:
            raise RuntimeError(f"interrupt_sync: weights of version {version} published while the trainer is at "
                               f"version {trainer.version}")
        if self._kept is not None:
            trainer.release_params(self._kept)  # the new copy reuses its buffers
        self._kept = trainer.keep_params()
        self._kept_version = version
        self._interrupted.clear()
        self._report()

    def on_rollout_interrupted(self, partials: list[Trajectory]) -> None:
        for t in partials:
            self._interrupted[t.traj_id] = t

    def after_optimizer_step(self, version: int, metrics: dict) -> None:
        # finished trajectories of the published version can be scored now, while the engines keep
        # generating; only the partial ones are left for the stall in before_publish
        if self._kept_version is None:
            return
        with self.meter.time("prescore_s"):
            done = [t for t in self.ctx.live_trajectories() if t.finished]
            n = self._score(done, self._kept_version)
        self.meter.add("prescored_tokens", float(n))

    def before_publish(self, old_version: int, new_version: int) -> None:
        with self.meter.time("gen_stall_s"):
            live = {t.traj_id: t for t in self.ctx.live_trajectories()}
            live.update({k: t for k, t in self._interrupted.items() if k not in live})
            n = self._score(list(live.values()), old_version)
        self.meter.add("stall_scored_tokens", float(n))

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        check_rows(batch, trajs)
        with self.meter.time("recovery_s"):
            stale = sorted({t.versions[i] for t in trajs for i in unscored(t)} - {self._kept_version})
            if stale:
                raise RuntimeError(f"interrupt_sync: batch has unscored tokens of versions {stale}, which are gone "
                                   f"(only version {self._kept_version} is kept); before_publish must see every "
                                   f"live trajectory (RecoveryContext.live_trajectories incomplete?)")
            n = self._score(trajs, self._kept_version) if self._kept_version is not None else 0
            logp_old = logp_old_from_trajs(batch, trajs)
        self.meter.add("anchor_scored_tokens", float(n))
        return AnchorResult(logp_anchor=logp_old, exact=True)

    # -- state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.ctx.trainer.params_ready()
        return {"kept_version": self._kept_version,
                "kept": None if self._kept is None else {k: t.clone() for k, t in self._kept.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._kept_version = state["kept_version"]
        self._kept = state["kept"]
        self._interrupted.clear()
        self._report()

    def close(self) -> None:
        self._kept = None
        self._interrupted.clear()
