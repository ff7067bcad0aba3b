"""A run changes its parallel layout at a resume: 6 steps under the real torchrun with 2 trainer ranks at TP2
(`launch/torchrun.sh`, checkpoints written in the background: logging.async_save), then `megarl train --resume
RUN_DIR` in one process at TP1 to step 12.

Checked from the run's own records: steps and versions 1..12 without a gap, no trajectory trained twice, one
resume at step 6, and the log names the layout change. Checked from the checkpoints' tensors alone, read with
torch's own torch_dist converter (tests/e2e/adam_oracle.py), none of megarl's loading code: the TP1 trainer's
first step is one AdamW step from the TP2 checkpoint (weights, moments and step count all carried across the
reshard), and snapshot's kept versions in the TP2 checkpoint (its copies of the weights, sharded like the model)
are the TP2 trainer's weights of those versions. That the copies load re-cut for another layout is
tests/distributed/test_reshard.py's check (here the resumed step frees them before any later checkpoint).
"""
import json
import os
import subprocess
import sys

from adam_oracle import assert_resumed_from, equal, params, strategy_state, trainer_state
from conftest import ENV, ROOT, run_megarl
from test_resume import jsonl

COMMON = ["--config", "configs/tiny_cpu.yaml", "rollout.backend=hf", "recovery.name=snapshot", "eval.path=",
          "logging.progress=none", "logging.tensorboard=false"]


def test_a_tp2_run_resumes_at_tp1(ckpt, tmp_path):
    run = tmp_path / "run"
    first = subprocess.run(["bash", "launch/torchrun.sh", *COMMON, f"model.checkpoint={ckpt}",
                            "placement.trainer_ranks=2", "parallel.tp=2", "trainer.total_steps=6",
                            "logging.save_every=1", "logging.keep_last=0", "logging.async_save=true",
                            f"logging.output_dir={run}"],
                           cwd=ROOT, env={**ENV, "PYTHON": sys.executable}, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert json.loads((run / "checkpoints" / "step_6" / "manifest.json").read_text())["run"]["tp"] == 2
    # every step's periodic checkpoint was written in the background; the end of the run waited for step 6's
    written = [json.loads((run / "checkpoints" / f"step_{s}" / "manifest.json").read_text())["written"]
               for s in range(1, 7)]
    assert written == ["background"] * 6, written

    second = run_megarl("train", *COMMON, f"model.checkpoint={ckpt}", "trainer.total_steps=12",
                        "logging.save_every=1", "logging.keep_last=0", "--resume", str(run), timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    out = second.stdout + second.stderr
    assert "in another layout: tp 2 -> 1, world_size 2 -> 1" in out, out[-3000:]

    metrics = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, 13))
    assert [r["version"] for r in metrics] == list(range(1, 13)), "versions continue without a gap"
    trained_lines = jsonl(run / "trained_ids.jsonl")
    assert [r["step"] for r in trained_lines] == list(range(1, 13))
    trained = [i for r in trained_lines for i in r["traj_ids"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert [r["step"] for r in jsonl(run / "resumes.jsonl")] == [6]

    ckpts = run / "checkpoints"
    hf = json.loads((ckpt / "config.json").read_text())
    assert_resumed_from(ckpts / "step_6", ckpts / "step_7", hf, ROOT / "configs" / "tiny_cpu.yaml", total_steps=12)
    kept6, kept7 = (strategy_state(ckpts / f"step_{s}")["versions"] for s in (6, 7))
    # at its last step the TP2 run held the versions its buffered tokens still had (not its last one), each the
    # TP2 trainer's weights of that version, gathered from both ranks' shards by torch
    assert kept6 and max(kept6) < 6, sorted(kept6)
    for v in kept6:
        assert equal(kept6[v], params(trainer_state(ckpts / f"step_{v}"))), v
    assert equal(kept7[7], params(trainer_state(ckpts / "step_7")))
    carried = sorted(set(kept6) & set(kept7))  # those still live after the resumed step came through as they were
    assert all(equal(kept6[v], kept7[v]) for v in carried), (sorted(kept6), sorted(kept7))
    assert os.path.isfile(run / "final" / "model.safetensors")
