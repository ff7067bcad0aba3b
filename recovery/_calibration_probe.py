"""The calibration probe of `megarl advise` (megarl/advise/): the run's strategy trains; every anchor is measured.

:class:`CalibrationProbe` wraps the run's strategy (the loop trains with that
strategy's anchor, unchanged) and, for every train batch, computes on the
same tokens:

- the exact ``logp_old``: verify-recovery's reference
  (:func:`recovery.verifier.true_logp_old`: a forward of each token's own
  version, replaying its segment's MoE routes), from a copy of every published
  version's parameters kept while a live token still references it;
- the anchor of each approximate strategy, computed by that strategy's own
  code: a shadow instance of ewma, recompute, loglinear and linear (built from
  the run's ``recovery.<name>`` options) receives the hooks the run's strategy
  receives, so ewma's average follows the run's parameters; behav's anchor is
  ``logp_behav``;
- with routing replay: the same-version and current-weight route flips
  (recovery/_route_checks.py) and r_d when the exact forward routes live.

The shadows never change the trainer's parameters (their forwards swap
parameters in and back, as the strategies do in a real run). It lives in
``recovery`` beside the verifier whose reference it uses; megarl reaches it
through megarl/builder.py, as it reaches the verifier.
"""
from __future__ import annotations

from typing import Any

import torch

from megarl.advise.measure import Accumulator, policy_tokens
from megarl.losses.mismatch import discrepancy
from megarl.types import AnchorResult, TrainBatch, Trajectory
from recovery import registry
from recovery._route_checks import count_flips, empty_counts, summarize
from recovery.base import DelegatingStrategy, RecoveryStrategy
from recovery.verifier import true_logp_old

#: approximate strategies whose anchors the probe computes beside the run's own (behav: logp_behav itself)
SHADOWED = ("ewma", "recompute", "loglinear", "linear")


def build_shadows(recovery_cfg: Any, ctx: Any, names: tuple[str, ...] = SHADOWED) -> dict[str, RecoveryStrategy]:
    """One instance per name, with the run's options for it (``recovery.<name>.*``) and the run's context."""
    out = {}
    for name in names:
        cls = registry.get(name)
        out[name] = cls(recovery_cfg.options.get(name) or cls.Config(), ctx)
    return out


class CalibrationProbe(DelegatingStrategy):
    """Delegates every hook to the run's strategy and measures every anchor against the exact one."""

    name = "advise"

    def __init__(self, inner: RecoveryStrategy, recovery_cfg: Any) -> None:
        super().__init__(inner)
        self.shadows = build_shadows(recovery_cfg, inner.ctx)
        loss_cfg = inner.ctx.loss_cfg
        if loss_cfg is None:
            from megarl.losses import PolicyLossConfig
            loss_cfg = PolicyLossConfig()
        self.acc = Accumulator(loss_cfg)
        self.params_by_version: dict[int, dict[str, torch.Tensor]] = {}
        self.flips = empty_counts()
        self.no_replay = {"sum": 0.0, "n": 0.0, "max": 0.0}

    def on_weights_published(self, version: int) -> None:
        self.params_by_version[version] = self.ctx.trainer.get_params()
        oldest_live = min(self.ctx.live_versions() | {version})  # older versions can never be asked for again
        for v in [v for v in self.params_by_version if v < oldest_live]:
            del self.params_by_version[v]
        self.inner.on_weights_published(version)
        for s in self.shadows.values():
            s.on_weights_published(version)

    def after_optimizer_step(self, version: int, metrics: dict[str, float]) -> None:
        self.inner.after_optimizer_step(version, metrics)
        for s in self.shadows.values():
            s.after_optimizer_step(version, metrics)

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        result = self.inner.anchor(batch, trajs)
        trainer = self.ctx.trainer
        with torch.no_grad():
            truth = true_logp_old(batch, self.params_by_version, trainer)
            logp_theta = trainer.logprobs(batch).float().cpu()
            anchors = {"behav": batch.logp_behav.float().cpu()}
            for name, shadow in self.shadows.items():
                r = shadow.anchor(batch, trajs)
                a = r.logp_anchor if r.logp_anchor is not None else r.from_theta(logp_theta, batch)
                anchors[name] = a.float().cpu()
            self.acc.add(batch, truth, logp_theta, anchors)
            if batch.route_segments is not None:
                count_flips(batch, self.params_by_version, trainer, self.flips)
                live = true_logp_old(batch, self.params_by_version, trainer, replay=False)
                d = discrepancy(live, batch.logp_behav.cpu(), policy_tokens(batch))
                if d:
                    self.no_replay["sum"] += d["r_d/abs_logp_mean"] * d["r_d/n_tokens"]
                    self.no_replay["n"] += d["r_d/n_tokens"]
                    self.no_replay["max"] = max(self.no_replay["max"], d["r_d/abs_logp_max"])
        return result

    def overhead(self) -> dict[str, float]:
        out = dict(self.inner.overhead())
        for s in self.shadows.values():
            s.overhead()  # drain the shadows' meters: their time is the probe's, not the run's strategy's
        return out

    def close(self) -> None:
        for s in self.shadows.values():
            s.close()
        self.inner.close()

    def summary(self) -> dict[str, Any]:
        """The accumulator's summary, with the route flips when the run replays routes."""
        out = self.acc.summary()
        if any(c["n_tokens"] for c in self.flips.values()):
            out["routes"] = {**summarize(self.flips),
                             "r_d_abs_mean_no_replay": self.no_replay["sum"] / max(self.no_replay["n"], 1.0),
                             "r_d_abs_max_no_replay": self.no_replay["max"]}
        return out
