"""`megarl advise` end to end: one calibration run, the cost runs, the rules, advise.json, advise.png.

1. Calibration: the config trains ``steps`` steps with its own strategy,
   wrapped in :class:`~recovery._calibration_probe.CalibrationProbe`, in this process
   (as `megarl verify-recovery` runs), on engines kept for the cost runs. For
   an MoE model the calibration captures routes (``rollout.routing_replay=true``
   when the config has it off), so that the same-version route flips and r_d
   without replay can be counted; the cost runs keep the config's setting.
2. Cost: each strategy a few steps through `megarl bench`'s runs, repeated in
   interleaved rounds while the time budget lasts (megarl/advise/costs.py),
   and the plan's memory.
3. The rules (megarl/advise/rules.py), then RUN_DIR/advise.json (every
   measurement, the recommendation and its reasons), RUN_DIR/advise.md (the
   table and the paragraph) and RUN_DIR/advise.png.

The time budget bounds the whole command: the calibration runs first (its
length is set by ``steps``), and strategies whose cost run would not fit in
what is left are skipped and named.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable

from megarl.advise import costs, report
from megarl.advise.rules import recommend
from megarl.errors import ConfigError

DEFAULT_STEPS = 20
DEFAULT_COST_STEPS = 4
DEFAULT_TIME_BUDGET_S = 480.0
DEFAULT_REPEATS = 3


def check_args(steps: int, cost_steps: int, time_budget_s: float, repeats: int = DEFAULT_REPEATS) -> None:
    """One error per bad argument, naming it and the range that works."""
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: give at least 1 (an interval needs 2, a useful one 3 or more)")
    if steps < 2:
        raise ConfigError(f"--steps {steps}: the calibration needs at least 2 steps (a token lag needs a publish)")
    if cost_steps and cost_steps < 2:
        raise ConfigError(f"--cost-steps {cost_steps}: give 0 (no cost runs) or at least 2 (the median step "
                          f"skips the first, which holds start-up)")
    if not time_budget_s > 0:
        raise ConfigError(f"--time-budget-s {time_budget_s}: give a positive number of seconds")


def _config_facts(cfg: Any, hf: dict) -> dict[str, Any]:
    from megarl.models.hf_config import is_moe  # torch: only when the command runs

    lc = cfg.loss
    return {"eta": cfg.rollout.eta, "strategy": cfg.recovery.name, "moe": is_moe(hf),
            "routing_replay": bool(cfg.rollout.routing_replay), "workflow": cfg.rollout.workflow,
            "engine_dtype": cfg.engine_dtype, "trainer_dtype": cfg.model.dtype,
            "loss": {"behav_weight": lc.behav_weight, "behav_low": lc.behav_low, "behav_high": lc.behav_high,
                     "behav_level": lc.behav_level, "eps_clip": lc.eps_clip, "eps_clip_high": lc.eps_clip_high,
                     "dual_clip": lc.dual_clip}}


def advise(config: str, overrides: list[str], output: str, *, steps: int = DEFAULT_STEPS,
           cost_steps: int = DEFAULT_COST_STEPS, strategies: tuple[str, ...] = costs.ORDER,
           time_budget_s: float = DEFAULT_TIME_BUDGET_S, host_memory_gb: float | None = None,
           repeats: int = DEFAULT_REPEATS, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Calibrate, time, decide; write advise.json, advise.md and advise.png into ``output``. Returns advise.json's
    content, with ``paths``."""
    from megarl.builder import CalibrationProbe, load_run_config  # torch and the strategies: when the command runs
    from megarl.launch.placement import load_hf_config
    from megarl.rollout.engine_pool import EnginePool
    from megarl.train import train

    check_args(steps, cost_steps, time_budget_s, repeats)
    deadline = time.monotonic() + time_budget_s
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    base = load_run_config(config, overrides)  # a bad config or override fails here, before any process starts
    hf, _ = load_hf_config(base, overrides)
    facts = _config_facts(base, hf)
    calib_overrides = list(overrides)
    notes = []
    if facts["moe"] and not facts["routing_replay"]:
        calib_overrides.append("rollout.routing_replay=true")
        notes.append("the calibration captured MoE routes (rollout.routing_replay=true) to count route flips; "
                     "the cost runs kept the config's setting")
    run_dir = out / "calibration"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume of an old one
    cfg = load_run_config(config, [*calib_overrides, f"trainer.total_steps={steps}", "logging.progress=none",
                                   "logging.tensorboard=false", f"logging.output_dir={run_dir}"])
    probes: list = []

    def wrap(inner):
        probes.append(CalibrationProbe(inner, cfg.recovery))
        return probes[-1]

    with EnginePool(out / "engines") as pool:
        log(f"[calibration] {steps} steps of {config} with {facts['strategy']} ...")
        t0 = time.monotonic()
        train(cfg, wrap_strategy=wrap, engine_pool=pool)
        calibration = {**probes[-1].summary(), "run_s": time.monotonic() - t0}
        log(f"[calibration] done in {calibration['run_s']:.0f} s")
        asked = [s for s in strategies if s in costs.ORDER]
        timed = (costs.time_strategies(config, overrides, asked, cost_steps, out / "cost", pool, deadline, log,
                                       repeats=repeats)
                 if cost_steps else {"steps": 0, "repeats": 0, "repeats_done": 0, "order": [], "runs": {},
                                     "skipped": {s: "--cost-steps 0" for s in asked}})
    m: dict[str, Any] = {"config": {"path": config, "overrides": overrides, **facts}, "notes": notes,
                         "calibration": calibration, "cost": timed,
                         "memory": costs.planned_memory(base, overrides, host_memory_gb)}
    m["recommendation"] = recommend(m)
    paths = {"json": str(out / "advise.json"), "markdown": str(out / "advise.md"), "picture": str(out / "advise.png")}
    m["paths"] = paths
    report.write_json(m, Path(paths["json"]))
    Path(paths["markdown"]).write_text(report.render_markdown(m))
    report.picture(m, Path(paths["picture"]))
    return m
