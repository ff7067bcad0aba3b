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

The trainer's and the strategy's tensors are stored under their global names and shapes, so a run
resumes in another parallel layout (TP, PP, EP, DP and the number of trainer ranks; not the kind of
optimizer, the dtype or the run's batching, checked by :func:`check_run_settings`). A checkpoint of
the earlier per-rank format (``trainer/rank{r}.pt``: ``torch.save`` of each rank's state dicts) still
loads, in the layout that wrote it only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
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
from megarl.checkpoint.writer import BackgroundWrite, torch_save_errors
from megarl.errors import CheckpointError, ConfigError
from megarl.trainer.dist_state import STATE_FILE, load_reshardable, prepare_reshardable
from megarl.trainer.param_state import load_strategy_state, prepare_strategy_state
from megarl.trainer.plain_data import load_plain

#: the directory and manifest functions are megarl/checkpoint/dirs.py's and checkpoint_files.py's; callers
#: import them from here, with the state, as one API of run checkpoints
__all__ = ["MANIFEST", "Checkpointer", "SingleRankStates", "build_manifest", "capture_rng", "check_run_settings",
           "find_latest_checkpoint", "is_reshardable", "link_or_copy_tree", "list_checkpoints", "load_file",
           "load_rank_state",
           "prune", "read_manifest", "remove_temp_dirs", "restore_rng", "rewind_run_logs", "run_settings",
           "save_rank_state", "set_aside_newer", "verify_checkpoint", "write_checkpoint"]

log = logging.getLogger("megarl.checkpoint.run_checkpoint")

#: run settings a resumed run must share with the checkpoint (name -> config path)
RUN_KEYS = {"batch_size": "trainer.batch_size", "group_size": "rollout.group_size", "eta": "rollout.eta",
            "recovery": "recovery.name", "seed": "trainer.seed", "tp": "parallel.tp", "pp": "parallel.pp",
            "ep": "parallel.ep", "distributed_optimizer": "parallel.use_distributed_optimizer",
            "dtype": "model.dtype"}
#: what a reshardable checkpoint lets a resumed run change (the trainer's parallel layout)
LAYOUT_KEYS = ("tp", "pp", "ep", "world_size")
#: HF config fields that fix the shapes of the saved model and optimizer state
MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size")


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


def prepare_rank_state(step_dir: str | Path, trainer, strategy_state: dict, *, background: bool = False):
    """Prepare this rank's trainer (trainer/) and strategy (strategy/) state; a collective of every rank. Returns
    ``write(group)``, which writes them (megarl/checkpoint/writer.py: in the background over the checkpoint group)."""
    step_dir = Path(step_dir)
    # torch's CheckpointException is a BaseException: made a CheckpointError here
    with torch_save_errors(f"the trainer's state in {step_dir}", str(step_dir)):
        trainer_write = prepare_reshardable(trainer, str(step_dir / "trainer"), background=background)
        strategy_write = prepare_strategy_state(trainer, strategy_state, str(step_dir / "strategy"),
                                                background=background)

    def write(group) -> None:
        with torch_save_errors(f"the trainer's state in {step_dir}", str(step_dir)):
            trainer_write(group)
            strategy_write(group)

    return write


def save_rank_state(step_dir: str | Path, trainer, strategy_state: dict) -> None:
    """The trainer's (trainer/) and the strategy's (strategy/) state, reshardable, now; a collective of every rank."""
    prepare_rank_state(step_dir, trainer, strategy_state)(None)


def load_rank_state(step_dir: str | Path, trainer, strategy) -> None:
    """Inverse of :func:`save_rank_state` into this run's layout (a per-rank checkpoint: the same layout only)."""
    step_dir = Path(step_dir)
    load_reshardable(trainer, str(step_dir / "trainer"))
    strategy.load_state_dict(load_strategy_state(trainer, str(step_dir / "strategy")))


def is_reshardable(step_dir: str | Path) -> bool:
    """Whether the checkpoint's trainer state is the layout-free one (a resume may change TP/PP/EP/DP)."""
    return (Path(step_dir) / "trainer" / STATE_FILE).is_file()


class SingleRankStates:
    """The trainer's and strategy's files of a run with one trainer rank: this process writes and reads them.

    With several ranks :class:`~megarl.loop.spmd.DrivingTrainer` takes its place: every rank does its own.
    """

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def save_rank_states(self, step_dir: str, strategy_state: dict) -> None:
        save_rank_state(step_dir, self.trainer, strategy_state)

    def prepare_rank_states(self, step_dir: str, strategy_state: dict):
        return prepare_rank_state(step_dir, self.trainer, strategy_state, background=True)

    def load_rank_states(self, step_dir: str, strategy) -> None:
        load_rank_state(step_dir, self.trainer, strategy)


def load_file(path: str | Path) -> Any:
    """A checkpoint file of plain data (megarl/trainer/plain_data.py's ``load_plain``); CheckpointError naming a
    missing, damaged or refused one."""
    return load_plain(path)


def check_run_settings(cfg, manifest: dict, step_dir: Path, world_size: int, hf_config: dict) -> None:
    """A resumed run must batch, gate, seed and recover like the run that wrote the checkpoint.

    The parallel layout (:data:`LAYOUT_KEYS`) may change when the checkpoint is reshardable
    (:func:`is_reshardable`); a per-rank one resumes only in its own layout. Checked before anything
    in the run directory changes, so a mismatch leaves it as it was.
    """
    saved = manifest.get("run", {})
    mine = run_settings(cfg, world_size, hf_config)
    free = LAYOUT_KEYS if is_reshardable(step_dir) else ()
    bad = [f"{RUN_KEYS.get(k, k)}={mine[k]} (checkpoint: {saved[k]})"
           for k in mine if k in saved and saved[k] != mine[k] and k not in free]
    if bad:
        how = ("resume with the run's own config (RUN_DIR/config.yaml); its parallel layout may change" if free else
               "resume with the run's own config (RUN_DIR/config.yaml) and trainer ranks (this checkpoint is "
               "in the per-rank format, which keeps its layout)")
        raise ConfigError(f"--resume: this run differs from the one that wrote {step_dir} in " + ", ".join(bad)
                          + f"; {how}")
    changed = [f"{k} {saved[k]} -> {mine[k]}" for k in free if k in saved and saved[k] != mine[k]]
    if changed:
        log.warning("resuming %s in another layout: %s (its state is re-cut for this one)", step_dir,
                    ", ".join(changed))


def run_settings(cfg, world_size: int, hf_config: dict) -> dict:
    """What :func:`check_run_settings` compares: RUN_KEYS, the trainer world size and the model's shape."""
    out: dict[str, Any] = {}
    for name, key in RUN_KEYS.items():
        section, field = key.split(".")
        out[name] = getattr(getattr(cfg, section), field)
    out["world_size"] = world_size
    out["model"] = {k: hf_config[k] for k in MODEL_KEYS if k in hf_config}
    return out


def _journal_line(raw: bytes, key: str) -> tuple[int | None, str]:
    """(the record's ``key``, absent: 0) of one journal line; (None, why) when the line is damaged."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except ValueError:  # also a last line a kill cut short
        return None, "not JSON"
    if not isinstance(rec, dict):
        return None, f"not a JSON object: {raw[:40].decode('utf-8', 'replace')}"
    value = rec.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool):
        return None, f"{key} is not an integer: {json.dumps(value)[:40]}"
    return value, ""


def _filter_jsonl(path: Path, key: str, upto: int) -> list[str]:
    """Keep the lines of ``path`` whose ``key`` is at most ``upto``; returns its damaged lines, named (moved to
    ``NAME.damaged``, never parsed again)."""
    if not path.is_file():
        return []
    kept, damaged, named = [], [], []
    for n, raw in enumerate(path.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        value, why = _journal_line(raw, key)
        if value is None:
            damaged.append(raw)
            named.append(f"{path.name} line {n} ({why})")
        elif value <= upto:
            kept.append(raw)
    if damaged:
        with path.with_name(path.name + ".damaged").open("ab") as f:
            f.write(b"".join(line + b"\n" for line in damaged))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in kept))
    os.replace(tmp, path)
    return named


def rewind_run_logs(run_dir: Path, manifest: dict) -> None:
    """Drop log lines of work the checkpoint does not contain (steps after it, groups accepted after it).

    A damaged line (not UTF-8, not a JSON object, its step or count not an integer; a kill's cut-short last
    line too) is skipped and kept aside in ``NAME.damaged``; one warning counts and names them."""
    step, accepted = int(manifest["step"]), int(manifest["accepted_total"])
    damaged = [line for name, key, upto in (("metrics", "step", step), ("trained_ids", "step", step),
                                            ("samples", "step", step), ("accepted", "accepted_total", accepted))
               for line in _filter_jsonl(run_dir / f"{name}.jsonl", key, upto)]
    if damaged:
        shown = "; ".join(damaged[:5]) + (f"; and {len(damaged) - 5} more" if len(damaged) > 5 else "")
        log.warning("resume: %d damaged journal line(s) skipped (moved to NAME.jsonl.damaged in %s): %s",
                    len(damaged), run_dir, shown)


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
