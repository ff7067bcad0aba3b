"""The life of checkpoint directories under ``RUN_DIR/checkpoints``: publishing one, overwriting a step's
checkpoint so that a kill at any moment leaves a complete copy, the resume's view after a kill, pruning.

Names, and what a resume does with each::

    step_{n}                      a published checkpoint (resumed from when it verifies)
    .tmp-step_{n}-<pid>-<id>      being written; never read, removed on resume
    .new-step_{n}-<id>            an overwrite's new copy, complete and fsynced: taken as step n on resume
    .old-step_{n}-<id>            an overwrite's old copy, set aside: step n again on resume when nothing
                                  newer of step n is complete, else removed
    damaged_step_{n}[-<id>]       failed its check at a resume (kept for inspection, never read)

A first write of a step is one rename, ``.tmp-`` -> ``step_{n}``. An overwrite
(a resumed run passing a step it checkpointed before) is three, each followed
by an fsync of the directory: ``.tmp-`` -> ``.new-`` (the new copy is complete
from here on), ``step_{n}`` -> ``.old-``, ``.new-`` -> ``step_{n}``; then the
old copy is deleted. Between any two of them a complete copy of the step is
under a name the resume takes, so a kill anywhere loses at most the new copy
before it was complete (the old one then stays). :func:`settle_overwrites`
finishes (or, when the new copy is damaged, undoes) an interrupted overwrite;
:func:`find_latest_checkpoint` runs it before it looks.

:func:`prune` keeps the newest ``keep_last`` checkpoints; a ``damaged_step_{n}``
is deleted with the checkpoints older than those kept, counting as older than
a valid checkpoint of its own step (which a later attempt wrote).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

from megarl.checkpoint.files import MANIFEST, build_manifest, files_under, fsync_dir, fsync_file, verify_checkpoint
from megarl.errors import CheckpointError

log = logging.getLogger("megarl.checkpoint.run_checkpoint")

_STEP_DIR = re.compile(r"^step_(\d+)$")
_DAMAGED_DIR = re.compile(r"^damaged_step_(\d+)(?:-[0-9a-f]+)?$")
#: the names of a step's two copies while an overwrite swaps them (module doc)
OVERWRITE_PREFIXES = {"new": ".new-", "old": ".old-"}
_SWAPPING = re.compile(r"^\.(new|old)-step_(\d+)-[0-9a-f]+$")
_LEFTOVERS = (".tmp-", *OVERWRITE_PREFIXES.values())


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the published checkpoints under ``root``, oldest first (temp dirs excluded)."""
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(out)


def damaged_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the checkpoints a resume set aside as damaged, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _DAMAGED_DIR.match(p.name)))


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints, and the damaged ones not newer than the oldest kept
    (0 keeps all)."""
    if keep_last <= 0:
        return
    found = list_checkpoints(root)
    for _, path in found[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    if found:
        oldest_kept = found[-keep_last:][0][0]
        for n, path in damaged_checkpoints(root):
            if n <= oldest_kept:
                shutil.rmtree(path, ignore_errors=True)


def set_aside_newer(root: Path, step: int) -> list[Path]:
    """Rename the checkpoints newer than ``step`` (the one a resume continues from, so they failed their check)
    to ``damaged_step_{n}``: kept for inspection, but neither resumed from nor counted by :func:`prune`, which
    would otherwise keep them and delete the resumed run's valid checkpoints as they are written."""
    moved = []
    for n, path in list_checkpoints(root):
        if n > step:
            target = root / f"damaged_{path.name}"
            if target.exists():  # set aside before, by an earlier resume
                target = root / f"damaged_{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, target)
            log.warning("damaged checkpoint %s set aside as %s (not resumed from, not counted by keep_last)",
                        path, target.name)
            moved.append(target)
    return moved


def _newest_complete(copies: list[Path]) -> Path | None:
    """The most recently written of ``copies`` that verifies (None when none does)."""
    complete = []
    for path in copies:
        try:
            complete.append((float(verify_checkpoint(path).get("created", 0.0)), path.name, path))
        except CheckpointError as e:
            log.warning("%s is not a complete checkpoint, not resumed from: %s", path, e)
    return max(complete)[2] if complete else None


def settle_overwrites(root: Path) -> None:
    """Finish the overwrites a kill interrupted: a complete new copy becomes ``step_{n}`` (the old one is set
    aside as the writer would have), else a complete old copy is ``step_{n}`` again when there is none."""
    if not root.is_dir():
        return
    swapping: dict[int, dict[str, list[Path]]] = {}
    for p in root.iterdir():
        if p.is_dir() and (m := _SWAPPING.match(p.name)):
            swapping.setdefault(int(m.group(2)), {"new": [], "old": []})[m.group(1)].append(p)
    for step, copies in sorted(swapping.items()):
        final = root / f"step_{step}"
        new = _newest_complete(copies["new"])
        if new is not None:
            if final.exists():
                os.rename(final, root / f"{OVERWRITE_PREFIXES['old']}step_{step}-{uuid.uuid4().hex[:8]}")
            os.rename(new, final)
            log.warning("a kill interrupted the overwrite of %s: its new copy is now the step's checkpoint", final)
        elif not final.exists() and (old := _newest_complete(copies["old"])) is not None:
            os.rename(old, final)
            log.warning("a kill interrupted the overwrite of %s before its new copy was complete: the old copy "
                        "is the step's checkpoint again", final)
        fsync_dir(root)


def remove_temp_dirs(root: Path) -> None:
    """Leftovers of writes a crash interrupted (after :func:`settle_overwrites` took what it keeps); never part
    of a checkpoint."""
    if root.is_dir():
        settle_overwrites(root)
        for p in root.iterdir():
            if p.name.startswith(_LEFTOVERS):
                shutil.rmtree(p, ignore_errors=True)


def _overwrite(root: Path, tmp: Path, step: int) -> None:
    """Replace ``root/step_{step}`` by the complete ``tmp`` in the rename sequence of the module doc; an error
    (not a kill) on the way leaves the step's earlier checkpoint as it was."""
    token = uuid.uuid4().hex[:8]
    final = root / f"step_{step}"
    new = root / f"{OVERWRITE_PREFIXES['new']}step_{step}-{token}"
    old = root / f"{OVERWRITE_PREFIXES['old']}step_{step}-{token}"
    os.rename(tmp, new)
    try:
        fsync_dir(root)  # from here a resume takes the new copy
        os.rename(final, old)
        try:
            fsync_dir(root)
            os.rename(new, final)
        except BaseException:
            os.rename(old, final)
            raise
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(root: str | Path, step: int, fill: Callable[[Path], None], *, keep_last: int = 0,
                     meta: dict | None = None) -> Path:
    """Atomically publish ``root/step_{step}``: ``fill(tmp_dir)`` writes the files, then manifest, fsync, rename
    (or the overwrite's renames when the step has a checkpoint already: a resumed run passing its step)."""
    tmp = new_temp_dir(root, step)
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_temp_dir(root, tmp, step, keep_last=keep_last, meta=meta)


def new_temp_dir(root: str | Path, step: int) -> Path:
    """A fresh ``root/.tmp-step_{step}-*`` to fill (never read as a checkpoint; removed on resume)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step_{step}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish_temp_dir(root: str | Path, tmp: Path, step: int, *, keep_last: int = 0, meta: dict | None = None) -> Path:
    """The second half of :func:`write_checkpoint`: ``tmp``'s manifest, fsync, rename, prune; ``tmp`` is removed
    when this fails."""
    root = Path(root)
    final = root / f"step_{step}"
    try:
        manifest = build_manifest(tmp, {"step": step, "created": time.time(), **(meta or {})})
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        for p in files_under(tmp):
            fsync_file(p)
        for d in sorted({p.parent for p in files_under(tmp)}, key=lambda d: -len(d.parts)):
            fsync_dir(d)
        if final.exists():
            _overwrite(root, tmp, step)
        else:
            os.rename(tmp, final)
            fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep_last)
    return final


def find_latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest checkpoint of ``run_dir`` whose files match its manifest, after settling overwrites a kill
    interrupted; CheckpointError when there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume {run_dir}: no such run directory")
    settle_overwrites(run_dir / "checkpoints")
    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        raise CheckpointError(f"--resume {run_dir}: no checkpoint in {run_dir / 'checkpoints'} (checkpoints are "
                              f"written every logging.save_every steps and at the end of a run)")
    problems = []
    for _, path in reversed(found):
        try:
            verify_checkpoint(path)
            if problems:
                log.warning("resuming from %s; newer checkpoints are damaged: %s", path, "; ".join(problems))
            return path
        except CheckpointError as e:
            problems.append(str(e))
    raise CheckpointError(f"--resume {run_dir}: no valid checkpoint: " + "; ".join(problems))
