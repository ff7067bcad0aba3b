"""The `logging` section of the configuration schema: where a run writes, how often it checkpoints, how it stops
(megarl/config/schema.py holds the rest; the same rules: one docstring per field, validated by
:mod:`megarl.config.loader`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from megarl.errors import ConfigError


@dataclass
class LoggingConfig:
    """Run outputs."""

    output_dir: str = ""
    """Run directory; empty = a new timestamped directory under runs/."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    progress: Literal["rich", "tqdm", "none"] = "rich"
    """Live progress display."""
    summary_every_s: float = 30.0
    """When stdout is not a terminal (a piped or logged run, where the progress display does not draw), print a one-line step summary at the first step, at most every this many seconds, and at the last step; 0 = every step, negative = never."""
    log_samples: int = 4
    """Trajectories per step written to RUN_DIR/samples.jsonl as decoded text (prompt, response, reward, answer, versions); 0 = none."""
    wandb: bool = False
    """Also log metrics to Weights & Biases (needs `pip install wandb`; offline when WANDB_API_KEY is not set)."""
    wandb_project: str = "megarl"
    """Weights & Biases project name."""
    save_every: int = 0
    """Checkpoint (RUN_DIR/checkpoints/step_N) every k steps (0 = by logging.save_every_s only); `megarl train --resume RUN_DIR` continues from the newest. A run also checkpoints at the end, on SIGTERM/SIGINT (then exits with code 75) and before an error stops it."""
    save_every_s: float = 1800.0
    """Also checkpoint at the first step boundary once this many seconds passed since the last checkpoint (or the start), so that a crash never loses more than about this much work (0 = off)."""
    keep_running_groups: bool = True
    """A checkpoint keeps the groups still running whole: finished trajectories, and partial ones with their tokens, per-token versions, logp_behav, routes and turn, which a resume continues (docs/guide.md, Preemption and stop signals). false: it keeps only their prompts, and a resume generates them again (counted in n_regenerated_after_resume and n_tokens_regenerated_after_resume): smaller checkpoints where running groups hold long answers with MoE routes, at the cost of the generation thrown away (`megarl bench --preemption` measures both)."""
    keep_last: int = 2
    """Checkpoints kept (the newest ones; 0 = all); a damaged_step_N directory a resume set aside is deleted once the oldest one kept is of step N or later."""
    async_save: bool = False
    """Write periodic checkpoints (logging.save_every, logging.save_every_s) in the background: at the step boundary each trainer rank copies its model, optimizer and strategy shards to host memory (its one extra copy of them until the write ends), then the run trains on while a thread writes them; the checkpoint appears (manifest, rename) only once every rank's part is on disk, so a kill during the write leaves the previous checkpoint the newest. The checkpoints at the end of a run, on a stop signal and before an error are written at once."""
    max_save_failures: int = 3
    """Periodic checkpoints (logging.save_every) that may fail in a row (disk full, I/O error) before the run stops; a failed one leaves nothing that looks valid, the previous one is kept and the next save tries again (>= 1; 1 = stop at the first failure)."""
    stop_grace_s: float = 90.0
    """Stop budget (> 0): from a stop signal (SIGTERM, SIGUSR1, SIGINT) on, the seconds the run may take to checkpoint and stop with exit code 75; every wait on that path (the dedicated scorer's state, an engine restart, engine shutdown) is cut to what is left of it, and what did not finish is reported in one line. Give the scheduler's warning (launch/slurm.sbatch's --signal=B:USR1@240, a partition's GraceTime) at least this plus 60 s (docs/guide.md, Preemption and stop signals); `megarl plan` refuses a layout whose checkpoint cannot be written within it."""
    file_umask: str = "077"
    """Octal umask of every file and directory the run creates (its run directory, checkpoints, samples, logs), set in `megarl train` and `megarl launch` and inherited by every process they start: 077 (the default) makes them 0700/0600, readable by this user only, also on a shared filesystem; 022 makes them readable by everyone (the umask of most shells)."""
    resume: str = ""
    """Run directory to continue from its newest valid checkpoint (`megarl train --resume RUN_DIR` sets it; launch plans pass it to every rank); the run keeps writing there."""


def apply_umask(logging_cfg: LoggingConfig) -> int:
    """Set this process's umask from ``logging.file_umask`` (its children inherit it); the previous umask."""
    try:
        mask = int(str(logging_cfg.file_umask), 8)
    except ValueError:
        mask = -1
    if not 0 <= mask <= 0o777:
        raise ConfigError(f"logging.file_umask={logging_cfg.file_umask!r} is not an octal umask: give three octal "
                          f"digits, e.g. logging.file_umask=077 (files 0600, directories 0700)")
    return os.umask(mask)
