"""Stop signals through the real torchrun, the parts tests/e2e/test_fault_schedule_launch.py's combined run does not
make: a stop before the loop (during the imports, during the engine start and model load) exits 75 with nothing
checkpointed, and the same command then runs; a launched engine role exits 75 on a stop signal. The helpers here
(the trainer ranks under a launch, their environments, the checkpoints) serve that combined run too, which stops
`megarl launch --launcher torchrun` with 2 trainer ranks by SIGTERM and by a SIGUSR1 to rank 1 alone, resumes and
checks nothing was lost or trained twice.
"""
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
from conftest import ENV, MEGARL, ROOT
from test_resume import jsonl, wait_for

SMALL = ["--config", "configs/tiny_cpu.yaml", "rollout.backend=hf", "trainer.batch_size=32", "rollout.group_size=8",
         "logging.progress=none", "logging.tensorboard=false", "eval.path=", "logging.save_every=0"]


def start(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([*MEGARL, *args], cwd=ROOT, env=env or ENV, start_new_session=True, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def keys_in_environ(launch: subprocess.Popen, keys: dict[str, str]) -> dict[str, list[str]]:
    """What /proc/<pid>/environ of `megarl launch` and of every process under it shows of ``keys``: by process,
    the names whose value, or a plain ``NAME=`` entry not wiped to x's, it holds (a ``NAME_FILE`` path is no
    secret; a process started with a key, as `megarl launch` is by the test's shell, overwrites its value)."""
    found = {}
    for p in [psutil.Process(launch.pid), *psutil.Process(launch.pid).children(recursive=True)]:
        try:
            raw = Path(f"/proc/{p.pid}/environ").read_bytes()
            name = " ".join(p.cmdline())[:80]
        except (OSError, psutil.Error):
            continue
        hits = [k for k, v in keys.items()
                if v.encode() in raw or re.search(rb"(^|\0)%s=(?!x*(\0|$))" % k.encode(), raw)]
        if hits:
            found[f"{p.pid} {name}"] = hits
    return found


def finish(proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"did not stop within {timeout} s:\n{log.read_text()[-3000:]}") from None


def trainer_rank(launch: subprocess.Popen, rank: int) -> psutil.Process:
    for p in psutil.Process(launch.pid).children(recursive=True):
        try:
            if "megarl.train" in " ".join(p.cmdline()) and p.environ().get("RANK") == str(rank):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no trainer rank {rank} under {launch.pid}")


def checkpoints(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))


def test_a_stop_before_the_loop_exits_75_with_nothing_checkpointed(ckpt, tmp_path):
    """SIGTERM during the imports, then during the engine start and model load (after the preflight wrote the
    run's config): exit 75 each time, no checkpoint, no engine left; the same command then trains."""
    run = tmp_path / "run"
    args = ["train", *SMALL, f"model.checkpoint={ckpt}", "trainer.total_steps=2", "--output-dir", str(run)]
    log = tmp_path / "imports.log"
    p = subprocess.Popen([MEGARL[0], "-m", "megarl.train", *args[1:]], cwd=ROOT, env=ENV, start_new_session=True,
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)  # what every launcher runs
    time.sleep(1.0)  # torch and megarl still importing
    p.send_signal(signal.SIGTERM)
    assert finish(p, log) == 75, log.read_text()[-3000:]
    assert not (run / "config.yaml").exists()
    log = tmp_path / "engine_start.log"
    p = start(args, log)
    wait_for(lambda: (run / "config.yaml").exists(), p, log)
    p.send_signal(signal.SIGTERM)
    assert finish(p, log) == 75, log.read_text()[-3000:]
    assert "before the loop" in log.read_text() and not checkpoints(run)
    if (run / "engine0.pid").exists():
        pid = int((run / "engine0.pid").read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    log = tmp_path / "again.log"
    p = start(args, log)
    assert finish(p, log, timeout=300) == 0, log.read_text()[-3000:]
    assert [r["step"] for r in jsonl(run / "metrics.jsonl")] == [1, 2]


def test_a_launched_engine_stops_with_75_on_a_stop_signal(ckpt, tmp_path):
    """An engine role (its own command in a plan) shuts down on SIGTERM or SIGUSR1 and exits 75, which
    `megarl launch` counts as the run stopping, not as a failure; before, it exited 0 or was killed."""
    import urllib.request

    from megarl.rollout.client import free_port

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        port = free_port()
        log = tmp_path / f"engine_{sig.name}.log"
        env = {**ENV, "MEGARL_ROLE": "engine", "MEGARL_SERVER_PORT": str(port), "MEGARL_SERVER_HOST": "127.0.0.1"}
        p = subprocess.Popen([MEGARL[0], "-m", "megarl.train", *SMALL, f"model.checkpoint={ckpt}"], cwd=ROOT,
                             env=env, start_new_session=True, stdout=open(log, "w"), stderr=subprocess.STDOUT)

        def healthy(port: int = port) -> bool:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                return True
            except OSError as e:
                return getattr(e, "code", None) == 401  # serving (a request without the run's key)

        wait_for(healthy, p, log, timeout=120)
        p.send_signal(sig)
        assert finish(p, log, timeout=60) == 75, log.read_text()[-2000:]
