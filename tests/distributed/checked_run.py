"""Run a torchrun (or plain python) phase of a distributed test from the repository root; fail with its output."""
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_checked(cmd: list[str], timeout: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
