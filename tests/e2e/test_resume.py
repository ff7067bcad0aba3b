"""Nothing lost: the real `megarl train` CLI killed with SIGKILL and resumed, engines killed, NaN steps, bad resumes.

What is checked after kill -9 + `--resume` (see megarl/checkpoint/run_checkpoint.py for the definitions):

* metrics.jsonl holds steps 1..N with versions 1..N, contiguous (lines of steps
  after the checkpoint, which the resumed run redoes, are rewound);
* no trajectory id is trained twice over both runs, every trained id was accepted;
* every id accepted before the checkpoint — an ``accepted.jsonl`` line with
  ``accepted_total <= manifest.accepted_total``, as the killed run wrote it — is
  trained exactly once; groups accepted after the checkpoint are generated again
  under new ids;
* the killed run's engine process is gone (it exits when its parent dies);
* the kill lands with work in flight: the run is stopped (SIGSTOP) and killed only once groups were
  accepted after its newest checkpoint, so the set redone under new ids is never empty;
* checked from the tensors alone (tests/e2e/adam_oracle.py), the resumed trainer is the checkpoint's:
  its first step is one AdamW step from the checkpoint's weights, moments and step count, the
  weights it published first (what the engine loaded as that version) are those weights, and the
  snapshot versions it kept are the checkpoint's.

The resumed run's vLLM engine is then SIGKILLed mid-generation: it is restarted once, its requests are
sent again, and the run still trains every step and every trajectory once.

Speed: the resume tests use the HF engine backend (starts in ~4 s) except the
snapshot one, which runs the vLLM CPU engine.
"""
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from adam_oracle import assert_resumed_from, equal, params, strategy_state, trainer_state
from conftest import ENV, MEGARL, ROOT, run_megarl

SMALL = ["trainer.batch_size=32", "rollout.group_size=8", "logging.progress=none", "logging.tensorboard=false",
         "logging.save_every=2", "logging.keep_last=2", "eval.path="]


megarl = run_megarl


def start(args, log: Path) -> subprocess.Popen:
    """The CLI in its own process group (so the whole trainer side can be SIGKILLed at once)."""
    return subprocess.Popen([*MEGARL, *args], cwd=ROOT, env=ENV, start_new_session=True,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(cond, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"run exited early ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def written_lines(path: Path) -> list[dict]:
    """The complete lines of a file a live run appends to (a line being written is left out)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out


def work_in_flight(run: Path) -> bool:
    """Groups were accepted after the newest checkpoint: a resume from it must redo them."""
    found = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    if not found:
        return False
    k = found[-1]  # published by a rename, manifest inside: complete
    total = json.loads((run / "checkpoints" / f"step_{k}" / "manifest.json").read_text())["accepted_total"]
    return any(r["accepted_total"] > total for r in written_lines(run / "accepted.jsonl"))


def kill_with_work_in_flight(proc: subprocess.Popen, run: Path, log: Path, timeout: float = 300.0) -> None:
    """SIGKILL the run's process group at a moment :func:`work_in_flight` holds: seen to hold, the group is
    stopped (SIGSTOP), checked again while nothing it writes can change, and killed or let go on."""
    deadline = time.monotonic() + timeout
    while True:
        wait_for(lambda: work_in_flight(run), proc, log, timeout=max(deadline - time.monotonic(), 1.0))
        os.killpg(proc.pid, signal.SIGSTOP)
        if work_in_flight(run):
            os.killpg(proc.pid, signal.SIGKILL)
            return
        os.killpg(proc.pid, signal.SIGCONT)


def process_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if "State:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def kill_engine_and_finish(proc: subprocess.Popen, run: Path, log: Path) -> int:
    """SIGKILL engine 0's process group (a vLLM engine's engine-core too) while the run ``proc`` goes on, and wait
    for the run to finish with exit 0; returns the killed engine's pid."""
    engine_pid = int((run / "engine0.pid").read_text())
    try:
        os.killpg(engine_pid, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return engine_pid


def kept_running(step_dir: Path) -> tuple[list[dict], set[str]]:
    """The running groups a checkpoint kept whole (megarl/loop/running_groups.py) and their trajectory ids."""
    from megarl.checkpoint.run_checkpoint import load_file

    running = load_file(step_dir / "controller.pt")["running_groups"]
    return running, {t["traj_id"] for g in running for t in g["trajectories"]}


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ewma's state (its averaged parameters) round-trips through a checkpoint in tests/unit/test_recovery_approx.py;
# dedicated resumes (with the HF engine, after its scorer is killed and after a SIGTERM) in test_fault_schedule.py
@pytest.mark.parametrize("strategy,backend", [("snapshot", "vllm")])
def test_sigkill_and_resume_loses_nothing(ckpt, tmp_path, strategy, backend):
    run = tmp_path / "run"
    common = ["--config", "configs/tiny_cpu.yaml", f"model.checkpoint={ckpt}", f"recovery.name={strategy}",
              f"rollout.backend={backend}", *SMALL]
    first = start(["train", "--output-dir", str(run), *common, "trainer.total_steps=40"], tmp_path / "first.log")
    try:
        kill_with_work_in_flight(first, run, tmp_path / "first.log")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    engine_pid = int((run / "engine0.pid").read_text())
    assert process_gone(engine_pid), f"engine {engine_pid} of the killed run is still running"
    killed = {name: jsonl(run / name) for name in ("metrics.jsonl", "accepted.jsonl", "trained_ids.jsonl")}
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    manifest = json.loads((run / "checkpoints" / f"step_{steps[-1]}" / "manifest.json").read_text())
    k, accepted_at_ckpt = manifest["step"], manifest["accepted_total"]
    size = du(run / "checkpoints" / f"step_{k}")
    running, kept = kept_running(run / "checkpoints" / f"step_{k}")

    t0 = time.monotonic()
    # a checkpoint after every step, all kept: the one after the first resumed step is compared with step_k
    second = start(["train", "--resume", str(run), *common, "trainer.total_steps=10", "logging.save_every=1",
                    "logging.keep_last=0", "rollout.health_interval_s=1"], tmp_path / "second.log")
    # metrics.jsonl holds the killed run's steps after k until the resume rewinds it (then resumes.jsonl appears)
    try:
        wait_for(lambda: (run / "resumes.jsonl").is_file() and len(written_lines(run / "metrics.jsonl")) > k,
                 second, tmp_path / "second.log")
        resume_s = time.monotonic() - t0
    except BaseException:
        os.killpg(second.pid, signal.SIGKILL)
        raise
    # then the resumed run's vLLM engine (and its engine-core process) is SIGKILLed mid-generation: the run
    # restarts it from the disk copy of the newest version and sends its requests again
    engine_pid = kill_engine_and_finish(second, run, tmp_path / "second.log")
    print(f"\n{strategy}/{backend}: killed after checkpoint step_{k}; resume to first new step {resume_s:.1f} s; "
          f"checkpoint {size / 1e6:.2f} MB")

    metrics = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, 11))
    assert [r["version"] for r in metrics] == list(range(1, 11)), "versions continue without a gap"
    assert all(r["staleness_max"] <= 2 and r["skipped"] == 0 for r in metrics)

    trained_lines = jsonl(run / "trained_ids.jsonl")
    assert [r["step"] for r in trained_lines] == list(range(1, 11))
    trained = [i for r in trained_lines for i in r["traj_ids"]]
    assert len(trained) == len(set(trained)) == 10 * 32, "a trajectory was trained twice"
    assert trained_lines[:k] == [r for r in killed["trained_ids.jsonl"] if r["step"] <= k]

    accepted_lines = jsonl(run / "accepted.jsonl")
    accepted = [i for r in accepted_lines for i in r["traj_ids"]]
    assert len(accepted) == len(set(accepted)) and set(trained) <= set(accepted)
    before = [r for r in killed["accepted.jsonl"] if r["accepted_total"] <= accepted_at_ckpt]
    assert before and accepted_lines[:len(before)] == before
    assert sum(len(r["traj_ids"]) for r in before) == accepted_at_ckpt
    for i in (i for r in before for i in r["traj_ids"]):
        assert trained.count(i) == 1, f"{i} was accepted before the checkpoint but trained {trained.count(i)} times"
    redone = {i for r in killed["accepted.jsonl"] if r["accepted_total"] > accepted_at_ckpt for i in r["traj_ids"]}
    assert redone, "the kill found no group accepted after the checkpoint: nothing was redone"
    # groups running at the checkpoint were kept in it and continued under their ids; the rest come back under new
    # ones
    assert redone & set(accepted) <= kept, "groups accepted after the checkpoint come back under new ids"
    assert [r["step"] for r in jsonl(run / "resumes.jsonl")] == [k]
    assert all(r["group_id"].startswith("r1.") or r["group_id"] in {g["group_id"] for g in running}
               for r in accepted_lines[len(before):])
    assert kept <= set(trained), "a trajectory the checkpoint kept running was not trained under its id"
    assert (run / "final" / "model.safetensors").is_file()
    assert sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*")) == [*steps, *range(k + 1, 11)]

    ckpts = run / "checkpoints"
    hf = json.loads((ckpt / "config.json").read_text())
    assert_resumed_from(ckpts / f"step_{k}", ckpts / f"step_{k + 1}", hf, ROOT / "configs" / "tiny_cpu.yaml",
                        total_steps=10)
    # snapshot's kept versions: the checkpoint's are its trainer's; the resumed run kept them as they were, and
    # every version a live token of its next checkpoint references (the ready groups' tokens). Whether an older
    # version is still live there depends on timing (the restored groups are trained at step k + 1; the new
    # ones may hold no token yet when it publishes): carried-over versions are compared where there are any
    from megarl.checkpoint.run_checkpoint import load_file
    kept0, kept1 = (strategy_state(ckpts / f"step_{s}")["versions"] for s in (k, k + 1))
    assert equal(kept0[k], params(trainer_state(ckpts / f"step_{k}")))
    assert equal(kept1[k + 1], params(trainer_state(ckpts / f"step_{k + 1}")))
    ready = load_file(ckpts / f"step_{k + 1}" / "controller.pt")["buffer"]["ready"]
    live = {v for g in ready for t in g["trajectories"] for v in t["versions"] if v >= 0} | {k + 1}
    assert live <= set(kept1), (sorted(live), sorted(kept1))
    carried = sorted(set(kept0) & set(kept1))
    assert carried or not {v for v in live if v <= k}, (sorted(kept0), sorted(kept1), sorted(live))
    assert all(equal(kept0[v], kept1[v]) for v in carried), (sorted(kept0), sorted(kept1))

    # the engine killed in the resumed run was restarted once and its requests sent again; the replacement is
    # stopped at the end
    resumed = metrics[k:]
    assert sum(r["n_regenerated_after_resume"] for r in resumed) == 0
    assert sum(r["n_continued_after_resume"] for r in resumed) == len(kept)
    assert resumed[-1]["n_engine_restarts"] == 1 and resumed[-1]["n_engine_failures"] == 1, resumed[-1]
    assert sum(r["n_engine_resubmits"] for r in resumed) > 0
    new_pid = int((run / "engine0.pid").read_text())
    assert new_pid != engine_pid and (run / "engine0.restart1.log").is_file()
    assert process_gone(new_pid), "the restarted engine is stopped at the end"


# a scheduler's SIGTERM (preemption: checkpoint the step reached, exit code 75, resume) is attempt 2 of
# test_fault_schedule.py


@pytest.fixture(scope="module")
def diverged_run(ckpt, tmp_path_factory):
    run = tmp_path_factory.mktemp("nan") / "run"
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(run), f"model.checkpoint={ckpt}",
               "rollout.backend=hf", "trainer.total_steps=10", "trainer.max_consecutive_skips=2",
               "reward.fn=tests.e2e.resume_fixtures:exploding_reward", "advantage.std_normalize=false", *SMALL)
    return run, r


def test_nonfinite_steps_are_skipped_then_the_run_stops_with_a_checkpoint(diverged_run):
    run, r = diverged_run
    assert r.returncode == 2, r.stderr[-3000:]
    assert "2 consecutive steps skipped (last: non-finite grad norm" in r.stderr and "Traceback" not in r.stderr
    metrics = jsonl(run / "metrics.jsonl")
    assert [(m["step"], m["version"], m["skipped"], m["skip_reason"]) for m in metrics] == [
        (1, 0, 1.0, "non-finite grad norm"), (2, 0, 1.0, "non-finite grad norm")]
    assert not (run / "weights").exists() or not list((run / "weights").glob("v*")), "nothing was published"
    from megarl.checkpoint.run_checkpoint import verify_checkpoint

    manifest = verify_checkpoint(run / "checkpoints" / "step_2")
    assert manifest["version"] == 0 and manifest["engine_version"] == 0
    assert process_gone(int((run / "engine0.pid").read_text()))


def test_bad_resume_is_refused_and_writes_nothing(ckpt, diverged_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(diverged_run[0], run)
    target = run / "checkpoints" / "step_2" / "trainer" / "__0_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    args = ["--config", "configs/tiny_cpu.yaml", f"model.checkpoint={ckpt}", "rollout.backend=hf", *SMALL]
    r = megarl("train", "--resume", str(run), *args, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert str(target) in r.stderr and "sha256" in r.stderr, r.stderr
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before, "a refused resume changes nothing"

    r = megarl("train", "--resume", str(diverged_run[0]), *args, "trainer.batch_size=16", "parallel.tp=2", timeout=120)
    assert r.returncode == 2 and "trainer.batch_size=16 (checkpoint: 32)" in r.stderr, r.stderr[-2000:]
    # the parallel layout of a reshardable checkpoint may change: only the batching is named
    assert "parallel.tp" not in r.stderr and "world_size" not in r.stderr, r.stderr[-2000:]

    empty = tmp_path / "empty"
    empty.mkdir()
    r = megarl("train", "--resume", str(empty), *args, timeout=120)
    assert r.returncode == 2 and "no checkpoint" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert list(empty.iterdir()) == []
    r = megarl("train", "--resume", str(tmp_path / "missing"), *args, timeout=120)
    assert r.returncode == 2 and "no such run directory" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "missing").exists()
    r = megarl("train", "--output-dir", str(run), *args, timeout=120)  # a fresh run must not mix into it
    assert r.returncode == 2 and "--resume" in r.stderr, r.stderr[-2000:]
