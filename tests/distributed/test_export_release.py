"""A publish that fails on rank 0 while it packs the export releases the follower trainer rank.

The export is a collective (each tensor gathered over the trainer ranks); rank 0
drains the rest of it when its consumer fails, so the follower finishes the
export at once instead of waiting in a gather until the group's timeout
(tests/distributed/run_export_release.py).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from megarl.rollout.client import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "run_export_release.py"
RELEASE_BOUND_S = 10.0  # well under the script's 20 s group timeout


def test_a_failed_export_on_rank_0_releases_the_follower(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(SCRIPT), "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lead, follower = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert lead["error"].startswith("RuntimeError: device bucket does not fit"), lead
    assert not lead["disk_copy"], "a failed prepare starts no disk copy"
    assert follower["error"] is None, f"the follower was left in the export's gathers: {follower}"
    assert follower["released_s"] < RELEASE_BOUND_S, follower
    assert lead["n_yielded"] == follower["n_yielded"] == 8, "both ranks went through every gather"
