"""The files of one checkpoint directory: its manifest (size and sha256 of every file), the check of it, and
the durable writes and hard-link copies the checkpoint code builds on (megarl/checkpoint/run_checkpoint.py has the
layout).

A directory is a complete checkpoint exactly when its manifest is readable, signed with the run's checkpoint key
(megarl/isolation/run_key.py: ``RUN_DIR/.megarl-run/checkpoint.key``), and every file it lists has the listed size and
sha256; :func:`verify_checkpoint` is that test, and every rule of megarl/checkpoint/dirs.py (which copy a resume
takes) rests on it. A file changed after the run wrote it, by anything that could not read the key, fails it
by name before anything of the checkpoint is loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from megarl.errors import CheckpointError
from megarl.isolation.run_key import checkpoint_key, key_path, sign, signed_by

MANIFEST = "manifest.json"
FORMAT = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def link_or_copy_tree(src: Path, dst: Path) -> None:
    """``dst`` gets the files of ``src``: hard links where the filesystem allows (files are never rewritten
    in place)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in files_under(src):
        target = dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)


def run_dir_of(step_dir: Path) -> Path:
    """The run directory of a checkpoint directory (``RUN_DIR/checkpoints/<name>``)."""
    return Path(step_dir).absolute().parent.parent


def build_manifest(root: Path, meta: dict) -> dict:
    """The signed manifest of the files under ``root``, a (temporary) directory in ``RUN_DIR/checkpoints``."""
    files = {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in files_under(root) if p.name != MANIFEST or p.parent != root}
    return sign({"format": FORMAT, **meta, "files": files}, checkpoint_key(run_dir_of(root), create=True))


def read_manifest(step_dir: Path) -> dict:
    path = step_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {step_dir} is not a complete checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path} has no 'files' table")
    return manifest


def verify_checkpoint(step_dir: str | Path) -> dict:
    """The manifest of ``step_dir`` after checking every file it lists; CheckpointError names the first bad file."""
    step_dir = Path(step_dir)
    manifest = read_manifest(step_dir)
    if not signed_by(manifest, checkpoint_key(run_dir_of(step_dir))):
        raise CheckpointError(f"{step_dir / MANIFEST} is not signed with this run's key "
                              f"({key_path(run_dir_of(step_dir))}): it was changed after the run wrote it, or "
                              f"written by another run or an older megarl; it is not loaded. A checkpoint of an "
                              f"older megarl whose origin you know: `megarl trust-checkpoint {step_dir}`")
    check_files(step_dir, manifest)
    return manifest


def check_files(step_dir: Path, manifest: dict) -> None:
    """Every file ``manifest`` lists is in ``step_dir`` with its size and sha256; CheckpointError names the first
    that is not."""
    for rel, want in sorted(manifest["files"].items()):
        path = step_dir / rel
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (listed in {step_dir / MANIFEST})")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"{path} has {size} bytes, the manifest says {want['size']}: truncated or corrupt")
        if sha256_file(path) != want["sha256"]:
            raise CheckpointError(f"{path} does not match its sha256 in {step_dir / MANIFEST}: corrupt")
