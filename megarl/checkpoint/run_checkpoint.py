"""Run checkpoints: everything a killed run needs to continue as if it had not stopped.

Layout of ``RUN_DIR/checkpoints/step_{n}/`` (n = loop steps done)::

    manifest.json           sha256 + size of every other file, and a summary (step, versions, accepted_total, run)
    controller.pt           step, engine version, counters, group counter, dataset position, replay buffer
                            (accepted-but-untrained trajectories with per-token versions, logp_behav, logp_old),
                            prompts of groups still running, python/numpy/torch RNG states
    trainer/                model + optimizer (megatron-core dist_checkpointing, torch_dist) and
                            megarl_trainer.pt (version, scheduler step, RNG): megarl/trainer/dist_state.py
    strategy/               the recovery strategy's state_dict: its copies of the weights in sharded/
                            (torch_dist, sharded like the model), the rest in rank{r}.pt:
                            megarl/trainer/param_state.py
    engine_weights/         HF weights of the version the engines generate with (absent at version 0:
                            the engines then start from model.checkpoint)

What "accepted" means at checkpoint time: a group is accepted when
``ReplayBuffer.accept`` has counted it; the checkpoint is taken synchronously on
the event loop, so every accept is either in it (``accepted_total`` includes it,
its trajectories are trained or in the buffer) or after it. Groups still
running are not in it: only their prompts are, and a resumed run generates
them again under new trajectory ids. ``accepted.jsonl`` lines carry the
``accepted_total`` after their accept, so "accepted before the checkpoint"
is ``line.accepted_total <= manifest.accepted_total``.

Writing is atomic: files go to ``checkpoints/.tmp-step_{n}-*``, are fsynced, the
manifest is written last, and one rename publishes the directory; a crash
leaves at most a ``.tmp-`` directory, which is never read and is removed on
resume. Overwriting a step's checkpoint swaps the two copies in renames
between which a kill always leaves a complete copy that resume takes. A resume
past damaged newer checkpoints renames them ``damaged_step_{n}`` (never read,
never counted by ``keep_last``, pruned with the checkpoints older than those it
keeps). megarl/checkpoint/dirs.py has the directory names and rules,
megarl/checkpoint/files.py the manifest. Loading checks the manifest first; a
missing or corrupt file raises :class:`~megarl.errors.CheckpointError` naming it.
A resume rewinds the run's journals to the checkpoint: megarl/checkpoint/rewind.py.

The trainer's and the strategy's tensors are stored under their global names and shapes, so a run
resumes in another parallel layout (TP, PP, EP, DP and the number of trainer ranks; not the kind of
optimizer, the dtype or the run's batching, checked by megarl/checkpoint/settings.py's
``check_run_settings``); each rank's part is megarl/checkpoint/rank_state.py's. A checkpoint of
the earlier per-rank format (``trainer/rank{r}.pt``: ``torch.save`` of each rank's state dicts) still
loads, in the layout that wrote it only.
"""
from __future__ import annotations

import asyncio
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megarl.checkpoint.dirs import (
    find_latest_checkpoint,
    list_checkpoints,
    new_temp_dir,
    prune,
    publish_temp_dir,
    remove_temp_dirs,
    set_aside_newer,
    write_checkpoint,
)
from megarl.checkpoint.files import (
    MANIFEST,
    build_manifest,
    link_or_copy_tree,
    read_manifest,
    verify_checkpoint,
)
from megarl.checkpoint.rank_state import SingleRankStates
from megarl.checkpoint.writer import BackgroundWrite
from megarl.errors import CheckpointError
from megarl.trainer.plain_data import load_plain

#: the directory and manifest functions are megarl/checkpoint/dirs.py's and files.py's; callers
#: import them from here, with the state, as one API of run checkpoints
__all__ = ["MANIFEST", "Checkpointer", "build_manifest", "capture_rng", "find_latest_checkpoint", "link_or_copy_tree",
           "list_checkpoints", "load_file", "prune", "read_manifest", "remove_temp_dirs", "restore_rng",
           "set_aside_newer", "verify_checkpoint", "write_checkpoint"]

log = logging.getLogger("megarl.checkpoint.run_checkpoint")


# -- state ------------------------------------------------------------------------
def capture_rng() -> dict:
    """The python, numpy and torch RNG states as plain data (numpy's key as a tensor: checkpoints hold no
    numpy objects, megarl/trainer/plain_data.py's ``load_plain``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                                   int(has_gauss), float(cached)),
            "torch": torch.get_rng_state()}


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])


def load_file(path: str | Path) -> Any:
    """A checkpoint file of plain data (megarl/trainer/plain_data.py's ``load_plain``); CheckpointError naming a
    missing, damaged or refused one."""
    return load_plain(path)


# -- the loop's checkpointer ------------------------------------------------------
class Checkpointer:
    """Writes ``RUN_DIR/checkpoints/step_{n}`` for the controller (see the module doc).

    ``save`` captures the controller's and the strategy's state synchronously on
    the event loop (a consistent cut: no accept, admission or hook can run in
    between), then writes files in a worker thread while generation goes on; the
    loop waits for that write. ``save(controller, background=True)`` (periodic saves
    with ``logging.async_save``) returns once every rank has prepared its part and
    writes the rest while the loop trains on (megarl/checkpoint/writer.py); the next
    save, and :meth:`wait`, wait for it first.
    """

    def __init__(self, run_dir: str | Path, trainer, strategy, weights_dir: str | Path, *, keep_last: int,
                 run: dict | None = None, rank_states=None) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.trainer = trainer
        self.strategy = strategy
        #: writes every trainer rank's state (SingleRankStates, or DrivingTrainer with several ranks)
        self.rank_states = rank_states or SingleRankStates(trainer)
        self.weights_dir = Path(weights_dir)
        self.keep_last = keep_last
        self.run = run or {}
        self.last_step: int | None = None
        #: seconds the loop waited for the last save (its prepare part when in the background)
        self.last_seconds = 0.0
        #: (step, its write) of the background write in flight
        self._pending: tuple[int, BackgroundWrite] | None = None
        #: the step of the newest checkpoint on disk (last_step counts one still being written)
        self._durable_step: int | None = None

    async def wait(self) -> Path | None:
        """Wait for the background write in flight (if any): its checkpoint's path, or its failure raised
        (its temp directory is gone then; the previous checkpoint stands)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        step, pending = pending
        try:
            path = await asyncio.wrap_future(pending.future)
        except BaseException:
            self.last_step = self._durable_step  # that step has no checkpoint: the next save may take it again
            raise
        self._durable_step = step
        log.info("checkpoint %s written in the background in %.2f s", path, pending.seconds)
        return path

    async def save(self, controller, *, background: bool = False) -> Path | None:
        """Checkpoint now (the path), or prepare it and write it in the background (None; :meth:`wait`)."""
        await self.wait()
        t0 = time.perf_counter()
        state = controller.state_dict()
        state["rng"] = capture_rng()
        strategy_state = self.strategy.state_dict()
        engine_version = controller.version
        meta = {"version": int(self.trainer.version), "engine_version": int(engine_version),
                "accepted_total": int(state["buffer"]["accepted_total"]), "run": self.run}
        step = controller.step
        if background:
            tmp = new_temp_dir(self.root, step)
            try:
                write = await asyncio.to_thread(self._prepare, tmp, state, strategy_state, engine_version)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            # the manifest says how it was written: the seconds the loop waited (the prepare part)
            meta.update(written="background", loop_wait_s=round(time.perf_counter() - t0, 3))
            self._pending = step, BackgroundWrite(
                write, f"step {step}", then=lambda: publish_temp_dir(self.root, tmp, step, keep_last=self.keep_last,
                                                                     meta=meta),
                on_failure=lambda: shutil.rmtree(tmp, ignore_errors=True))
            path = None
        else:
            meta["written"] = "blocking"
            path = await asyncio.to_thread(self._write, step, state, strategy_state, engine_version, meta)
            self._durable_step = step
        self.last_step = step
        self.last_seconds = time.perf_counter() - t0
        log.info("checkpoint %s %s %.2f s", path or f"of step {step}",
                 "prepared (written in the background) in" if background else "written in", self.last_seconds)
        return path

    def _fill_loop_part(self, tmp: Path, state: dict, engine_version: int) -> None:
        torch.save(state, tmp / "controller.pt")
        if engine_version > 0:
            src = self.weights_dir / f"v{engine_version}"
            if not (src / "config.json").is_file():
                raise CheckpointError(f"the engines' weights of version {engine_version} are not in {src}")
            link_or_copy_tree(src, tmp / "engine_weights")

    def _prepare(self, tmp: Path, state: dict, strategy_state: dict, engine_version: int):
        write = self.rank_states.prepare_rank_states(str(tmp), strategy_state)
        self._fill_loop_part(tmp, state, engine_version)
        return write

    def _write(self, step: int, state: dict, strategy_state: dict, engine_version: int, meta: dict) -> Path:
        def fill(tmp: Path) -> None:
            self._fill_loop_part(tmp, state, engine_version)
            self.rank_states.save_rank_states(str(tmp), strategy_state)

        return write_checkpoint(self.root, step, fill, keep_last=self.keep_last, meta=meta)
