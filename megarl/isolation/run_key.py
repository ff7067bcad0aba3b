"""The run's own key, and the HMAC with which the run signs what it writes for itself to read back.

A resumed run trusts its checkpoints (they restore the trainer, the replay
buffer, the RNG) and `megarl launch` trusts the stop marker (it turns an exit
into a requeue). Anything that can write the run directory could forge them,
and a manifest's sha256 stops nothing, since the forger recomputes it. So the
run signs them with HMAC-SHA256 under a key that no user code can read:

* the **checkpoint key** lies in ``RUN_DIR/.megarl-run/checkpoint.key`` (mode
  0600 in a directory of mode 0700, owned by the user that runs the trainer),
  made by the run's first checkpoint and read again by every resume, also by a
  requeued job; agent commands and sandboxed code never see the run directory
  (megarl/isolation/process_isolation.py), other users cannot read it. Copy it with the
  checkpoints to resume or export them elsewhere;
* the **stop key** (``MEGARL_STOP_KEY``) is fresh per `megarl launch` and held
  in memory only (megarl/isolation/secret_env.py): the launcher and trainer rank 0.

:func:`sign` and :func:`signed_by` take a JSON object and its ``mac`` field:
the MAC covers the object's canonical JSON (sorted keys, no spaces) without
``mac``.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from megarl.errors import CheckpointError
from megarl.isolation.secret_env import not_private

KEY_DIR = ".megarl-run"
CHECKPOINT_KEY = "checkpoint.key"
MAC_FIELD = "mac"


def _canonical(obj: dict) -> bytes:
    return json.dumps({k: v for k, v in obj.items() if k != MAC_FIELD}, sort_keys=True,
                      separators=(",", ":")).encode()


def sign(obj: dict, key: bytes) -> dict:
    """``obj`` with its ``mac`` (HMAC-SHA256 of its canonical JSON under ``key``)."""
    return {**obj, MAC_FIELD: hmac.new(key, _canonical(obj), hashlib.sha256).hexdigest()}


def signed_by(obj: dict, key: bytes) -> bool:
    """Whether ``obj`` carries a ``mac`` that ``key`` made for exactly this content."""
    mac = obj.get(MAC_FIELD)
    if not isinstance(mac, str):
        return False
    return hmac.compare_digest(mac, hmac.new(key, _canonical(obj), hashlib.sha256).hexdigest())


def key_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / KEY_DIR / CHECKPOINT_KEY


def checkpoint_key(run_dir: str | os.PathLike, *, create: bool = False) -> bytes:
    """The run's checkpoint key (module doc); made when ``create`` and there is none. CheckpointError when it is
    missing (and not to be made) or readable by others."""
    path = key_path(run_dir)
    if create and not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process of the run made it first
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
    try:
        st = os.stat(path)
        text = path.read_text().strip()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the run's checkpoints are signed with the key kept there, and "
                              f"without it none can be trusted. Copy it from the run directory that wrote them "
                              f"(RUN_DIR/{KEY_DIR}/{CHECKPOINT_KEY})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the run's checkpoint key ({e})") from None
    if problem := not_private(st):
        raise CheckpointError(f"{path} {problem}: `chmod 600` it if nobody else could have read it")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise CheckpointError(f"{path} does not hold a key (64 hex digits); it was damaged or replaced")
    return key
