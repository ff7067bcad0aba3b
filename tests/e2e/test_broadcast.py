"""`megarl train` with rollout.weight_sync=broadcast: the real CLI, real engines, trainer -> engines over gloo.

What shows that the engines really run the version they label their tokens
with: the runs use the exact recovery strategy ``snapshot``, whose anchor is
the trainer's log-prob under the version v_t of every token, so the step
record's ``abs_logp_anchor_minus_behav_mean`` is mean |logp_old - logp_behav|.
It is ~1e-7 (float32, two implementations) when the engines hold the
trainer's weights; an engine one version behind is off by ~1e-2 on this
model, four versions ~0.1.

The vLLM engine's side of broadcast publishing (two tensor-parallel workers, each receiving its slices) is
checked against the fp32 engine oracle in test_verify_recovery.py's vLLM run; this file keeps the HF engines'
group rebuild after a kill.
"""
import os
import signal

from test_resume import jsonl, kill_engine_and_finish, process_gone, start, wait_for

CONFIG = ["--config", "configs/tiny_cpu.yaml"]
COMMON = ["rollout.weight_sync=broadcast", "recovery.name=snapshot", "trainer.batch_size=32", "rollout.group_size=8",
          "logging.progress=none", "logging.tensorboard=false", "eval.path="]
PARITY = 1e-4


def check_broadcast_run(metrics: list[dict], steps: int, eta: int = 2) -> None:
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    assert [r["version"] for r in metrics] == list(range(1, steps + 1)), "versions contiguous"
    for r in metrics:
        assert r["skipped"] == 0 and r["staleness_max"] <= eta, r
        assert r["abs_logp_anchor_minus_behav_mean"] < PARITY, f"engine log-probs off the trainer's at step {r['step']}"
    published = metrics[:-1]  # the last step is not published
    assert all(r["weight_sync_bytes"] > 0 for r in published), "every publish went over the broadcast group"
    # the engines' version labels follow: the last batch holds tokens of the recent versions
    newest = metrics[-1]["version"] - min(int(k) for k in metrics[-1]["version_lag_hist"])
    assert newest >= steps - 2, metrics[-1]["version_lag_hist"]


def test_broadcast_engine_killed_rebuilds_the_group(ckpt, tmp_path):
    """Two HF engines; engine 0 is SIGKILLed mid-run, restarts from the disk copy, and a new group takes both.

    Engine 1 keeps the run going meanwhile (a step takes ~0.5 s, a restart ~5 s: 50 steps leave room).
    """
    steps = 50
    run = tmp_path / "run"
    proc = start(["train", *CONFIG, "--output-dir", str(run), f"model.checkpoint={ckpt}", *COMMON,
                  "rollout.backend=hf", "rollout.n_engines=2", "rollout.health_interval_s=1",
                  f"trainer.total_steps={steps}"], tmp_path / "run.log")
    try:
        wait_for(lambda: len(jsonl(run / "metrics.jsonl")) >= 2, proc, tmp_path / "run.log")
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    engine_pid = kill_engine_and_finish(proc, run, tmp_path / "run.log")
    metrics = jsonl(run / "metrics.jsonl")
    check_broadcast_run(metrics, steps)
    assert metrics[-1]["n_engine_restarts"] == 1 and metrics[-1]["n_engine_failures"] == 1
    assert metrics[-1]["n_engines_live"] == 2
    # groups: both engines; engine 1 alone while engine 0 restarts (if a publish falls in); both again
    assert metrics[0]["weight_sync_groups"] == 1 and metrics[-2]["weight_sync_groups"] in (2, 3)
    assert metrics[-2]["weight_sync_fallbacks"] == 0, "every publish reached the live engines by broadcast"
    trained = [i for r in jsonl(run / "trained_ids.jsonl") for i in r["traj_ids"]]
    assert len(trained) == len(set(trained)) == steps * 32
    new_pid = int((run / "engine0.pid").read_text())
    assert new_pid != engine_pid and (run / "engine0.restart1.log").is_file()
    assert process_gone(new_pid), "the restarted engine is stopped at the end"
    assert (run / "final" / "model.safetensors").is_file() and not (run / "weights").exists()

