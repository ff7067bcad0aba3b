"""Ground truth for old-logit recovery: the forward of the exact version v_t of every token.

``true_logp_old`` runs, for each version v present in the batch, a forward of
the whole batch under the parameters of v and keeps the positions of that
version: the slow, obviously-correct reference the exact strategies are
checked against (``megarl verify-recovery``). ``compare`` reports how far an
anchor is from it over the policy tokens.

:class:`VerifyingStrategy` does that inside the real async loop: it wraps the
strategy under test and is itself a strategy (it plugs in through the hooks,
like any other), keeps every published version's parameters on the side and,
for every train batch, compares the wrapped strategy's anchor with the truth.
It is a check, not a printout: a strategy that claims exactness
(``claims_exact``, the class flag) is *measured* exact when its largest error
over all policy tokens is at most ``tol`` (``measured_exact``). For the
interpolation strategies (loglinear, linear) the report also gives the error
of each v_theta convention (``conventions``), whichever one the run trained with.
With routing replay the report's ``routes`` says what replay changed: the share
of tokens (and of token x layer decisions) the trainer's own routers send to
other experts than the engine did, and r_d with the trainer's own routing.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from megarl.losses.mismatch import discrepancy
from megarl.models.routing_replay import live_routes, route_disagreement
from megarl.types import AnchorResult, TrainBatch, Trajectory
from recovery._scoring import forward, policy_mask, versions_in
from recovery.base import RecoveryStrategy


def true_logp_old(batch: TrainBatch, params_by_version: dict[int, dict[str, torch.Tensor]],
                  trainer: Any) -> torch.Tensor:
    """[B, L-1]: at each policy token the log-prob under the version that generated it; NaN elsewhere."""
    mask = policy_mask(batch)
    missing = [v for v in versions_in(batch) if v not in params_by_version]
    if missing:
        raise KeyError(f"no parameters for versions {missing} (have {sorted(params_by_version)})")
    truth = torch.full(batch.loss_mask.shape, math.nan, dtype=torch.float32)
    for v in versions_in(batch):
        lp = forward(trainer, batch, params_by_version[v]).float().cpu()
        of_v = (mask & (batch.versions == v)).cpu()
        truth[of_v] = lp[of_v]
    return truth


def compare(anchor: torch.Tensor, truth: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
    """Errors of ``anchor`` against ``truth`` over policy tokens, and how spliced the batch is.

    A non-finite anchor at a policy token counts as an infinite error.
    """
    mask = policy_mask(batch).cpu()
    err = (anchor.detach().float().cpu() - truth.float())[mask].abs()
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, math.inf))
    versions = batch.versions.cpu()
    per_seq = [len(torch.unique(versions[b][mask[b]])) for b in range(versions.shape[0])]
    n = int(mask.sum())
    return {
        **discrepancy(truth, batch.logp_behav.cpu(), mask),
        "max_abs_err": float(err.max()) if n else 0.0,
        "mean_abs_err": float(err.mean()) if n else 0.0,
        "n_tokens": float(n),
        "n_spliced_sequences": float(sum(k >= 2 for k in per_seq)),
        "max_versions_per_sequence": float(max(per_seq, default=0)),
    }


DEFAULT_TOL = 1e-5
"""Largest abs error of logp_old that still counts as exact (fp32 round-off of two forward layouts is ~5e-7)."""


class VerifyingStrategy(RecoveryStrategy):
    """Delegates every hook to ``inner`` and scores its anchors against the truth."""

    name = "verifying"

    def __init__(self, inner: RecoveryStrategy) -> None:
        super().__init__(inner.cfg, inner.ctx)
        self.inner = inner
        self.exact = inner.exact  # type: ignore[misc]
        self.params_by_version: dict[int, dict] = {}
        self.stats = {"max_abs_err": 0.0, "sum_abs_err": 0.0, "n_tokens": 0, "n_sequences": 0,
                      "n_spliced_sequences": 0, "max_versions_per_sequence": 0,
                      "r_d_abs_max": 0.0, "r_d_abs_sum": 0.0, "r_d_n_tokens": 0}
        #: per v_theta convention of an interpolation strategy: [max abs err, sum abs err]
        self.by_convention: dict[str, list[float]] = {c: [0.0, 0.0] for c in inner.conventions}
        #: seconds the wrapped strategy's own ``anchor`` took in the last call (the rest was the verifier's)
        self.inner_anchor_s = 0.0
        #: with routing replay: the engine's routes against the trainer's own, and r_d without replay
        self.routes = {"n_tokens": 0.0, "tokens_differ": 0.0, "decisions": 0.0, "decisions_differ": 0.0,
                       "r_d_max_no_replay": 0.0, "r_d_sum_no_replay": 0.0, "r_d_n_no_replay": 0.0}

    # hooks: delegate, plus keep every version's weights
    def on_weights_published(self, version: int) -> None:
        self.params_by_version[version] = self.ctx.trainer.get_params()
        self.inner.on_weights_published(version)

    def before_publish(self, old_version: int, new_version: int) -> None:
        self.inner.before_publish(old_version, new_version)

    def on_rollout_interrupted(self, partials: list[Trajectory]) -> None:
        self.inner.on_rollout_interrupted(partials)

    def on_segment_finished(self, traj: Trajectory) -> None:
        self.inner.on_segment_finished(traj)

    def after_optimizer_step(self, version: int, metrics: dict[str, float]) -> None:
        self.inner.after_optimizer_step(version, metrics)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def overhead(self) -> dict[str, float]:
        return self.inner.overhead()

    def close(self) -> None:
        self.inner.close()

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        t0 = time.perf_counter()
        result = self.inner.anchor(batch, trajs)
        self.inner_anchor_s = time.perf_counter() - t0
        anchor = result.logp_anchor
        logp_theta = None
        if anchor is None or self.by_convention:
            # interpolation anchors depend on logp_theta: the loss sees these values at the first forward
            logp_theta = self.ctx.trainer.logprobs(batch)
        if anchor is None:
            anchor = result.from_theta(logp_theta, batch)
        truth = true_logp_old(batch, self.params_by_version, self.ctx.trainer)
        c = compare(anchor, truth, batch)
        for convention, acc in self.by_convention.items():
            cc = compare(self.inner.anchor_with(logp_theta, batch, convention), truth, batch)
            acc[0] = max(acc[0], cc["max_abs_err"])
            acc[1] += cc["mean_abs_err"] * cc["n_tokens"]
        s = self.stats
        s["max_abs_err"] = max(s["max_abs_err"], c["max_abs_err"])
        s["sum_abs_err"] += c["mean_abs_err"] * c["n_tokens"]
        s["n_tokens"] += int(c["n_tokens"])
        s["n_sequences"] += batch.size
        s["n_spliced_sequences"] += int(c["n_spliced_sequences"])
        s["max_versions_per_sequence"] = max(s["max_versions_per_sequence"], int(c["max_versions_per_sequence"]))
        if "r_d/n_tokens" in c:  # |logp_old - logp_behav| of every policy token, whatever the strategy
            s["r_d_abs_max"] = max(s["r_d_abs_max"], c["r_d/abs_logp_max"])
            s["r_d_abs_sum"] += c["r_d/abs_logp_mean"] * c["r_d/n_tokens"]
            s["r_d_n_tokens"] += int(c["r_d/n_tokens"])
            result.metrics.update({k: c[k] for k in ("r_d/abs_logp_mean", "r_d/abs_logp_max")})
        result.metrics["verify/max_abs_err"] = c["max_abs_err"]
        if batch.routes is not None:
            result.metrics.update(self._without_replay(batch))
        return result

    def _without_replay(self, batch: TrainBatch) -> dict[str, float]:
        """What routing replay changes on this batch: how often the trainer's own routers choose other experts
        than the engine did, and r_d when the true logp_old is computed with the trainer's own routing."""
        live = live_routes(self.ctx.trainer, batch)
        out = route_disagreement(batch.routes, live)
        truth = true_logp_old(dataclasses.replace(batch, routes=None), self.params_by_version, self.ctx.trainer)
        out.update({f"{k}_no_replay": v for k, v in discrepancy(truth, batch.logp_behav.cpu(),
                                                                 policy_mask(batch).cpu()).items()})
        r = self.routes
        n_tok = out["routes/n_tokens"]
        r["n_tokens"] += n_tok
        r["tokens_differ"] += out["routes/tokens_differ_frac"] * n_tok
        r["decisions"] += out["routes/n_decisions"]
        r["decisions_differ"] += out["routes/decisions_differ_frac"] * out["routes/n_decisions"]
        if "r_d/n_tokens_no_replay" in out:
            r["r_d_max_no_replay"] = max(r["r_d_max_no_replay"], out["r_d/abs_logp_max_no_replay"])
            r["r_d_sum_no_replay"] += out["r_d/abs_logp_mean_no_replay"] * out["r_d/n_tokens_no_replay"]
            r["r_d_n_no_replay"] += out["r_d/n_tokens_no_replay"]
        return out

    def report(self, tol: float = DEFAULT_TOL) -> dict[str, Any]:
        """The strategy's numbers; ``measured_exact``: some policy tokens were checked and none is off by > tol."""
        s = self.stats
        n = max(s["n_tokens"], 1)
        rep = {"claims_exact": bool(self.inner.exact),
               "measured_exact": s["n_tokens"] > 0 and s["max_abs_err"] <= tol, "tol": tol,
               "max_abs_err": s["max_abs_err"],
               "mean_abs_err": s["sum_abs_err"] / n, "n_tokens": s["n_tokens"],
               "n_sequences": s["n_sequences"], "n_spliced_sequences": s["n_spliced_sequences"],
               "spliced_frac": s["n_spliced_sequences"] / max(s["n_sequences"], 1),
               "max_versions_per_sequence": s["max_versions_per_sequence"],
               # the engines' discrepancy from the trainer, r_d, on the same tokens (not the strategy's error)
               "r_d_abs_max": s["r_d_abs_max"], "r_d_abs_mean": s["r_d_abs_sum"] / max(s["r_d_n_tokens"], 1)}
        r = self.routes
        if r["n_tokens"]:
            rep["routes"] = {"tokens_differ_frac": r["tokens_differ"] / r["n_tokens"],
                             "decisions_differ_frac": r["decisions_differ"] / max(r["decisions"], 1.0),
                             "r_d_abs_max_no_replay": r["r_d_max_no_replay"],
                             "r_d_abs_mean_no_replay": r["r_d_sum_no_replay"] / max(r["r_d_n_no_replay"], 1.0)}
        if self.by_convention:
            rep["convention"] = self.inner.cfg.convention
            rep["conventions"] = {c: {"max_abs_err": mx, "mean_abs_err": total / n}
                                  for c, (mx, total) in self.by_convention.items()}
        return rep
