"""Read back the history rows of an offline W&B run (``RUN/wandb/offline-run-*/run-*.wandb``).

The file is W&B's transaction log: a 7-byte header (``:W&B``, a 2-byte magic,
a version byte), then LevelDB-log framing (32 KiB blocks; each chunk has a
4-byte checksum, a 2-byte length and a type: 1 full, 2 first, 3 middle,
4 last), each record a ``wandb_internal_pb2.Record``. Reading the file is the
only way to see what an offline run kept without W&B's servers; if W&B changes
the format, ``test_the_reader_sees_what_wandb_wrote`` fails first.
"""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

_HEADER = 7
_BLOCK = 32 * 1024
_CHUNK = 7


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, partial, pos = [], b"", _HEADER
    while pos + _CHUNK <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _CHUNK])
        pos += _CHUNK
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left - _CHUNK
            continue
        chunk, pos = data[pos:pos + length], pos + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            out.append(partial + chunk)
    return out


def history(run_dir: Path, timeout_s: float = 60.0) -> list[dict]:
    """Every history row of the one offline run under ``run_dir/wandb``: {key: value}, W&B's own keys left out.

    ``run.finish()`` returns before W&B's service has written the file (seen: a 7-byte file, then the whole run a
    moment later), so this waits for the run's ``exit`` record, the last one W&B writes."""
    from wandb.proto import wandb_internal_pb2 as pb  # optional package, present in the test environment

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        recs = []
        try:
            for raw in records(path):
                rec = pb.Record()
                rec.ParseFromString(raw)
                recs.append(rec)
        except Exception:  # a record W&B is still writing: read again
            recs = []
        if any(r.WhichOneof("record_type") == "exit" for r in recs):
            break
        assert time.monotonic() < deadline, f"W&B wrote no exit record to {path} within {timeout_s} s"
        time.sleep(0.1)
    rows = []
    for rec in recs:
        if rec.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows
