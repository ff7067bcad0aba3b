"""Continuing a run from its newest valid checkpoint (``megarl train --resume RUN_DIR``;
megarl/checkpoint/run_checkpoint.py).

Two steps around building the run. :func:`prepare_resume`, before: the run
directory is rewound to the checkpoint (log lines of later work dropped, the
killed run's working files removed), the attempt is recorded, and the weights
the engines served are put where the publisher and a restarted engine look for
them. :func:`restore`, after the run is built: the trainer ranks and the
strategy load their state, the controller continues its step, version, buffer
and dataset position, and the RNGs continue.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from megarl.checkpoint.rewind import rewind_run_logs
from megarl.checkpoint.run_checkpoint import (
    link_or_copy_tree,
    load_file,
    read_manifest,
    remove_temp_dirs,
    restore_rng,
    set_aside_newer,
)

log = logging.getLogger("megarl.checkpoint.resume")


@dataclass
class ResumePoint:
    """A checkpoint a run continues from, with its run directory prepared."""

    step_dir: Path
    #: the loop's state (controller.pt)
    state: dict
    #: 1 for the first resume of the run, 2 for the next...: prefixes new trajectory ids (``r{n}.g{k}-{j}``)
    attempt: int
    #: (weights dir, version) the engines load at start; None at version 0 (the base checkpoint)
    engine_weights: tuple[str, int] | None


def prepare_resume(run_dir: Path, step_dir: Path) -> ResumePoint:
    """Rewind ``run_dir`` to ``step_dir`` and record the attempt in ``RUN_DIR/resumes.jsonl``."""
    state = load_file(step_dir / "controller.pt")
    manifest = read_manifest(step_dir)
    remove_temp_dirs(run_dir / "checkpoints")
    set_aside_newer(run_dir / "checkpoints", int(manifest["step"]))  # the damaged ones the resume passed
    rewind_run_logs(run_dir, manifest)
    for stale in ("weights", "dedicated"):  # the killed run's working files
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    resumes = run_dir / "resumes.jsonl"
    attempt = 1 + (len(resumes.read_bytes().splitlines()) if resumes.is_file() else 0)  # a damaged line counts
    with resumes.open("a") as f:
        f.write(json.dumps({"attempt": attempt, "checkpoint": str(step_dir), "step": manifest["step"],
                            "version": manifest["version"], "time": time.time()}) + "\n")
    version = int(state["version"])
    engine_weights = None
    if version > 0:
        weights = run_dir / "weights" / f"v{version}"  # the publisher owns it from here: deleted at the next publish
        link_or_copy_tree(step_dir / "engine_weights", weights)
        engine_weights = (str(weights), version)
    return ResumePoint(step_dir, state, attempt, engine_weights)


def restore(point: ResumePoint, *, controller, rank_states, strategy, checkpointer) -> None:
    """Load the checkpoint into a built run: every trainer rank and its strategy (``rank_states``), then the loop."""
    t0 = time.perf_counter()
    rank_states.load_rank_states(str(point.step_dir), strategy)
    controller.load_state_dict(point.state, id_prefix=f"r{point.attempt}.")
    checkpointer.last_step = controller.step
    restore_rng(point.state["rng"])
    log.info("resumed %s at step %d, version %d (engines at %d) in %.1f s", point.step_dir, controller.step,
             controller.trainer.version, controller.version, time.perf_counter() - t0)
