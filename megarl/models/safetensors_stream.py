"""A ``.safetensors`` file written piece by piece, so that a writer can stop part-way (the disk copy of a version a
newer publish has superseded, megarl/rollout/disk_copy.py).

``safetensors.torch.save_file`` writes a whole file in one call that cannot be interrupted: a 61 GB copy of
Qwen3-30B-A3B holds its writer for minutes. :func:`save_file_stoppable` writes the same format (an 8-byte
little-endian header length, the JSON header padded with spaces to a multiple of 8, then every tensor's bytes
in header order) from the tensors' own memory in pieces of at most :data:`PIECE_BYTES`, asking ``should_stop()``
before each; a stopped write raises :class:`WriteStopped` and removes what it wrote. Files it writes are read by
``safetensors`` itself (tests/unit/test_safetensors_stream.py checks this against the installed version).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable

import torch

#: bytes written between two ``should_stop()`` questions
PIECE_BYTES = 64 << 20

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


class WriteStopped(Exception):
    """``should_stop()`` said stop before the file was complete (nothing is left of it)."""


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    order = sorted(tensors)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def save_file_stoppable(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None,
                        should_stop: Callable[[], bool] = lambda: False) -> None:
    """Write ``tensors`` (CPU tensors) to ``path`` in the safetensors format (module doc)."""
    head, order = _header(tensors, metadata)
    path = Path(path)
    try:
        with open(path, "wb") as f:
            f.write(head)
            for name in order:
                flat = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
                for start in range(0, flat.numel(), PIECE_BYTES):
                    if should_stop():
                        raise WriteStopped(f"stopped before tensor {name} was written")
                    f.write(memoryview(flat[start:start + PIECE_BYTES].numpy()))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
