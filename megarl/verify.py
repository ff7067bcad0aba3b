"""Exactness verification of recovery strategies inside the real async loop.

:class:`VerifyingStrategy` wraps the strategy under test and is itself a
strategy (it plugs in through the hooks, like any other): it keeps every
published version's parameters on the side and, for every train batch,
compares the wrapped strategy's anchor with the true ``logp_old`` — a forward
of the exact version v_t of every policy token (``recovery.verifier``).

It is a check, not a printout: a strategy that claims exactness
(``claims_exact``, the class flag) is *measured* exact when its largest
error over all policy tokens is at most ``tol`` (``measured_exact``);
:func:`failures` lists the claims the measurement refutes, and the command
exits with code 1 on any. For the interpolation strategies (loglinear,
linear) the report also gives the error of each v_theta convention
(``conventions``), whichever one the run trained with.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from megarl.types import AnchorResult, Trajectory, TrainBatch
from recovery.base import RecoveryStrategy
from recovery.verifier import compare, true_logp_old

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
                      "n_spliced_sequences": 0, "max_versions_per_sequence": 0}
        #: per v_theta convention of an interpolation strategy: [max abs err, sum abs err]
        self.by_convention: dict[str, list[float]] = {c: [0.0, 0.0] for c in getattr(inner, "conventions", ())}

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
        result = self.inner.anchor(batch, trajs)
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
        result.metrics["verify/max_abs_err"] = c["max_abs_err"]
        return result

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
               "max_versions_per_sequence": s["max_versions_per_sequence"]}
        if self.by_convention:
            rep["convention"] = self.inner.cfg.convention
            rep["conventions"] = {c: {"max_abs_err": mx, "mean_abs_err": total / n}
                                  for c, (mx, total) in self.by_convention.items()}
        return rep


def failures(report: dict[str, Any]) -> list[str]:
    """One line per strategy that claims exactness but was not measured exact (empty: the check passed)."""
    out = []
    for name, rep in report["strategies"].items():
        if not rep["claims_exact"] or rep["measured_exact"]:
            continue
        if rep["n_tokens"] == 0:
            out.append(f"{name} claims exactness but no policy token was checked (run more --steps)")
        else:
            out.append(f"{name} claims exactness but its max abs error {rep['max_abs_err']:.3g} exceeds "
                       f"--tol {rep['tol']:.3g} by {rep['max_abs_err'] - rep['tol']:.3g}")
    return out


def verify(config_path: str, strategies: list[str], steps: int, output: str, overrides: list[str],
           tol: float = DEFAULT_TOL) -> dict:
    """Run the loop once per strategy (same seed and config) and write ``output`` (report.json)."""
    from megarl.config import load_config
    from megarl.errors import ConfigError
    from megarl.train import train

    report: dict[str, Any] = {"tol": tol, "strategies": {}}
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in strategies:
        run_dir = out.parent / f"verify-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, never a resume of an old one
        cfg = load_config(config_path, [*overrides, f"recovery.name={name}", f"trainer.total_steps={steps}",
                                        "logging.progress=none", "logging.tensorboard=false",
                                        f"logging.output_dir={run_dir}"])
        if cfg.rollout.eta < 2 or not cfg.rollout.interruptible:
            raise ConfigError(f"verify-recovery needs rollout.eta >= 2 and interruptible rollouts "
                              f"(got eta={cfg.rollout.eta}, interruptible={cfg.rollout.interruptible})")
        holder: dict[str, VerifyingStrategy] = {}

        def wrap(inner: RecoveryStrategy) -> RecoveryStrategy:
            holder["v"] = VerifyingStrategy(inner)
            return holder["v"]

        train(cfg, wrap_strategy=wrap)
        rep = holder["v"].report(tol)
        report["strategies"][name] = rep
        by_conv = "".join(f" max_abs_err[{c}]={e['max_abs_err']:.3g}" for c, e in rep.get("conventions", {}).items())
        print(f"{name:>15}: claims_exact={rep['claims_exact']} measured_exact={rep['measured_exact']} "
              f"max_abs_err={rep['max_abs_err']:.3g} mean_abs_err={rep['mean_abs_err']:.3g}{by_conv} "
              f"tokens={rep['n_tokens']} spliced={rep['n_spliced_sequences']}/{rep['n_sequences']}", flush=True)
        out.write_text(json.dumps(report, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x) + "\n")
    return report
