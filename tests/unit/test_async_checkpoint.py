"""Background checkpoints (logging.async_save) with the real trainer and Checkpointer (tests/unit/async_save_run.py).

* The loop goes on while the write finishes, and the checkpoint holds the state of the step it was taken at (the
  host copy made at the step boundary), not the weights the next step wrote meanwhile.
* A SIGKILL while the write is in flight leaves the previous checkpoint the newest valid one: the half-written
  step is a ``.tmp-`` directory, never read and removed on resume.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from recovery_scorer import tiny_checkpoint

from megarl.checkpoint.run_checkpoint import find_latest_checkpoint, remove_temp_dirs, verify_checkpoint

HERE = Path(__file__).resolve().parent


def child(ckpt: Path, run: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1])])}
    return subprocess.Popen([sys.executable, str(HERE / "async_save_run.py"), str(ckpt), str(run), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def load_weights(ckpt: Path, step_dir: Path) -> dict:
    from megarl.trainer.megatron_trainer import MegatronTrainer

    t = MegatronTrainer(str(ckpt), lr=1e-2, micro_batch_tokens=64)
    t.load_state(str(step_dir / "trainer"))
    return t.get_params()


def test_the_loop_goes_on_and_the_checkpoint_is_the_step_it_was_taken_at(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    run = tmp_path / "run"
    p = child(ckpt, run, "finish")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    dumped = torch.load(run / "weights.pt", weights_only=False)
    assert dumped["path"].endswith("step_2")
    got = load_weights(ckpt, run / "checkpoints" / "step_2")
    assert all(torch.equal(got[k], dumped["w2"][k]) for k in got), "the checkpoint is not its step's state"
    assert any(not torch.equal(dumped["w3"][k], dumped["w2"][k]) for k in got), "step 3 trained during the write"
    held = verify_checkpoint(run / "checkpoints" / "step_2")
    assert "strategy/sharded/.metadata" in held["files"] and "trainer/megarl_trainer.pt" in held["files"]


def test_a_kill_during_the_write_leaves_the_previous_checkpoint_the_newest(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    run = tmp_path / "run"
    p = child(ckpt, run, "kill")
    try:
        deadline = time.monotonic() + 240
        while not (run / "writing").is_file():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0][-3000:]
            time.sleep(0.2)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    root = run / "checkpoints"
    assert sorted(d.name for d in root.iterdir() if not d.name.startswith(".tmp-")) == ["step_1"]
    (tmp,) = [d for d in root.iterdir() if d.name.startswith(".tmp-step_2-")]
    assert (tmp / "controller.pt").is_file() and not (tmp / "manifest.json").exists()
    assert find_latest_checkpoint(run).name == "step_1"
    remove_temp_dirs(root)
    assert not tmp.exists()
    load_weights(ckpt, root / "step_1")  # the previous checkpoint loads
