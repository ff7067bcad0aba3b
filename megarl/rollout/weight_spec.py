"""Names, shapes and dtypes of weight updates, and the check that an update fits an engine.

Engines check an update against the checkpoint they were started from *before*
loading any tensor, so a checkpoint of another model (other hidden size, other
layer count) is refused with an error naming the first mismatched tensor and
the engine keeps serving its old weights. Names are HF checkpoint names
(``model.layers.0.self_attn.q_proj.weight``), the format both backends load.
No vLLM import here: the trainer side uses this module too.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

from megarl.errors import CheckpointError, EngineError

#: (name, shape, dtype) with dtype as torch spells it without "torch." ("float32", "bfloat16").
TensorSpec = tuple[str, list[int], str]

# safetensors header dtype codes -> torch dtype names
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(named_tensors: Iterable[tuple[str, object]]) -> list[TensorSpec]:
    """Specs of ``(name, tensor)`` pairs, e.g. to announce a broadcast to the engines."""
    return [(name, list(t.shape), dtype_name(t.dtype)) for name, t in named_tensors]


def safetensors_files(checkpoint_dir: str | Path) -> list[Path]:
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {checkpoint_dir}")
    return files


def read_checkpoint_specs(checkpoint_dir: str | Path) -> dict[str, tuple[list[int], str]]:
    """``name -> (shape, dtype)`` of every tensor in a safetensors checkpoint, from headers only."""
    specs: dict[str, tuple[list[int], str]] = {}
    for path in safetensors_files(checkpoint_dir):
        with open(path, "rb") as f:
            try:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            except (struct.error, ValueError) as e:
                raise CheckpointError(f"{path}: not a safetensors file ({e})") from e
        for name, meta in header.items():
            if name != "__metadata__":
                specs[name] = (list(meta["shape"]), _ST_DTYPES.get(meta["dtype"], meta["dtype"]))
    return specs


def read_config(checkpoint_dir: str | Path) -> dict:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{checkpoint_dir} has no config.json; pass an HF-format checkpoint directory")
    return json.loads(path.read_text())


def tied_optional_names(config: dict) -> set[str]:
    """Names an update may carry or omit: with tied embeddings HF checkpoints drop ``lm_head.weight``."""
    return {"lm_head.weight"} if config.get("tie_word_embeddings") else set()


def check_update_specs(reference: dict[str, tuple[list[int], str]], update: Iterable[TensorSpec],
                       optional: set[str] = frozenset(), source: str = "update") -> None:
    """Raise EngineError unless ``update`` has exactly the reference's tensors, with the same shapes.

    dtypes may differ (a bf16 trainer may update an fp32 engine: the loaders cast) but must be
    floating point. ``optional`` names may be present or absent (tied ``lm_head.weight``).
    """
    seen: set[str] = set()
    for name, shape, dtype in update:
        seen.add(name)
        if name not in reference:
            if name in optional:
                continue
            raise EngineError(f"{source}: tensor {name!r} does not exist in the engine's model "
                              f"(checkpoint of another architecture or size?)")
        ref_shape, _ = reference[name]
        if list(shape) != list(ref_shape):
            raise EngineError(f"{source}: tensor {name!r} has shape {list(shape)}, the engine's model "
                              f"has {list(ref_shape)}; weights not updated")
        if not dtype.startswith(("float", "bfloat")):
            raise EngineError(f"{source}: tensor {name!r} has dtype {dtype}, expected floating point")
    missing = sorted(set(reference) - seen - optional)
    if missing:
        raise EngineError(f"{source}: lacks {len(missing)} tensor(s) of the engine's model, e.g. "
                          f"{missing[0]!r}; weights not updated")
