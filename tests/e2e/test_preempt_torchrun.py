"""Stop signals through the real torchrun: `megarl launch --launcher torchrun` with 2 trainer ranks on the tiny CPU
config (HF engine), stopped and resumed twice, then run to the end.

* attempt 1: SIGTERM to `megarl launch` (what a scheduler or Ctrl-C sends): exit 75, a checkpoint of the step
  reached (torchrun itself reports 1: the stop marker decides);
* attempt 2 (resumed): SIGUSR1 to trainer rank 1 alone: the ranks agree at the step boundary, exit 75 again;
* attempt 3 (resumed): to trainer.total_steps, exit 0.

Then, as tests/e2e/test_resume.py checks a resume: metrics.jsonl holds steps 1..N with versions 1..N, no
trajectory id is trained twice and every trained one was accepted, each resume started at the stop's checkpoint.
A stop before the loop (during the imports, during the engine start and model load) exits 75 with nothing
checkpointed, and the same command then runs.
"""
import os
import re
import secrets
import signal
import subprocess
import time
from pathlib import Path

import psutil
from conftest import ENV, MEGARL, ROOT
from test_resume import jsonl, wait_for

SMALL = ["--config", "configs/tiny_cpu.yaml", "rollout.backend=hf", "trainer.batch_size=32", "rollout.group_size=8",
         "logging.progress=none", "logging.tensorboard=false", "eval.path=", "logging.save_every=0"]
TOTAL = 8


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


def test_torchrun_two_ranks_stop_on_signals_and_resume_losing_nothing(ckpt, tmp_path):
    run = tmp_path / "run"
    common = ["launch", "--launcher", "torchrun", *SMALL, "placement.trainer_ranks=2", f"model.checkpoint={ckpt}",
              f"trainer.total_steps={TOTAL}"]
    # attempt 1: SIGTERM to megarl launch
    log1 = tmp_path / "attempt1.log"
    first = start([*common, f"logging.output_dir={run}"], log1)
    wait_for(lambda: len(jsonl(run / "metrics.jsonl")) >= 2, first, log1)
    t0 = time.monotonic()
    first.send_signal(signal.SIGTERM)
    assert finish(first, log1) == 75, log1.read_text()[-3000:]
    stop1_s = time.monotonic() - t0
    k1 = checkpoints(run)[-1]
    assert k1 == len(jsonl(run / "metrics.jsonl")) >= 2  # the step reached, checkpointed
    assert not (run / "stop.json").exists()
    text = log1.read_text()
    # the follower stopped with rank 0, not killed; either rank's copy of the signal may be the one agreed on
    assert "rank 0 stopped the run (SIGUSR1" in text and "SIGKILL" not in text
    assert re.search(rf"the trainer stopped on SIGUSR1( on rank 1)? at step {k1} \(checkpointed\)", text), text[-2000:]

    # attempt 2: a signal that reaches only trainer rank 1
    log2 = tmp_path / "attempt2.log"
    second = start([*common, f"logging.resume={run}"], log2)
    wait_for(lambda: (run / "resumes.jsonl").exists() and len(jsonl(run / "metrics.jsonl")) >= k1 + 1, second, log2)
    trainer_rank(second, 1).send_signal(signal.SIGUSR1)
    assert finish(second, log2) == 75, log2.read_text()[-3000:]
    k2 = checkpoints(run)[-1]
    assert k2 > k1 and "SIGUSR1 on rank 1" in log2.read_text()

    # attempt 3, with keys the launching shell exports: no process of the run keeps one in its environment
    log3 = tmp_path / "attempt3.log"
    keys = {"MEGARL_ENGINE_KEY": secrets.token_hex(24), "MEGARL_AGENT_SERVICE_KEY": secrets.token_hex(16)}
    third = start([*common, f"logging.resume={run}"], log3, env={**ENV, **keys})
    wait_for(lambda: len(jsonl(run / "metrics.jsonl")) >= k2 + 1, third, log3)
    tree = [" ".join(p.cmdline()) for p in psutil.Process(third.pid).children(recursive=True)]
    assert sum("torch.distributed.run" in c for c in tree) == 1 and sum("megarl.cli engine" in c for c in tree) == 1
    assert sum("-m megarl.train" in c and "torch.distributed.run" not in c for c in tree) == 2, tree  # the ranks
    assert keys_in_environ(third, keys) == {}
    assert [f for d in run.glob(".megarl-keys-*") for f in d.iterdir()] == [], "rank 0 deletes its key file"
    assert finish(third, log3, timeout=300) == 0, log3.read_text()[-3000:]
    assert list(run.glob(".megarl-keys-*")) == [], "the launch leaves no key directory"
    print(f"\ntorchrun x2: SIGTERM -> exit 75 in {stop1_s:.1f} s at step {k1}; rank-1 SIGUSR1 stop at step {k2}")

    metrics = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, TOTAL + 1))
    assert [r["version"] for r in metrics] == list(range(1, TOTAL + 1)), "versions continue without a gap"
    trained_lines = jsonl(run / "trained_ids.jsonl")
    assert [r["step"] for r in trained_lines] == list(range(1, TOTAL + 1))
    trained = [i for r in trained_lines for i in r["traj_ids"]]
    assert len(trained) == len(set(trained)) == TOTAL * 32, "a trajectory was trained twice"
    accepted = [i for r in jsonl(run / "accepted.jsonl") for i in r["traj_ids"]]
    assert len(accepted) == len(set(accepted)) and set(trained) <= set(accepted)
    assert [r["step"] for r in jsonl(run / "resumes.jsonl")] == [k1, k2]
    assert (run / "final" / "model.safetensors").is_file()


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
