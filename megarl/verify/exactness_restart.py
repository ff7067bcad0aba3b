"""`megarl verify-recovery --restart-at K`: the exactness check across a stop and a resume.

Each strategy's run is stopped mid-run by the stop a scheduler sends (SIGTERM to
this process, megarl/loop/run_stop.py) at the first step boundary from K on where a
running group holds an answer under way; the checkpoint keeps the running groups
whole (megarl/loop/running_groups.py). The run is then resumed from its run directory
as ``megarl train --resume`` does: a new trainer, strategy and loop loaded from
the checkpoint on disk, the engines reset and loaded with the weights they
served. The partial answers go on under the resumed version, so trained rows
hold tokens sampled before the stop and after it.

The judge is the verifier (recovery/verifier.py): its record of every published
version's weights and its counts so far are handed from the first attempt's
verifier to the second's in this process; they are not part of the checkpoint,
so nothing the product saved or loaded can make the judge agree with it. The
report counts the checked rows that hold tokens of both attempts
(``n_spliced_across_restart``); a restart mode that checked none fails.

The negative control ``restart_wrong_version`` stores a wrong version (one
older) for the kept tokens of one partial answer in the checkpoint, re-signed
with the run's key as megarl signs it, so the resume loads it; the check must
fail.
"""
from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from megarl.builder import DelegatingStrategy, VerifyingStrategy
from megarl.checkpoint.dirs import find_latest_checkpoint
from megarl.checkpoint.files import MANIFEST, build_manifest, read_manifest
from megarl.errors import ConfigError
from megarl.isolation.run_key import MAC_FIELD
from megarl.loop.stop_checkpoint import cancel_exit
from megarl.stop_protocol import RunStopped, early_stop, stop_budget
from megarl.trainer.plain_data import load_plain
from megarl.types import NO_VERSION

#: the stop comes at most this many steps after --restart-at when no answer is under way before
STOP_WINDOW = 3

WRONG_VERSION = "restart_wrong_version"


class StopMidAnswer(DelegatingStrategy):
    """Sends this process the stop a scheduler sends (SIGTERM), once, after the first optimizer step from
    ``at`` on where a running group holds an answer under way (at the latest at ``at + STOP_WINDOW``)."""

    name = "stop_mid_answer"

    def __init__(self, inner, at: int) -> None:
        super().__init__(inner)
        self.at, self.steps, self.sent = at, 0, False

    def after_optimizer_step(self, version: int, metrics: dict[str, float]) -> None:
        self.inner.after_optimizer_step(version, metrics)
        self.steps += 1
        if self.sent or self.steps < self.at:
            return
        under_way = any(t.response_ids and not t.finished for t in self.ctx.live_trajectories())
        if under_way or self.steps >= self.at + STOP_WINDOW:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def partial_answers(state: dict) -> dict[str, list[dict]]:
    """Per partial trajectory the checkpoint's loop ``state`` keeps (tokens sampled, not finished): its rows."""
    out = {}
    for g in state.get("running_groups", []):
        for t in g["trajectories"]:
            if t["response_ids"] and not t["finished"]:
                out[t["traj_id"]] = [t, *t.get("parts", [])]
    return out


def kept_policy_tokens(state: dict) -> dict[str, int]:
    """Row id -> policy tokens the checkpoint's loop ``state`` keeps, for every row of a partial answer (the
    verifier counts a row spliced across the restart when it trains more of them)."""
    return {r["traj_id"]: sum(1 for m, v in zip(r["loss_mask"], r["versions"]) if m and v != NO_VERSION)
            for rows in partial_answers(state).values() for r in rows}


def store_wrong_version(step_dir: Path, state: dict) -> str:
    """The negative control: in the loop ``state`` of checkpoint ``step_dir``, the partial answer with the most
    tokens of a version >= 1 claims the version before theirs; the checkpoint is written and signed again with the
    run's key. Returns the trajectory's id."""
    answers = partial_answers(state)
    scored = {tid: sum(v >= 1 for v in rows[0]["versions"]) for tid, rows in answers.items()}
    if not scored or max(scored.values()) == 0:
        raise ConfigError(f"--negative-control {WRONG_VERSION}: the checkpoint at {step_dir} holds no partial "
                          f"answer with tokens of a version >= 1; stop later (--restart-at)")
    tid = max(scored, key=scored.__getitem__)
    row = answers[tid][0]
    row["versions"] = [v - 1 if v >= 1 else v for v in row["versions"]]
    torch.save(state, step_dir / "controller.pt")
    old = read_manifest(step_dir)
    meta = {k: v for k, v in old.items() if k not in ("format", "files", MAC_FIELD)}
    (step_dir / MANIFEST).write_text(json.dumps(build_manifest(step_dir, meta), indent=1) + "\n")
    return tid


@dataclass
class Attempt:
    """One attempt of a strategy's run: its verifier, and whether it stopped on the stop signal."""

    verifier: VerifyingStrategy
    stopped: bool


def attempt(train_run: Callable[[], object], verifiers: list[VerifyingStrategy]) -> Attempt:
    """Run ``train_run`` (the loop, whose strategy wrapper appends its verifier, and any :class:`StopMidAnswer`
    around it, to ``verifiers``). A stop that this module did not send (Ctrl-C, a scheduler) ends the command."""
    try:
        train_run()
        stopped = False
    except RunStopped:
        if not any(isinstance(w, StopMidAnswer) and w.sent for w in verifiers):
            raise
        stopped = True
    return Attempt(next(v for v in verifiers if isinstance(v, VerifyingStrategy)), stopped)


def run_across_restart(train_once: Callable[..., Attempt], run_dir: Path, restart_at: int, tol: float,
                       negative_control: str) -> dict:
    """Both attempts of one strategy's run; the resumed attempt's verifier report with a ``restart`` section.

    ``train_once(stop_at=, resume=, earlier=, kept=)`` runs the loop once: ``stop_at`` wraps the verified strategy
    in :class:`StopMidAnswer`; ``resume`` is the run directory to continue; ``earlier`` and ``kept`` go to the new
    verifier's :meth:`~recovery.verifier.VerifyingStrategy.continue_from`."""
    first = train_once(stop_at=restart_at, resume=None, earlier=None, kept=None)
    if not first.stopped:
        raise ConfigError(f"the run reached its last step before the stop at step {restart_at}: raise --steps "
                          f"above --restart-at + {STOP_WINDOW + 1}")
    for reset in (stop_budget.reset, early_stop.reset, cancel_exit):  # this process goes on: a new run's budget
        reset()
    step_dir = find_latest_checkpoint(run_dir)  # the one the resume takes
    state = load_plain(step_dir / "controller.pt")
    corrupted = store_wrong_version(step_dir, state) if negative_control == WRONG_VERSION else None
    kept = kept_policy_tokens(state)  # versions aside, the wrong one changes nothing it counts
    step = int(state["step"])
    second = train_once(stop_at=None, resume=run_dir, earlier=first.verifier, kept=kept)
    rep = second.verifier.report(tol)
    rep["restart"] = {"stopped_at_step": step, "n_partial_rows_kept": len(kept),
                      "n_spliced_across_restart": second.verifier.stats["n_spliced_across_restart"],
                      "wrong_version_stored_for": corrupted}
    return rep
