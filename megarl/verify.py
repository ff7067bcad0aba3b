"""Exactness verification of recovery strategies inside the real async loop.

:class:`VerifyingStrategy` wraps the strategy under test and is itself a
strategy (it plugs in through the hooks, like any other): it keeps every
published version's parameters on the side and, for every train batch,
compares the wrapped strategy's anchor with the true ``logp_old`` — a forward
of the exact version v_t of every policy token (``recovery.verifier``).
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
        if anchor is None:
            # interpolation anchors depend on logp_theta: the loss sees these values at the first forward
            anchor = result.from_theta(self.ctx.trainer.logprobs(batch), batch)
        truth = true_logp_old(batch, self.params_by_version, self.ctx.trainer)
        c = compare(anchor, truth, batch)
        s = self.stats
        s["max_abs_err"] = max(s["max_abs_err"], c["max_abs_err"])
        s["sum_abs_err"] += c["mean_abs_err"] * c["n_tokens"]
        s["n_tokens"] += int(c["n_tokens"])
        s["n_sequences"] += batch.size
        s["n_spliced_sequences"] += int(c["n_spliced_sequences"])
        s["max_versions_per_sequence"] = max(s["max_versions_per_sequence"], int(c["max_versions_per_sequence"]))
        result.metrics["verify/max_abs_err"] = c["max_abs_err"]
        return result

    def report(self) -> dict[str, Any]:
        s = self.stats
        n = max(s["n_tokens"], 1)
        return {"exact": bool(self.inner.exact), "max_abs_err": s["max_abs_err"],
                "mean_abs_err": s["sum_abs_err"] / n, "n_tokens": s["n_tokens"],
                "n_sequences": s["n_sequences"], "n_spliced_sequences": s["n_spliced_sequences"],
                "spliced_frac": s["n_spliced_sequences"] / max(s["n_sequences"], 1),
                "max_versions_per_sequence": s["max_versions_per_sequence"]}


def verify(config_path: str, strategies: list[str], steps: int, output: str, overrides: list[str]) -> dict:
    """Run the loop once per strategy (same seed and config) and write ``output`` (report.json)."""
    from megarl.config import load_config
    from megarl.errors import ConfigError
    from megarl.train import train

    report: dict[str, Any] = {"strategies": {}}
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
        rep = holder["v"].report()
        report["strategies"][name] = rep
        print(f"{name:>15}: exact={rep['exact']} max_abs_err={rep['max_abs_err']:.3g} "
              f"mean_abs_err={rep['mean_abs_err']:.3g} tokens={rep['n_tokens']} "
              f"spliced={rep['n_spliced_sequences']}/{rep['n_sequences']}", flush=True)
        out.write_text(json.dumps(report, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x) + "\n")
    return report
