"""The whole async loop with two trainer ranks, started through the launch wrappers.

On the HF engine, which starts in seconds (the trainer ranks are what these test; the
engine talks to rank 0 alone, and the vLLM engine serves the same loop in tests/e2e):
torchrun with TP=2 trainer ranks and the dedicated old-logit process; mpirun with DP=2
trainer ranks bootstrapped over MPI, snapshot recovery; then interrupt_sync and ewma
(TP=2): strategies whose hooks run forwards (collectives) on all ranks.
(interrupt_sync publishes by broadcast: TP=2 ranks export together, rank 0 sends).
torchrun with EP=2 on the tiny MoE replaying the hf engine's routes.
"""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
COMMON = ["trainer.total_steps=3", "trainer.batch_size=32", "logging.progress=none", "logging.tensorboard=false",
          "eval.path="]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    subprocess.run([str(ROOT / ".venv/bin/megarl"), "init-checkpoint", "--model", "configs/models/tiny_qwen3.yaml",
                    "--output", str(out)], cwd=ROOT, check=True, capture_output=True)
    return out


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("launcher,extra", [
    ("torchrun.sh", ["rollout.backend=hf", "parallel.tp=2", "recovery.name=dedicated"]),
    ("mpirun.sh", ["rollout.backend=hf", "recovery.name=snapshot"]),
    # strategies whose hooks run forwards (collectives) between train steps: interrupt_sync scores
    # finished trajectories after the optimizer step, so the followers need rank 0's live trajectories;
    # publishing by broadcast: both TP ranks take part in the export's gathers, rank 0 alone sends full tensors
    ("torchrun.sh", ["rollout.backend=hf", "parallel.tp=2", "rollout.weight_sync=broadcast",
                     "recovery.name=interrupt_sync"]),
    # with an adaptive entropy bonus: rank 0 sends the follower the coefficient of each step; phi kept where the
    # parameters are, each rank's forward pointing its TP shards at its own phi
    ("torchrun.sh", ["rollout.backend=hf", "parallel.tp=2", "loss.entropy_target=5.0", "loss.entropy_coef_step=0.001",
                     "recovery.name=ewma", "recovery.ewma.phi_on_gpu=true"]),
], ids=["tp2-dedicated", "dp2-snapshot", "tp2-interrupt_sync-broadcast", "tp2-ewma"])
def test_two_trainer_ranks_end_to_end(ckpt, tmp_path, launcher, extra):
    run_dir = tmp_path / "run"
    cmd = ["bash", str(ROOT / "launch" / launcher), "--config", "configs/tiny_cpu.yaml", "placement.trainer_ranks=2",
           f"model.checkpoint={ckpt}", f"logging.output_dir={run_dir}", *COMMON, *extra]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = _records(run_dir)
    assert [x["version"] for x in records] == [1, 2, 3]
    assert all(x["staleness_max"] <= 2 and x["skipped"] == 0 for x in records)
    assert (run_dir / "final" / "model.safetensors").is_file()
    if "rollout.weight_sync=broadcast" in extra:
        from megarl.rollout.weight_spec import read_checkpoint_specs

        full = sum(4 * math.prod(shape) for shape, _ in read_checkpoint_specs(ckpt).values())  # float32
        assert [x["weight_sync_bytes"] for x in records[:-1]] == [full, full]
        assert all(x["weight_sync_fallbacks"] == 0 for x in records[:-1])
    if "loss.entropy_target=5.0" in extra:  # the random model's entropy (~3 nats) is below 5: up by 0.001 a step
        assert [round(x["entropy_coef"], 6) for x in records] == [0.003, 0.004, 0.005], records
    if extra[-1].split("=")[1] in ("dedicated", "snapshot", "interrupt_sync"):
        # an exact anchor is the trainer's log-prob of each token's own version, which the fp32 engine
        # sampled with: a rank that scored other inputs than rank 0 would show here
        assert all(x["abs_logp_anchor_minus_behav_mean"] < 1e-4 for x in records), records


def test_two_trainer_ranks_replay_moe_routes(tmp_path):
    """EP=2 on the tiny MoE with routing replay: the hf engine records every token's routes (strict: a result
    without them stops the run) and both ranks replay those of their rows in every forward."""
    run_dir = tmp_path / "run"
    cmd = ["bash", str(ROOT / "launch" / "torchrun.sh"), "--config", "configs/tiny_cpu.yaml",
           "placement.trainer_ranks=2", f"model.checkpoint={tmp_path / 'moe'}",
           "model.init_model=configs/models/tiny_qwen3_moe.yaml", f"logging.output_dir={run_dir}", *COMMON,
           "parallel.ep=2", "rollout.backend=hf", "rollout.routing_replay=true", "rollout.routing_replay_strict=true",
           "recovery.name=snapshot"]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = _records(run_dir)
    assert [x["version"] for x in records] == [1, 2, 3]
    assert all(x["n_routes_missing"] == 0 and x["skipped"] == 0 for x in records)
    # snapshot's anchor is each token's log-prob under its own version with the engine's experts
    assert all(x["abs_logp_anchor_minus_behav_mean"] < 1e-4 for x in records), records
