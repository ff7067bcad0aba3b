"""The run settings a resumed run must share with the run that wrote its checkpoint.

:func:`run_settings` is what a checkpoint's manifest records (its ``run``); :func:`check_run_settings` compares
them at ``--resume``, before anything in the run directory changes.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from megarl.checkpoint.rank_state import is_reshardable
from megarl.errors import ConfigError

#: the run checkpoint's logger (megarl/checkpoint/run_checkpoint.py)
log = logging.getLogger("megarl.checkpoint.run_checkpoint")

#: run settings a resumed run must share with the checkpoint (name -> config path)
RUN_KEYS = {"batch_size": "trainer.batch_size", "group_size": "rollout.group_size", "eta": "rollout.eta",
            "recovery": "recovery.name", "seed": "trainer.seed", "tp": "parallel.tp", "pp": "parallel.pp",
            "ep": "parallel.ep", "distributed_optimizer": "parallel.use_distributed_optimizer",
            "dtype": "model.dtype"}
#: what a reshardable checkpoint lets a resumed run change (the trainer's parallel layout)
LAYOUT_KEYS = ("tp", "pp", "ep", "world_size")
#: HF config fields that fix the shapes of the saved model and optimizer state
MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size")


def check_run_settings(cfg, manifest: dict, step_dir: Path, world_size: int, hf_config: dict) -> None:
    """A resumed run must batch, gate, seed and recover like the run that wrote the checkpoint.

    The parallel layout (:data:`LAYOUT_KEYS`) may change when the checkpoint is reshardable
    (:func:`is_reshardable`); a per-rank one resumes only in its own layout. Checked before anything
    in the run directory changes, so a mismatch leaves it as it was.
    """
    saved = manifest.get("run", {})
    mine = run_settings(cfg, world_size, hf_config)
    free = LAYOUT_KEYS if is_reshardable(step_dir) else ()
    bad = [f"{RUN_KEYS.get(k, k)}={mine[k]} (checkpoint: {saved[k]})"
           for k in mine if k in saved and saved[k] != mine[k] and k not in free]
    if bad:
        how = ("resume with the run's own config (RUN_DIR/config.yaml); its parallel layout may change" if free else
               "resume with the run's own config (RUN_DIR/config.yaml) and trainer ranks (this checkpoint is "
               "in the per-rank format, which keeps its layout)")
        raise ConfigError(f"--resume: this run differs from the one that wrote {step_dir} in " + ", ".join(bad)
                          + f"; {how}")
    changed = [f"{k} {saved[k]} -> {mine[k]}" for k in free if k in saved and saved[k] != mine[k]]
    if changed:
        log.warning("resuming %s in another layout: %s (its state is re-cut for this one)", step_dir,
                    ", ".join(changed))


def run_settings(cfg, world_size: int, hf_config: dict) -> dict:
    """What :func:`check_run_settings` compares: RUN_KEYS, the trainer world size and the model's shape."""
    out: dict[str, Any] = {}
    for name, key in RUN_KEYS.items():
        section, field = key.split(".")
        out[name] = getattr(getattr(cfg, section), field)
    out["world_size"] = world_size
    out["model"] = {k: hf_config[k] for k in MODEL_KEYS if k in hf_config}
    return out
