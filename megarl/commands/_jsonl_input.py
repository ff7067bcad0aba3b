"""The `{"input_ids": [...]}` JSONL input shared by `megarl logprobs` and `megarl generate`."""
from __future__ import annotations

import json
from pathlib import Path

from megarl.errors import InputError


def read_input_ids(path: str, max_len: int | None = None, vocab_size: int | None = None) -> list[list[int]]:
    """Every line's ``input_ids``, checked before any model is built (errors name the file and line)."""
    if not Path(path).is_file():
        raise InputError(f"input file {path} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["input_ids"]
            except (ValueError, KeyError, TypeError) as e:
                raise InputError(f"{path}:{lineno}: expected a JSON object with 'input_ids' ({e})") from e
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InputError(f"{path}:{lineno}: input_ids must be a list of integers")
            if max_len is not None and len(ids) > max_len:
                raise InputError(f"{path}:{lineno}: {len(ids)} tokens > max_position_embeddings {max_len}")
            if vocab_size is not None:
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    raise InputError(f"{path}:{lineno}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
            rows.append(ids)
    return rows
