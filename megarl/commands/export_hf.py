"""`megarl export-hf RUN_DIR/checkpoints/step_N OUT`: a run checkpoint's policy as an HF model directory.

The trainer's part of a checkpoint is Megatron's own layout; this command builds the trainer the run
used (its saved ``RUN_DIR/config.yaml``: model, optimizer kind, dtype), loads that state and writes
what ``RUN_DIR/final`` holds at the end of a run: ``config.json``, ``model.safetensors`` (the same
Megatron -> HF conversion the engines receive) and the run's tokenizer, so the directory serves with
vLLM or ``AutoModelForCausalLM`` as it is. A reshardable checkpoint (megarl/trainer/dist_state.py,
whatever layout wrote it) is exported by one process, or by W processes as W data-parallel ranks
(TP, PP and EP 1). One of the earlier per-rank format (``trainer/rank{r}.pt``) of W trainer ranks
needs W processes of its own layout: ``torchrun --nproc_per_node W -m megarl.cli export-hf ...``.
"""
from __future__ import annotations

import json
from pathlib import Path

from megarl.errors import CheckpointError, ConfigError


def register(sub) -> None:
    p = sub.add_parser("export-hf", help="write a run checkpoint's policy as an HF model directory (with tokenizer)")
    p.add_argument("checkpoint", help="a checkpoint directory: RUN_DIR/checkpoints/step_N")
    p.add_argument("output", help="the HF model directory to write")
    p.set_defaults(func=run)


def run(args) -> int:
    out = export_hf(args.checkpoint, args.output)
    if out is not None:
        print(f"wrote {out} (step {read_step(Path(args.checkpoint))})")
    return 0


def read_step(step_dir: Path) -> int:
    from megarl.checkpoint.run_checkpoint import read_manifest

    return int(read_manifest(step_dir)["step"])


def export_hf(checkpoint: str | Path, output: str | Path) -> Path | None:
    """Export ``checkpoint`` to ``output``; returns ``output`` on trainer rank 0 (None on the others)."""
    from megarl.builder import build_trainer, load_run_config  # Megatron: only when the command runs
    from megarl.checkpoint.rank_state import is_reshardable
    from megarl.checkpoint.run_checkpoint import verify_checkpoint
    from megarl.preflight import ensure_checkpoint
    from megarl.tokenizer import RunTokenizer
    from megarl.trainer.parallel import init_ranks

    step_dir = Path(checkpoint)
    run_dir = step_dir.parent.parent
    config = run_dir / "config.yaml"
    if not (step_dir / "trainer").is_dir():
        raise CheckpointError(f"{step_dir} is not a run checkpoint (no trainer/ in it); give "
                              f"RUN_DIR/checkpoints/step_N")
    if not config.is_file():
        raise ConfigError(f"{config} is missing: export-hf builds the trainer from the run's saved config "
                          f"(a checkpoint directory must stay at RUN_DIR/checkpoints/step_N)")
    verify_checkpoint(step_dir)
    reshardable = is_reshardable(step_dir)
    n_ranks = len(list((step_dir / "trainer").glob("rank*.pt")))
    rank, world = init_ranks()
    if not reshardable and world != n_ranks:
        raise CheckpointError(f"{step_dir} was written by {n_ranks} trainer ranks; export it with as many "
                              f"processes: torchrun --nproc_per_node {n_ranks} -m megarl.cli export-hf "
                              f"{step_dir} {output}")
    cfg = load_run_config(config)
    if reshardable:  # read into plain data parallelism, whatever the run's layout was
        cfg.parallel.tp = cfg.parallel.pp = cfg.parallel.ep = 1
        cfg.parallel.sequence_parallel = False
    base = ensure_checkpoint(cfg)
    trainer = build_trainer(cfg, base)
    trainer.load_state(str(step_dir / "trainer"))
    trainer.save_hf_checkpoint(str(output))
    if rank != 0:
        return None
    vocab_size = int(json.loads((base / "config.json").read_text())["vocab_size"])
    RunTokenizer.load(cfg.model, cfg.rollout, cfg.data, vocab_size=vocab_size).save(Path(output))
    return Path(output)
