"""`megarl bench --preemption`: what a stop and a resume cost, with the running groups kept whole and without.

Each run is `megarl train` in a child process of its own (`megarl launch --launcher torchrun` with
``placement.trainer_ranks`` > 1), sent SIGTERM (the stop a scheduler sends) once
``metrics.jsonl`` holds each step of ``--stops``, so that the stop lands in the middle of the next step's
generation; each stop exits with 75 and the run is resumed (``logging.resume=RUN_DIR``) until its last step.
Two variants of the same config and seed, interleaved over ``--repeats`` rounds (megarl/bench/interleave.py):

* ``whole``: ``logging.keep_running_groups=true`` (megarl's default, megarl/loop/running_groups.py): a checkpoint
  keeps the running groups' finished and partial trajectories, and the resume continues them;
* ``prompts``: ``logging.keep_running_groups=false``: a checkpoint keeps their prompts only, and the resume
  generates them again (as systems that regenerate unfinished groups from their prompts do).

Per run, from its own metrics (every step of every attempt: a stop checkpoints the step it reached):

* generated tokens thrown away per stop: ``n_tokens_regenerated_after_resume`` over the stops;
* time to the first trained step after a resume: from the resumed process's start to its first new line in
  ``metrics.jsonl`` (the process start, the model load and the engine start are in it, alike for both);
* generated tokens per trained token: ``n_engine_generated_tokens`` (every token the engines returned, what a
  resume threw away included) over ``tokens`` (the policy tokens trained).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megarl.bench.interleave import describe, ratio_interval, ratio_text, schedule, t_interval
from megarl.bench.report import load_metrics
from megarl.errors import ConfigError, TrainingError

VARIANTS = {"prompts": "logging.keep_running_groups=false", "whole": "logging.keep_running_groups=true"}
#: seconds one attempt (start, steps, stop) may take before the bench gives up on it
ATTEMPT_TIMEOUT_S = 900.0
POLL_S = 0.05


def _lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def _attempt(argv: list[str], log: Path, metrics: Path, stop_after: int | None, env: dict) -> dict[str, Any]:
    """One `megarl train` (or `megarl launch`) process: the seconds to its first new step line, and the stop sent
    after step ``stop_after`` (None: it runs to its last step)."""
    before = _lines(metrics)
    t0 = time.monotonic()
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    first_step_s = None
    try:
        while proc.poll() is None:
            n = _lines(metrics)
            if first_step_s is None and n > before:
                first_step_s = time.monotonic() - t0
            if stop_after is not None and n >= stop_after:
                proc.send_signal(signal.SIGTERM)
                break
            if time.monotonic() - t0 > ATTEMPT_TIMEOUT_S:
                raise TrainingError(f"a bench run took over {ATTEMPT_TIMEOUT_S:.0f} s; see {log}")
            time.sleep(POLL_S)
        rc = proc.wait(timeout=ATTEMPT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if first_step_s is None and _lines(metrics) > before:
        first_step_s = time.monotonic() - t0
    want = 0 if stop_after is None else 75
    if rc != want:
        raise TrainingError(f"a bench run exited with {rc}, not {want} ({'its end' if want == 0 else 'a stop'}); "
                            f"see {log}")
    return {"stop_after": stop_after, "first_step_s": first_step_s}


def run_stopped(config: str, overrides: list[str], run_dir: Path, stops: list[int], steps: int,
                trainer_ranks: int = 1) -> dict[str, Any]:
    """One run of ``steps`` steps stopped after each step of ``stops`` and resumed; its numbers (module doc).
    ``trainer_ranks`` > 1: the run is `megarl launch --launcher torchrun` (SIGTERM to the launch, which passes
    the stop on to every rank), else `megarl train`."""
    cmd = ["launch", "--launcher", "torchrun"] if trainer_ranks > 1 else ["train"]
    common = [*cmd, "--config", config, *overrides, f"trainer.total_steps={steps}", "logging.progress=none",
              "logging.tensorboard=false"]
    metrics, log = run_dir / "metrics.jsonl", run_dir.parent / f"{run_dir.name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    attempts = [_attempt([*common, f"logging.output_dir={run_dir}"], log, metrics, stops[0] if stops else None, env)]
    for i in range(len(stops)):
        nxt = stops[i + 1] if i + 1 < len(stops) else None
        attempts.append(_attempt([*common, f"logging.resume={run_dir}"], log, metrics, nxt, env))
    records = load_metrics(metrics)
    trained = sum(r.get("tokens", 0) for r in records)
    generated = sum(r.get("n_engine_generated_tokens", 0) for r in records)
    thrown = sum(r.get("n_tokens_regenerated_after_resume", 0) for r in records)
    resumed = [a["first_step_s"] for a in attempts[1:] if a["first_step_s"] is not None]
    return {"steps": len(records), "n_stops": len(stops), "trained_tokens": trained, "generated_tokens": generated,
            "thrown_away_tokens": thrown, "thrown_away_per_stop": thrown / max(len(stops), 1),
            "continued": sum(r.get("n_continued_after_resume", 0) for r in records),
            "regenerated": sum(r.get("n_regenerated_after_resume", 0) for r in records),
            "first_step_after_resume_s": sum(resumed) / len(resumed) if resumed else None,
            "generated_per_trained": generated / trained if trained else None}


def run_preemption(config: str, overrides: list[str], output: str, stops: list[int], steps: int,
                   repeats: int, trainer_ranks: int = 1) -> dict[str, Any]:
    """Both variants, interleaved over ``repeats`` rounds (module doc); the report."""
    if not stops or sorted(set(stops)) != stops or stops[0] < 1 or stops[-1] >= steps:
        raise ConfigError(f"--stops {','.join(map(str, stops))}: give increasing steps from 1 to below --steps "
                          f"{steps} (e.g. --stops 2,4 --steps 6), so that every stop has a step after it")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r, variant in schedule(list(VARIANTS), repeats):
        run_dir = out / f"{variant}-r{r}"
        if run_dir.exists():
            raise ConfigError(f"{run_dir} exists: give a new --output (a bench run never resumes an old one)")
        rep = run_stopped(config, [*overrides, VARIANTS[variant]], run_dir, stops, steps, trainer_ranks)
        runs[variant].append(rep)
        print(f"round {r + 1}/{repeats} {variant:>7}: {_run_line(rep)}", flush=True)
    return {"config": config, "overrides": overrides, "stops": stops, "steps": steps, "repeats": repeats,
            "trainer_ranks": trainer_ranks,
            "schedule": describe(repeats), "runs": runs, "summary": summarize(runs)}


def _run_line(rep: dict[str, Any]) -> str:
    first = rep["first_step_after_resume_s"]
    return (f"thrown away {rep['thrown_away_per_stop']:.0f} tokens per stop, first step after resume "
            f"{'-' if first is None else f'{first:.1f} s'}, generated/trained {rep['generated_per_trained']:.3f} "
            f"(continued {rep['continued']}, regenerated {rep['regenerated']})")


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per variant the mean (and t interval) of each number; the ratios whole / prompts, per round."""
    keys = ("thrown_away_per_stop", "first_step_after_resume_s", "generated_per_trained")
    out: dict[str, Any] = {v: {k: t_interval([r[k] for r in reps if r[k] is not None] or [float("nan")])
                               for k in keys} for v, reps in runs.items()}
    out["ratios"] = {k: ratio_interval([r[k] for r in runs["whole"]], [r[k] for r in runs["prompts"]])
                     for k in keys[1:]}
    return out


def render(rep: dict[str, Any]) -> str:
    """The report's table and ratio lines."""
    s = rep["summary"]

    def cell(t: dict[str, Any], fmt: str) -> str:
        return format(t["mean"], fmt) + ("" if t["low"] is None else f" [{t['low']:{fmt}}, {t['high']:{fmt}}]")

    lines = [f"# megarl bench --preemption: {rep['config']}, {rep['steps']} steps, SIGTERM after steps "
             f"{', '.join(map(str, rep['stops']))} ({rep['schedule']})", "",
             "| running groups in a checkpoint | generated tokens thrown away per stop | first trained step after "
             "resume (s) | generated tokens per trained token |", "|---|---|---|---|"]
    for v, name in (("prompts", "prompts only (keep_running_groups=false)"), ("whole", "whole (megarl)")):
        t = s[v]
        lines.append(f"| {name} | {cell(t['thrown_away_per_stop'], '.0f')} | "
                     f"{cell(t['first_step_after_resume_s'], '.2f')} | {cell(t['generated_per_trained'], '.3f')} |")
    lines.append("")
    for k, what in (("first_step_after_resume_s", "time to the first trained step after a resume"),
                    ("generated_per_trained", "generated tokens per trained token")):
        r = s["ratios"][k]
        lines.append(f"whole / prompts, {what}: {ratio_text(r) if r else 'n/a'}")
    return "\n".join(lines) + "\n"
