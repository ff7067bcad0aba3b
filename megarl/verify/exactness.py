"""`megarl verify-recovery`: one real run per strategy, each anchor checked against the true ``logp_old``.

Every strategy runs the same config and seed, wrapped in
:class:`~recovery.verifier.VerifyingStrategy` (through megarl/builder.py),
which compares its anchor for every train batch with a forward of the exact
version v_t of every policy token, replaying the routes of the request that
generated it, and checks that reference against the engine (the oracle: in
fp32 the two compute the same network). :func:`failures` lists the strategies
whose claim of exactness the measurement refutes and every oracle failure; the
command exits with code 1 on any. ``--negative-control`` makes one input wrong
on purpose (recovery/_negative_controls.py), so that a check is seen to fail.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from megarl.builder import DEFAULT_TOL, VerifyingStrategy, load_run_config
from megarl.builder import negative_controls as controls
from megarl.errors import ConfigError
from megarl.rollout.base import truncates_sampling
from megarl.rollout.engine_pool import EnginePool
from megarl.train import train
from megarl.verify.exactness_restart import STOP_WINDOW, StopMidAnswer, attempt, run_across_restart

__all__ = ["DEFAULT_TOL", "failures", "verify_recovery"]


def failures(report: dict[str, Any]) -> list[str]:
    """One line per failed check (empty: every check passed): a strategy that claims exactness but was not
    measured exact, and a reference that the engine oracle refutes (fp32 only: recovery/_reference.py)."""
    out = []
    for name, rep in report["strategies"].items():
        oracle = rep.get("oracle", {})
        if oracle.get("passed") is False:
            out.append(f"{name}: the engine oracle failed: the reference logp_old misses the fp32 engine's "
                       f"logp_behav by up to {oracle['max_abs_err']:.3g} (> {oracle['tol']:.3g}); the trainer's "
                       f"forward at each token's version does not reproduce the engine (wrong routes, version or "
                       f"alignment, or the engine reused KV of another version from its prefix cache)")
        out.extend(_route_failures(name, rep))
        if "restart" in rep and not rep["restart"]["n_spliced_across_restart"]:
            out.append(f"{name}: no checked row holds tokens of both sides of the restart at step "
                       f"{rep['restart']['stopped_at_step']} ({rep['restart']['n_partial_rows_kept']} partial rows "
                       f"kept): the restart was not tested; stop at another step (--restart-at) or run more --steps")
        if not rep["claims_exact"] or rep["measured_exact"]:
            continue
        if rep["n_tokens"] == 0:
            out.append(f"{name} claims exactness but no policy token was checked (run more --steps)")
        elif rep["copy"]["is_copy"]:
            out.append(f"{name} claims exactness but its anchor carries logp_behav's exact bits on "
                       f"{rep['copy']['copied_frac']:.0%} of the {rep['copy']['telling_tokens']:.0f} tokens where "
                       f"the reference differs from logp_behav: a copy of the engine's log-probs, not a forward "
                       f"of the trainer")
        else:
            out.append(f"{name} claims exactness but its max abs error {rep['max_abs_err']:.3g} exceeds "
                       f"--tol {rep['tol']:.3g} by {rep['max_abs_err'] - rep['tol']:.3g}")
    return out


def _route_failures(name: str, rep: dict[str, Any]) -> list[str]:
    """Where routing replay matters (recovery/_routes_matter.py): the flip positions, and the policy's routes."""
    out = []
    m = rep.get("routes_matter", {})
    if m.get("passed") is False:
        decided = m["n_flip_positions"] - m["n_undecided"]
        if m["n_flip_positions"] and (m["n_replay_closer"] < decided or m["gap_replay_mean"] >= m["gap_live_mean"]):
            out.append(f"{name}: replaying the engine's routes brought the trainer closer to logp_behav than live "
                       f"routing at only {m['n_replay_closer']:.0f} of the {decided:.0f} positions where the "
                       f"trainer's routers choose other experts and the two differ by more than the engine's "
                       f"discrepancy elsewhere (mean gap {m['gap_replay_mean']:.3g} "
                       f"replayed, {m['gap_live_mean']:.3g} live): the reference does not replay the engine's routes")
        if m["anchor_other_routes"]:
            checked = m["anchor_engine_routes"] + m["anchor_other_routes"] + m["anchor_unseen"]
            out.append(f"{name} claims exactness but its anchor was computed with other routes than the engine's "
                       f"at {m['anchor_other_routes']:.0f} of the {checked:.0f} policy tokens whose routes were "
                       f"compared by id")
    wrong = rep.get("routes", {}).get("policy_routes_wrong", 0)
    if wrong:
        out.append(f"{name}: the policy forward replays other routes than the newest segment's at {wrong} positions")
    return out


def _matter_part(m: dict[str, Any]) -> str:
    verdict = {None: "nothing to judge", True: "passed", False: "FAILED"}[m["passed"]]
    return (f" | where routes matter ({m['n_flip_positions']:.0f} positions): replay closer to the engine at "
            f"{m['n_replay_closer']:.0f}, undecided {m['n_undecided']:.0f} (mean gap {m['gap_replay_mean']:.3g} "
            f"replayed, {m['gap_live_mean']:.3g} "
            f"live); anchor tokens with the engine's route ids {m['anchor_engine_routes']:.0f}, other routes "
            f"{m['anchor_other_routes']:.0f}, unseen {m['anchor_unseen']:.0f}: {verdict}")


def _restart_part(rep: dict[str, Any]) -> str:
    r = rep["restart"]
    return (f" | restart: stopped at step {r['stopped_at_step']} with {r['n_partial_rows_kept']} partial rows kept, "
            f"{r['n_spliced_across_restart']} checked rows spliced across it (continued "
            f"{rep['n_continued_after_resume']}, regenerated {rep['n_regenerated_after_resume']})")


def _oracle_part(o: dict[str, Any]) -> str:
    if o["judges"]:
        return f" | oracle (fp32 engine) max {o['max_abs_err']:.3g}: {'passed' if o['passed'] else 'FAILED'}"
    return f" | oracle: r_d (engine not fp32) mean {o['mean_abs_err']:.3g} max {o['max_abs_err']:.3g}"


def _routes_line(r: dict[str, Any]) -> str:
    same, now = r["same_version"], r["current_weights"]
    return (f" | routes replayed; the trainer's own routers choose other experts for {same['tokens_differ_frac']:.1%}"
            f" of tokens ({same['decisions_differ_frac']:.1%} of decisions) at the sampling version, "
            f"{now['tokens_differ_frac']:.1%} ({now['decisions_differ_frac']:.1%}) at the current weights; "
            f"without replay |logp_old-logp_behav| mean={r['r_d_abs_mean_no_replay']:.3g} "
            f"max={r['r_d_abs_max_no_replay']:.3g}")


def oracle_judges(cfg) -> bool:
    """Whether the engine oracle judges this run: engines and trainer in fp32 and a sampling rule the trainer
    models (no top-p / top-k), so that the reference must equal logp_behav."""
    return (cfg.engine_dtype == "float32" and cfg.model.dtype == "float32"
            and not truncates_sampling(cfg.rollout.top_p, cfg.rollout.top_k))


def verify_recovery(config_path: str, strategies: list[str], steps: int, output: str, overrides: list[str],
                    tol: float = DEFAULT_TOL, negative_control: str = "", restart_at: int = 0) -> dict:
    """Run the loop once per strategy (same seed and config) and write ``output`` (report.json).

    ``negative_control``: make one thing wrong on purpose (recovery/_negative_controls.py); the checks must
    then fail. ``restart_at`` > 0: each run is stopped from that step on and resumed from its checkpoint
    (megarl/verify/exactness_restart.py). The runs share one set of engines, reset to the base checkpoint before each
    (megarl/rollout/engine_pool.py); their logs are in ``engines/`` beside ``output``."""
    if negative_control and negative_control not in controls.NAMES:
        raise ConfigError(f"--negative-control {negative_control!r} is not one of {', '.join(controls.NAMES)}")
    if negative_control in controls.RESTART_CONTROLS and not restart_at:
        raise ConfigError(f"--negative-control {negative_control} changes the checkpoint a resume loads: give "
                          f"--restart-at (e.g. --restart-at 3)")
    if restart_at < 0 or (restart_at and steps < restart_at + STOP_WINDOW + 1):
        raise ConfigError(f"--restart-at {restart_at} needs --steps >= {restart_at + STOP_WINDOW + 1} (the stop "
                          f"may come up to {STOP_WINDOW} steps later, and the resumed run must train after it)")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with EnginePool(out.parent / "engines") as pool:
        return _verify_each(config_path, strategies, steps, out, overrides, tol, pool, negative_control,
                            restart_at)


#: loop counters a verify report carries (summed over the run's steps): how the splices came about
COUNTERS = ("n_interrupted", "n_splice_holds", "n_routes_missing", "n_continued_after_resume",
            "n_regenerated_after_resume")


def _counters(run_dir: Path) -> dict[str, int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {k: int(sum(r.get(k, 0) for r in records)) for k in COUNTERS}


def _verify_each(config_path: str, strategies: list[str], steps: int, out: Path, overrides: list[str],
                 tol: float, pool: EnginePool, negative_control: str, restart_at: int) -> dict:
    report: dict[str, Any] = {"tol": tol, "negative_control": negative_control or None,
                              "restart_at": restart_at or None, "strategies": {}}
    for name in strategies:
        run_dir = out.parent / f"verify-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, never a resume of an old one
        cfg = load_run_config(config_path, [*overrides, f"recovery.name={name}", f"trainer.total_steps={steps}",
                                            "logging.progress=none", "logging.tensorboard=false",
                                            f"logging.output_dir={run_dir}"])
        if cfg.rollout.eta < 2 or not cfg.rollout.interruptible:
            raise ConfigError(f"verify-recovery needs rollout.eta >= 2 and interruptible rollouts "
                              f"(got eta={cfg.rollout.eta}, interruptible={cfg.rollout.interruptible})")
        if negative_control in controls.ROUTE_CONTROLS and not cfg.rollout.routing_replay:
            raise ConfigError(f"--negative-control {negative_control} corrupts MoE routes: it needs an MoE model "
                              f"with rollout.routing_replay=true")
        judges = oracle_judges(cfg)

        def train_once(stop_at=None, resume=None, earlier=None, kept=None, cfg=cfg, judges=judges):
            verifiers: list = []  # the verifier, then any StopMidAnswer around it

            def wrap(inner):
                if negative_control in controls.STRATEGY_CONTROLS:
                    inner = controls.STRATEGY_CONTROLS[negative_control](inner)
                verifier = VerifyingStrategy(inner, oracle_judges=judges,
                                             corrupt_routes=controls.ROUTE_CONTROLS.get(negative_control))
                if earlier is not None:
                    verifier.continue_from(earlier, kept)
                verifiers.append(verifier)
                if stop_at:
                    verifiers.append(StopMidAnswer(verifier, stop_at))
                return verifiers[-1]

            return attempt(lambda: train(cfg, wrap_strategy=wrap, resume=resume, engine_pool=pool), verifiers)

        if restart_at:
            rep = run_across_restart(train_once, run_dir, restart_at, tol, negative_control)
        else:
            rep = train_once().verifier.report(tol)
        rep.update(_counters(run_dir))
        report["strategies"][name] = rep
        by_conv = "".join(f" max_abs_err[{c}]={e['max_abs_err']:.3g}" for c, e in rep.get("conventions", {}).items())
        print(f"{name:>15}: claims_exact={rep['claims_exact']} measured_exact={rep['measured_exact']} "
              f"max_abs_err={rep['max_abs_err']:.3g} mean_abs_err={rep['mean_abs_err']:.3g}{by_conv} "
              f"tokens={rep['n_tokens']} spliced={rep['n_spliced_sequences']}/{rep['n_sequences']} "
              f"(interrupted {rep['n_interrupted']}, held {rep['n_splice_holds']})"
              + _oracle_part(rep["oracle"]) + (_routes_line(rep["routes"]) if "routes" in rep else "")
              + (_matter_part(rep["routes_matter"]) if "routes_matter" in rep else "")
              + (_restart_part(rep) if "restart" in rep else ""), flush=True)
        out.write_text(json.dumps(report, indent=2,
                                  default=lambda x: None if isinstance(x, float) and math.isnan(x) else x) + "\n")
    return report
