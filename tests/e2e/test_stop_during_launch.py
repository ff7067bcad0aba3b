"""A stop that reaches `megarl launch --launcher torchrun` while it starts the trainer exits 75 at every moment.

SIGUSR1 to the launch (what launch/slurm.sbatch's trap sends) at five moments of its start, each on a run that
would otherwise train 40 steps: before the trainer process exists (the launch still imports), right when it
starts torchrun, shortly after (torchrun importing, before its handler), a little later (the ranks starting,
before theirs) and later (the run in its preflight, model load or loop). Before, these ended with -10 (the
launch killed by the signal), 0 (the stop passed on to no trainer: the run trained to its end) or 246 (torchrun
or a rank killed before its handler).
Each run must end with 75 within its timeout, and leave no trainer process behind.
"""
import signal
import time

import psutil
import pytest
from test_preempt_torchrun import SMALL, finish, start

#: seconds after "starting trainer" appears in the launch's output (None: 1.0 s after the launch started)
MOMENTS = {"before the trainer exists": None, "at the trainer's start": 0.0, "torchrun importing": 0.8,
           "the ranks starting": 3.0, "later": 8.0}


def wait_for_text(log, text: str, proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"the launch exited ({proc.returncode}) before {text!r}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.01)


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_stop_during_the_launch_start_exits_75(ckpt, tmp_path, moment):
    run, log = tmp_path / "run", tmp_path / "launch.log"
    p = start(["launch", "--launcher", "torchrun", *SMALL, f"model.checkpoint={ckpt}", "trainer.total_steps=40",
               f"logging.output_dir={run}"], log)
    delay = MOMENTS[moment]
    if delay is None:
        time.sleep(1.0)
    else:
        wait_for_text(log, "starting trainer", p)
        time.sleep(delay)
    p.send_signal(signal.SIGUSR1)
    t0 = time.monotonic()
    code = finish(p, log, timeout=150)
    text = log.read_text()
    assert code == 75, f"{moment}: exit {code}\n{text[-4000:]}"
    print(f"{moment}: exit {code} {time.monotonic() - t0:.1f} s after the stop")
    if delay is None:
        assert "stopped before the trainer started" in text or "stopped on SIGUSR1" in text, text[-3000:]
    else:
        assert "the trainer stopped on SIGUSR1" in text, text[-3000:]
    assert not left_running(run), f"{moment}: left running: {left_running(run)}"


def left_running(run) -> list[str]:
    """The command lines of the processes of this run (its directory in their arguments) still there."""
    out = []
    for q in psutil.process_iter(["cmdline", "status"]):
        if q.info["status"] != psutil.STATUS_ZOMBIE and str(run) in " ".join(q.info["cmdline"] or ()):
            out.append(" ".join(q.info["cmdline"])[:100])
    return out
