"""Checkpoints that fail on a real fault, the process's file-size limit (tests/unit/save_fault_run.py): torch's
writer raises its CheckpointException, a BaseException. Each run ends within its timeout (no hang), with the
documented exit code, and every checkpoint that was complete before the fault is still complete after it.

* a periodic save that fails, blocking or in the background, is counted and retried at the next save; the run goes
  on (the failed steps have no checkpoint, nothing of them looks valid);
* ``logging.max_save_failures`` failures in a row stop the run with a CheckpointError naming the error and the fix;
* a stop whose checkpoint fails exits 75 with a stop marker naming the earlier checkpoint that stands, and fails
  (exit 2, saying so) when none stands;
* a stop whose checkpoint cannot finish (the wait for the engines' disk copy never ends) ends within
  ``logging.stop_grace_s``, with the marker naming the checkpoint that stands.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from recovery_scorer import tiny_checkpoint

from megarl.checkpoint.run_checkpoint import list_checkpoints, verify_checkpoint

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt")


def run_child(ckpt: Path, run: Path, mode: str, timeout: float = 120.0) -> tuple[int, dict, str, float]:
    """(exit code, its RESULT line or {}, its output, seconds) of save_fault_run.py in ``mode``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGARL_STOP_MARKER": str(run / "stop.json"),
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1])])}
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, str(HERE / "save_fault_run.py"), str(ckpt), str(run), mode], env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{mode}: hung for {timeout} s:\n{(e.stdout or b'')[-3000:]}") from None
    out = p.stdout + p.stderr
    lines = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    return p.returncode, (lines[0] if lines else {}), out, time.monotonic() - t0


def complete_steps(run: Path) -> list[int]:
    """Steps with a published checkpoint, each checked against its manifest (a damaged one raises)."""
    found = list_checkpoints(run / "checkpoints")
    assert all(verify_checkpoint(p)["step"] == s for s, p in found)
    return [s for s, _ in found]


def leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith("step_"))


@pytest.mark.parametrize("mode", ["recover", "recover-async"])
def test_failed_saves_are_counted_and_retried_and_the_run_goes_on(ckpt, tmp_path, mode):
    code, result, out, _ = run_child(ckpt, tmp_path / "run", mode)
    assert code == 0 and result["step"] == 6, out[-3000:]
    assert complete_steps(tmp_path / "run") == [1, 4, 5, 6], out[-3000:]  # steps 2 and 3 failed, nothing of them
    assert not leftovers(tmp_path / "run")
    assert out.count("checkpoint failed") == 2 and "OSError: [Errno 27] File too large" in out, out[-3000:]


@pytest.mark.parametrize("mode,stopped_at", [("limit", 4), ("limit-async", 5)])
def test_max_save_failures_in_a_row_stop_the_run_naming_the_error(ckpt, tmp_path, mode, stopped_at):
    # blocking: the saves of steps 2, 3, 4 fail; in the background each failure counts when the next save waits
    code, result, out, _ = run_child(ckpt, tmp_path / "run", mode)
    assert code == 2 and result["step"] == stopped_at, out[-3000:]
    assert "3 checkpoints in a row failed (logging.max_save_failures=3)" in result["error"], result
    assert "File too large" in result["error"] and "free disk space" in result["error"], result
    assert complete_steps(tmp_path / "run") == [1]


def test_a_stop_whose_checkpoint_fails_exits_75_naming_the_checkpoint_that_stands(ckpt, tmp_path):
    run = tmp_path / "run"
    code, result, out, _ = run_child(ckpt, run, "stop")
    assert code == 75 and result["step"] == 3, out[-3000:]
    assert "not checkpointed" in result["error"] and "File too large" in result["error"], result
    marker = json.loads((run / "stop.json").read_text())
    assert marker["checkpointed"] is False and marker["step"] == 3, marker
    assert marker["checkpoint"] == str(run / "checkpoints" / "step_1"), marker
    assert complete_steps(run) == [1] and not leftovers(run)


def test_a_stop_whose_checkpoint_fails_with_none_before_fails_saying_so(ckpt, tmp_path):
    run = tmp_path / "run"
    code, result, out, _ = run_child(ckpt, run, "stop-none")
    assert code == 2, out[-3000:]
    assert "no earlier checkpoint: nothing to resume from" in result["error"], result
    assert not (run / "stop.json").exists()  # `megarl launch` must not requeue a run with nothing to resume
    assert complete_steps(run) == []


def test_a_stop_whose_checkpoint_cannot_finish_ends_within_the_stop_budget(ckpt, tmp_path):
    """logging.stop_grace_s=4: the stop's wait for the engines' disk copy never ends; the process still exits 75
    within the budget and a margin, its marker naming step 2 (the periodic saves before it wait for nothing)."""
    run = tmp_path / "run"
    code, _, out, seconds = run_child(ckpt, run, "stop-hang", timeout=90)
    marker = json.loads((run / "stop.json").read_text())
    assert code == 75, out[-3000:]
    assert marker["checkpointed"] is False and marker["checkpoint"] == str(run / "checkpoints" / "step_2"), marker
    assert any("the checkpoint of step 3" in c for c in marker["cut_short"]), marker
    assert "the stop budget (logging.stop_grace_s=4 s) is spent" in out, out[-3000:]
    assert complete_steps(run) == [1, 2]


def test_a_full_disk_stops_the_run_after_max_save_failures_and_keeps_what_was_complete(ckpt, tmp_path):
    """The other real fault: the run directory is a 3 MiB tmpfs (a checkpoint here is ~1.2 MiB), so the saves of
    steps 3, 4 and 5 get ENOSPC from the filesystem, which torch reports as its zip writer's "unexpected pos"; the
    run stops saying the disk is full, steps 1 and 2 stay complete."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    run = tmp_path / "run"
    run.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(run)], check=True)
    try:
        code, result, out, _ = run_child(ckpt, run, "full")
        assert code == 2 and result["step"] == 5, out[-3000:]
        assert "it is (nearly) full" in result["error"] and "logging.max_save_failures=3" in result["error"], result
        assert complete_steps(run) == [1, 2] and not leftovers(run)
    finally:
        subprocess.run(["umount", str(run)], check=True)


def test_a_read_only_checkpoint_directory_stops_the_run_and_keeps_the_checkpoint_there(ckpt, tmp_path):
    """The third real fault: RUN_DIR/checkpoints, holding a complete checkpoint, is a read-only mount (a disk
    remounted read-only on I/O errors does this); every save gets EROFS, the run stops after
    logging.max_save_failures, and the checkpoint that was there is still complete."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root (CI runs as root)")
    run = tmp_path / "run"
    code, _, out, _ = run_child(ckpt, run, "stop-hang", timeout=90)  # any mode that leaves step_1 and step_2
    assert complete_steps(run) == [1, 2], out[-3000:]
    (run / "stop.json").unlink(missing_ok=True)
    root = str(run / "checkpoints")
    subprocess.run(["mount", "--bind", root, root], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", root], check=True)
        code, result, out, _ = run_child(ckpt, run, "readonly")
        assert code == 2, out[-3000:]
        assert "Read-only file system" in result["error"] and "logging.max_save_failures=3" in result["error"], result
        assert complete_steps(run) == [1, 2]
    finally:
        subprocess.run(["umount", root], check=True)
