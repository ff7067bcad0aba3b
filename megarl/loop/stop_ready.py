"""When a launched trainer can take a stop signal: the ready file beside the stop marker.

`megarl launch` passes a stop on to the trainer's launcher process (torchrun, srun, mpirun) as SIGUSR1, which
passes it on to every trainer rank. A process that has not installed its handler yet dies of that signal:
torchrun installs its own just before it starts the ranks, and each rank its early latch in its first lines
(megarl/stop_protocol.py). So the launcher holds a stop that comes while the trainer starts and delivers it
once trainer rank 0 wrote the ready file: rank 0 writes it once every rank joined the process group, which each
does after its latch is installed, and torchrun installed its handler before it started them. From then on a
signal is latched by every rank and the run stops with 75 at its next phase (megarl/train.py) or step boundary.

The file is ``MEGARL_STOP_MARKER`` + ``.ready`` (the marker's directory is the run's, shared by every node of
a job); `megarl launch` removes a stale one before it starts anything. Standard library only: imported before
torch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from megarl.stop_protocol import stop_marker_path

READY_SUFFIX = ".ready"


def ready_path(marker: Path) -> Path:
    """The ready file of the stop marker ``marker``."""
    return marker.with_name(marker.name + READY_SUFFIX)


def announce_stop_ready(env=None) -> Path | None:
    """Trainer rank 0, once every rank catches the stop signals: write the ready file (no marker named: nothing)."""
    marker = stop_marker_path(env)
    if marker is None:
        return None
    path = ready_path(marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid()}) + "\n")
    os.replace(tmp, path)
    return path
