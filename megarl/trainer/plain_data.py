"""Loading a file of plain data that megarl wrote (a checkpoint's parts, a trainer rank's shards): tensors and
containers of them only, never an object a pickle would build (megarl/checkpoint/files.py checks the files'
signatures before any of them is loaded)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megarl.errors import CheckpointError


def load_plain(path: str | os.PathLike) -> Any:
    """A checkpoint file of plain data (tensors, numbers, strings, lists, tuples, dicts), loaded with
    ``weights_only=True``: a file that would build any other object (a pickle that runs code) is refused, never
    run. CheckpointError names a missing, damaged or refused file."""
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} holds more than plain data and is refused, not loaded ({why}); megarl "
                              f"writes tensors, numbers, strings and containers of them only") from None
    except Exception as e:  # zip errors of a damaged file
        raise CheckpointError(f"{path} cannot be loaded ({type(e).__name__}: {e})") from e
