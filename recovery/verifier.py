"""Ground truth for old-logit recovery, and the check of every strategy against it.

The reference ``logp_old`` (:func:`~recovery._reference.true_logp_old`) is a
forward of the exact version v_t of every token, replaying the routes of the
request that generated it; ``compare`` reports how far an anchor is from it
over the policy tokens. The reference itself is checked against the engine
(:func:`~recovery._reference.engine_oracle`): with engines and trainer in fp32
every token's reference log-prob must equal the engine's ``logp_behav``
within ``ORACLE_TOL``, so a reference fed wrong inputs (routes, versions,
alignment) fails instead of agreeing with a strategy fed the same.

:class:`VerifyingStrategy` does that inside the real async loop: it wraps the
strategy under test and is itself a strategy (it plugs in through the hooks,
like any other), keeps every published version's parameters on the side and,
for every train batch, compares the wrapped strategy's anchor with the truth.
It is a check, not a printout: a strategy that claims exactness
(``claims_exact``, the class flag) is *measured* exact when its largest error
over all policy tokens is at most ``tol`` (``measured_exact``) and its anchor
is not a bit-for-bit copy of ``logp_behav`` (``copy``: in fp32 a copy is within
tolerance, so only its bits give it away). For the interpolation strategies
(loglinear, linear) the report also gives the error of each v_theta convention
(``conventions``), whichever one the run trained with. With routing replay the
report's ``routes`` gives the route flips of numeric mismatch (trainer at the
sampling version) apart from those of version drift (trainer at its current
weights; recovery/_route_checks.py), and r_d with the trainer's own routing.
A negative control (recovery/_negative_controls.py) may corrupt the routes
every forward sees (``corrupt_routes``), to show the oracle fails.

The reference is computed from a copy of the batch taken before the wrapped
strategy runs, so nothing the strategy does to the batch reaches it. Where
routing replay matters (recovery/_routes_matter.py: the positions where the
trainer's own routers at a token's version choose other experts than the
engine, which exist in bf16 and not in fp32) the report's ``routes_matter``
judges that replay brings the reference closer to the engine than live
routing, and that an exact strategy's anchor was computed with the engine's
routes there (route ids); ``routes.policy_routes_wrong`` counts positions
where the policy forward's routes are not the newest segment's.
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import Any, Callable

import torch

from megarl.losses.mismatch import discrepancy
from megarl.routes import newest_routes
from megarl.types import AnchorResult, TrainBatch, Trajectory
from recovery._reference import ORACLE_TOL, copy_share, engine_oracle, policy_tokens, true_logp_old
from recovery._route_checks import count_flips, empty_counts, summarize
from recovery._routes_matter import RouteTap, judge, policy_routes_wrong, summary
from recovery._routes_matter import empty as empty_routes_matter
from recovery.base import DelegatingStrategy, RecoveryStrategy

__all__ = ["DEFAULT_TOL", "ORACLE_TOL", "VerifyingStrategy", "compare", "true_logp_old"]


def compare(anchor: torch.Tensor, truth: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
    """Errors of ``anchor`` against ``truth`` over policy tokens, and how spliced the batch is.

    A non-finite anchor at a policy token counts as an infinite error.
    """
    mask = policy_tokens(batch)
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


#: an anchor that carries logp_behav's exact bits on more than this share of the tokens where the reference
#: differs from logp_behav (at least COPY_MIN_TELLING of them) is a copy of logp_behav, not a forward
COPY_FRAC = 0.5
COPY_MIN_TELLING = 10


class VerifyingStrategy(DelegatingStrategy):
    """Delegates every hook to ``inner`` and scores its anchors against the truth.

    ``oracle_judges``: engines and trainer compute in fp32 with an untruncated sampling rule, so the reference
    must equal ``logp_behav`` within ``ORACLE_TOL`` (else the oracle only reports r_d). ``corrupt_routes``: a
    negative control's change to every batch's route segments (recovery/_negative_controls.py).
    """

    name = "verifying"

    def __init__(self, inner: RecoveryStrategy, *, oracle_judges: bool = False,
                 corrupt_routes: Callable[[list], list] | None = None) -> None:
        super().__init__(inner)
        self.oracle_judges = oracle_judges
        self.corrupt_routes = corrupt_routes
        self.params_by_version: dict[int, dict] = {}
        self.stats = {"max_abs_err": 0.0, "sum_abs_err": 0.0, "n_tokens": 0, "n_sequences": 0,
                      "n_spliced_sequences": 0, "max_versions_per_sequence": 0,
                      "r_d_abs_max": 0.0, "r_d_abs_sum": 0.0, "r_d_n_tokens": 0,
                      "copied": 0.0, "telling": 0.0, "n_spliced_across_update": 0,
                      "n_spliced_across_restart": 0}
        #: per v_theta convention of an interpolation strategy: [max abs err, sum abs err]
        self.by_convention: dict[str, list[float]] = {c: [0.0, 0.0] for c in inner.conventions}
        #: seconds the wrapped strategy's own ``anchor`` took in the last call (the rest was the verifier's)
        self.inner_anchor_s = 0.0
        #: with routing replay: route flips by cause, and r_d without replay
        self.flips = empty_counts()
        self.no_replay = {"r_d_max": 0.0, "r_d_sum": 0.0, "r_d_n": 0.0}
        #: where replay matters (recovery/_routes_matter.py): flip positions, replay vs live, anchor routes
        self.routes_matter = empty_routes_matter()
        self.policy_routes_wrong = 0
        self._tap: RouteTap | None = None
        #: row id -> policy tokens a checkpoint kept of a partial answer (a resumed run: :meth:`continue_from`)
        self.kept_before_restart: dict[str, int] = {}

    def continue_from(self, earlier: "VerifyingStrategy", kept: dict[str, int]) -> None:
        """Go on judging a resumed run where ``earlier`` (the verifier of the stopped attempt, in this process)
        left off: its record of every version's weights and its counts. ``kept``: row id -> policy tokens the
        checkpoint kept of each partial answer; a checked row with more is counted spliced across the restart."""
        self.params_by_version.update(earlier.params_by_version)
        self.stats = dict(earlier.stats)
        self.by_convention = {c: list(v) for c, v in earlier.by_convention.items()}
        self.flips, self.no_replay = copy.deepcopy(earlier.flips), dict(earlier.no_replay)
        self.routes_matter = copy.deepcopy(earlier.routes_matter)
        self.policy_routes_wrong = earlier.policy_routes_wrong
        self.kept_before_restart = dict(kept)

    def on_weights_published(self, version: int) -> None:
        if self._tap is None:  # before the strategy's first forward
            self._tap = RouteTap(self.ctx.trainer)
        self.params_by_version[version] = self.ctx.trainer.get_params()
        self.inner.on_weights_published(version)

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        if self.corrupt_routes is not None and batch.route_segments is not None:
            segs = [self.corrupt_routes(list(s)) for s in batch.route_segments]
            batch.route_segments, batch.routes = segs, newest_routes(segs, batch.routes.shape[1])
        # the reference's own copy, taken before the strategy runs: whatever the strategy does to the batch
        # (its routes, versions, masks) cannot reach the truth it is judged against
        pristine = copy.deepcopy(batch)
        t0 = time.perf_counter()
        result = self.inner.anchor(batch, trajs)
        self.inner_anchor_s = time.perf_counter() - t0
        with self._tap.paused() if self._tap is not None else contextlib.nullcontext():
            return self._check(batch, pristine, result)

    def _check(self, batch: TrainBatch, pristine: TrainBatch, result: AnchorResult) -> AnchorResult:
        """The verifier's side of ``anchor``: the wrapped strategy's ``result`` against the truth."""
        anchor = result.logp_anchor
        logp_theta = None
        if anchor is None or self.by_convention:
            # interpolation anchors depend on logp_theta: the loss sees these values at the first forward
            logp_theta = self.ctx.trainer.logprobs(batch)
        if anchor is None:
            anchor = result.from_theta(logp_theta, batch)
        truth = true_logp_old(pristine, self.params_by_version, self.ctx.trainer)
        c = compare(anchor, truth, pristine)
        for convention, acc in self.by_convention.items():
            cc = compare(self.inner.anchor_with(logp_theta, batch, convention), truth, pristine)
            acc[0] = max(acc[0], cc["max_abs_err"])
            acc[1] += cc["mean_abs_err"] * cc["n_tokens"]
        s = self.stats
        s["max_abs_err"] = max(s["max_abs_err"], c["max_abs_err"])
        s["sum_abs_err"] += c["mean_abs_err"] * c["n_tokens"]
        s["n_tokens"] += int(c["n_tokens"])
        s["n_sequences"] += batch.size
        s["n_spliced_sequences"] += int(c["n_spliced_sequences"])
        s["n_spliced_across_update"] += self._across_update(pristine)
        s["n_spliced_across_restart"] += self._across_restart(pristine)
        s["max_versions_per_sequence"] = max(s["max_versions_per_sequence"], int(c["max_versions_per_sequence"]))
        oracle = engine_oracle(truth, pristine)  # |reference - logp_behav|: r_d, and in fp32 the oracle's error
        s["r_d_abs_max"] = max(s["r_d_abs_max"], oracle["max"])
        s["r_d_abs_sum"] += oracle["sum"]
        s["r_d_n_tokens"] += int(oracle["n"])
        copied, telling = copy_share(anchor, truth, pristine)
        s["copied"] += copied
        s["telling"] += telling
        if "r_d/n_tokens" in c:
            result.metrics.update({k: c[k] for k in ("r_d/abs_logp_mean", "r_d/abs_logp_max")})
        result.metrics["verify/max_abs_err"] = c["max_abs_err"]
        result.metrics["verify/oracle_max_abs_err"] = oracle["max"]
        if pristine.route_segments is not None:
            result.metrics.update(self._without_replay(pristine, truth, anchor))
            self.policy_routes_wrong += policy_routes_wrong(batch)
        if self._tap is not None:
            self._tap.forget(list(batch.traj_ids))
        return result

    def _across_update(self, batch: TrainBatch) -> int:
        """Spliced sequences whose first and last versions' weights differ (a step without gradient publishes the
        same weights again: a splice across it tests nothing)."""
        mask = policy_tokens(batch)
        n = 0
        for b in range(batch.size):
            vs = sorted(set(batch.versions[b].cpu()[mask[b]].tolist()))
            a, z = (self.params_by_version.get(vs[0]), self.params_by_version.get(vs[-1])) if vs else (None, None)
            n += len(vs) >= 2 and a is not None and z is not None and any(not torch.equal(a[k], z[k]) for k in a)
        return n

    def _across_restart(self, batch: TrainBatch) -> int:
        """Rows that hold policy tokens a checkpoint kept and tokens generated after the resume."""
        if not self.kept_before_restart:
            return 0
        n_policy = policy_tokens(batch).sum(-1).tolist()
        return sum(tid in self.kept_before_restart and n > self.kept_before_restart[tid] > 0
                   for tid, n in zip(batch.traj_ids, n_policy))

    def _without_replay(self, batch: TrainBatch, truth: torch.Tensor, anchor: torch.Tensor) -> dict[str, float]:
        """What routing replay changes on this batch: route flips by cause, r_d when the true logp_old is
        computed with the trainer's own routing, and the checks at the flip positions (``truth``: the reference
        with replay; ``anchor``: the strategy's, whose routes are looked at when it claims exactness)."""
        flipped = torch.zeros(batch.loss_mask.shape, dtype=torch.bool)
        out = count_flips(batch, self.params_by_version, self.ctx.trainer, self.flips, flipped)
        live = true_logp_old(batch, self.params_by_version, self.ctx.trainer, replay=False)
        judge(self.routes_matter, flipped & policy_tokens(batch), batch, truth, live, anchor,
              self._tap if self.inner.exact else None, self.inner.replayed_routes)
        d = discrepancy(live, batch.logp_behav.cpu(), policy_tokens(batch))
        out.update({f"{k}_no_replay": v for k, v in d.items()})
        if "r_d/n_tokens" in d:
            r = self.no_replay
            r["r_d_max"] = max(r["r_d_max"], d["r_d/abs_logp_max"])
            r["r_d_sum"] += d["r_d/abs_logp_mean"] * d["r_d/n_tokens"]
            r["r_d_n"] += d["r_d/n_tokens"]
        return out

    def report(self, tol: float = DEFAULT_TOL) -> dict[str, Any]:
        """The strategy's numbers; ``measured_exact``: some policy tokens were checked, none is off by > tol, and
        (for a strategy that claims exactness) the anchor is no copy of logp_behav."""
        s = self.stats
        n = max(s["n_tokens"], 1)
        copy = {"telling_tokens": s["telling"], "copied_frac": s["copied"] / max(s["telling"], 1.0)}
        copy["is_copy"] = s["telling"] >= COPY_MIN_TELLING and copy["copied_frac"] > COPY_FRAC
        oracle_max = s["r_d_abs_max"]
        rep = {"claims_exact": bool(self.inner.exact),
               "measured_exact": (s["n_tokens"] > 0 and s["max_abs_err"] <= tol
                                  and not (self.inner.exact and copy["is_copy"])), "tol": tol,
               "max_abs_err": s["max_abs_err"],
               "mean_abs_err": s["sum_abs_err"] / n, "n_tokens": s["n_tokens"],
               "n_sequences": s["n_sequences"], "n_spliced_sequences": s["n_spliced_sequences"],
               "n_spliced_across_update": s["n_spliced_across_update"],
               "n_spliced_across_restart": s["n_spliced_across_restart"],
               "spliced_frac": s["n_spliced_sequences"] / max(s["n_sequences"], 1),
               "max_versions_per_sequence": s["max_versions_per_sequence"],
               # the engines' discrepancy from the trainer, r_d, on the same tokens (not the strategy's error)
               "r_d_abs_max": oracle_max, "r_d_abs_mean": s["r_d_abs_sum"] / max(s["r_d_n_tokens"], 1),
               "copy": copy,
               # the reference against the engine: judged in fp32, else it is r_d
               "oracle": {"judges": self.oracle_judges, "tol": ORACLE_TOL, "max_abs_err": oracle_max,
                          "mean_abs_err": s["r_d_abs_sum"] / max(s["r_d_n_tokens"], 1), "n_tokens": s["r_d_n_tokens"],
                          "passed": (s["r_d_n_tokens"] > 0 and oracle_max <= ORACLE_TOL) if self.oracle_judges
                          else None}}
        if any(c["n_tokens"] for c in self.flips.values()):
            r = self.no_replay
            rep["routes"] = {**summarize(self.flips), "r_d_abs_max_no_replay": r["r_d_max"],
                             "r_d_abs_mean_no_replay": r["r_d_sum"] / max(r["r_d_n"], 1.0),
                             "policy_routes_wrong": self.policy_routes_wrong}
            rep["routes_matter"] = summary(self.routes_matter)
        if self.by_convention:
            rep["convention"] = self.inner.cfg.convention
            rep["conventions"] = {c: {"max_abs_err": mx, "mean_abs_err": total / n}
                                  for c, (mx, total) in self.by_convention.items()}
        return rep
