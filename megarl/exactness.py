"""`megarl verify-recovery`: one real run per strategy, each anchor checked against the true ``logp_old``.

Every strategy runs the same config and seed, wrapped in
:class:`~recovery.verifier.VerifyingStrategy` (through megarl/builder.py),
which compares its anchor for every train batch with a forward of the exact
version v_t of every policy token. :func:`failures` lists the strategies whose
claim of exactness the measurement refutes; the command exits with code 1 on any.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from megarl.builder import DEFAULT_TOL, VerifyingStrategy, load_run_config
from megarl.errors import ConfigError
from megarl.rollout.engine_pool import EnginePool
from megarl.train import train

__all__ = ["DEFAULT_TOL", "failures", "verify_recovery"]


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


def _routes_line(r: dict[str, float]) -> str:
    return (f" | routes replayed; without replay {r['tokens_differ_frac']:.1%} of tokens "
            f"({r['decisions_differ_frac']:.1%} of decisions) route elsewhere and |logp_old-logp_behav| "
            f"mean={r['r_d_abs_mean_no_replay']:.3g} max={r['r_d_abs_max_no_replay']:.3g}")


def verify_recovery(config_path: str, strategies: list[str], steps: int, output: str, overrides: list[str],
                    tol: float = DEFAULT_TOL) -> dict:
    """Run the loop once per strategy (same seed and config) and write ``output`` (report.json).

    The runs share one set of engines, reset to the base checkpoint before each (megarl/rollout/engine_pool.py);
    their logs are in ``engines/`` beside ``output``."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with EnginePool(out.parent / "engines") as pool:
        return _verify_each(config_path, strategies, steps, out, overrides, tol, pool)


def _verify_each(config_path: str, strategies: list[str], steps: int, out: Path, overrides: list[str],
                 tol: float, pool: EnginePool) -> dict:
    report: dict[str, Any] = {"tol": tol, "strategies": {}}
    for name in strategies:
        run_dir = out.parent / f"verify-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, never a resume of an old one
        cfg = load_run_config(config_path, [*overrides, f"recovery.name={name}", f"trainer.total_steps={steps}",
                                            "logging.progress=none", "logging.tensorboard=false",
                                            f"logging.output_dir={run_dir}"])
        if cfg.rollout.eta < 2 or not cfg.rollout.interruptible:
            raise ConfigError(f"verify-recovery needs rollout.eta >= 2 and interruptible rollouts "
                              f"(got eta={cfg.rollout.eta}, interruptible={cfg.rollout.interruptible})")
        verifiers: list[VerifyingStrategy] = []

        def wrap(inner, verifiers=verifiers):
            verifiers.append(VerifyingStrategy(inner))
            return verifiers[-1]

        train(cfg, wrap_strategy=wrap, engine_pool=pool)
        rep = verifiers[-1].report(tol)
        report["strategies"][name] = rep
        by_conv = "".join(f" max_abs_err[{c}]={e['max_abs_err']:.3g}" for c, e in rep.get("conventions", {}).items())
        print(f"{name:>15}: claims_exact={rep['claims_exact']} measured_exact={rep['measured_exact']} "
              f"max_abs_err={rep['max_abs_err']:.3g} mean_abs_err={rep['mean_abs_err']:.3g}{by_conv} "
              f"tokens={rep['n_tokens']} spliced={rep['n_spliced_sequences']}/{rep['n_sequences']} "
              f"|logp_old-logp_behav| mean={rep['r_d_abs_mean']:.3g} max={rep['r_d_abs_max']:.3g}"
              + (_routes_line(rep["routes"]) if "routes" in rep else ""), flush=True)
        out.write_text(json.dumps(report, indent=2,
                                  default=lambda x: None if isinstance(x, float) and math.isnan(x) else x) + "\n")
    return report
