"""Rewinding a run's journals to a checkpoint on resume: log lines of later work dropped, damaged lines set aside.

``accepted.jsonl`` lines carry the ``accepted_total`` after their accept, the other journals their ``step``
(megarl/checkpoint/run_checkpoint.py: what a checkpoint contains); megarl/checkpoint/resume.py calls
:func:`rewind_run_logs`.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

#: the run checkpoint's logger (megarl/checkpoint/run_checkpoint.py)
log = logging.getLogger("megarl.checkpoint.run_checkpoint")


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
