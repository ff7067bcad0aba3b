"""`megarl trust-checkpoint RUN_DIR/checkpoints/step_N`: sign a checkpoint its run's key did not sign.

A resume loads only checkpoints whose manifest is signed with the run's checkpoint key
(megarl/isolation/run_key.py). Two kinds are not: one written by a megarl from before checkpoints were signed, and one
changed after it was written. This command is for the first kind, by a user who knows where the files came
from: it checks every file against the manifest's sha256 and size (a damaged checkpoint is refused, naming the
file), loads none of them, and signs the manifest with the run's key (made when the run has none). Whatever the
files hold is trusted from then on; loads are still plain data only (no pickle runs code).
"""
from __future__ import annotations

import json
from pathlib import Path

from megarl.errors import CheckpointError


def register(sub) -> None:
    p = sub.add_parser("trust-checkpoint", help="sign a checkpoint of an earlier megarl with the run's key")
    p.add_argument("checkpoint", help="a checkpoint directory: RUN_DIR/checkpoints/step_N")
    p.set_defaults(func=run)


def trust(step_dir: str | Path) -> Path:
    """Check ``step_dir``'s files against its manifest and sign the manifest; the manifest's path."""
    from megarl.checkpoint.files import MANIFEST, check_files, read_manifest, run_dir_of
    from megarl.isolation.run_key import checkpoint_key, sign

    step_dir = Path(step_dir)
    manifest = read_manifest(step_dir)
    check_files(step_dir, manifest)
    signed = sign(manifest, checkpoint_key(run_dir_of(step_dir), create=True))
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(signed, indent=1) + "\n")
    tmp.replace(step_dir / MANIFEST)
    return step_dir / MANIFEST


def run(args) -> int:
    if not Path(args.checkpoint).is_dir():
        raise CheckpointError(f"{args.checkpoint} is not a directory: give a checkpoint, RUN_DIR/checkpoints/step_N")
    print(f"signed {trust(args.checkpoint)} with the run's checkpoint key")
    return 0
