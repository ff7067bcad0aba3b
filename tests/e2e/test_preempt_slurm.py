"""launch/slurm.sbatch on a real three-node Slurm (tests/e2e/slurm_local.py, one slurmd per host of
tests/cluster_hosts.py), preempted and requeued.

`sbatch --nodes=3 launch/slurm.sbatch` runs the tiny CPU config (HF engine) through `megarl launch --launcher
slurm`: the trainer is an srun step running torchrun on node1 and node2 (one rank each, rank 0 on node1), the
engine an srun step on node3, reached over the bridge, the weights broadcast across hosts (gloo); the step logs
say where each ran. `scancel --signal=TERM --batch` reaches the batch shell alone,
as --signal=B:... does before the time limit; the run must checkpoint the step it reached, exit 75 and requeue
the job (Restarts=1); started again at once (StartTime=now), the job resumes from the checkpoint and trains to
the end with every step once and no trajectory trained twice. Each srun step writes its own log. The trainer
runs 2 ranks and the workflow is multi-turn; the stop's checkpoint keeps the groups still running whole
(megarl/loop/running_groups.py) and the resumed job continues them, each episode at its turn: no trajectory is
generated again, and every partial one the checkpoint kept is trained under its own id.

Slurm comes from scripts/install_slurm.sh (scripts/test.sh runs it); without it (or without root, which the
hosts need) the test is skipped, except in CI (CI=true), where either fails it.
"""
import os
import re
import subprocess
import time
from pathlib import Path

import cluster_hosts
import pytest
from conftest import ROOT
from slurm_local import LocalSlurm, missing_tools
from test_resume import jsonl

from megarl.checkpoint.run_checkpoint import load_file

#: the stop comes after step 2 and lands at step 3 or 4; the generation of the run's last steps (two versions ahead,
#: rollout.eta=2) must still be under way then, so that the cut finds episodes in a turn. With 6 steps, a stop that
#: reached step 4 found every remaining group already generated and waiting for the trainer (seen in a suite run)
TOTAL = 12
#: the multi-turn workflow (a tool answer between policy turns): the stop cuts episodes in a turn or between two,
#: and the resumed job continues each at its turn (the single-turn case is tests/e2e/test_resume.py's and the
#: preemption bench's)
RUN_ARGS = ["--config", "configs/tiny_cpu.yaml", "rollout.backend=hf", "trainer.batch_size=32",
            "rollout.group_size=8", "rollout.workflow=multi_turn", "rollout.max_turns=3", "logging.progress=none",
            "logging.tensorboard=false", "eval.path=",
            "logging.save_every=0", f"trainer.total_steps={TOTAL}", "placement.trainer_nodes=2",
            "placement.engine_nodes=1", "rollout.weight_sync=broadcast"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_tools()
    if missing:
        message = f"Slurm is not installed ({', '.join(missing)} missing): run bash scripts/install_slurm.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    root = tmp_path_factory.mktemp("slurm")
    with cluster_hosts.cluster(3, root / "hosts") as hosts:
        slurm = LocalSlurm(root, hosts)
        try:
            slurm.start()
            yield slurm
        finally:
            slurm.stop()


def wait_until(cond, what: str, cluster: LocalSlurm, log: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            text = log.read_text()[-3000:] if log.exists() else "(no batch log)"
            raise AssertionError(f"timed out waiting for {what}:\n{text}\n{cluster.logs()}")
        time.sleep(0.5)


def test_sbatch_preempted_checkpoints_exits_75_requeues_and_resumes(slurm, ckpt, tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "batch.out"
    env = {**slurm.env, "OMP_NUM_THREADS": "1", "MEGARL_RUN_DIR": str(run), "MEGARL_ROOT": str(ROOT)}
    # the node has no GPU: --gpus-per-node=0 overrides the script's #SBATCH --gpus-per-node=8
    submit = subprocess.run(["sbatch", "--parsable", "--nodes=3", "--gpus-per-node=0", "--open-mode=append",
                             f"--output={log}", "launch/slurm.sbatch", *RUN_ARGS, f"model.checkpoint={ckpt}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    job = submit.stdout.strip().split(";")[0]
    try:
        wait_until(lambda: len(jsonl(run / "metrics.jsonl")) >= 2, "two trained steps", slurm, log)
        subprocess.run(["scancel", "--signal=TERM", "--batch", job], env=env, check=True)
        wait_until(lambda: slurm.job(job).get("Restarts") == "1" and slurm.job(job).get("JobState") == "PENDING",
                   "the requeue", slurm, log, timeout=180)
        text = log.read_text()
        k = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))[-1]
        # srun passes the stop to both trainer nodes: whichever rank caught it first is named (" on rank 1")
        assert re.search(rf"the trainer stopped on SIGUSR1( on rank 1)? at step {k} \(checkpointed\); exit code 75",
                         text), text[-3000:]
        assert f"requeueing job {job}" in text and "forcing job termination" not in text
        assert k == len(jsonl(run / "metrics.jsonl"))
        assert "could not collect every request's partial tokens" not in text, text[-3000:]
        kept = load_file(run / "checkpoints" / f"step_{k}" / "controller.pt")["running_groups"]
        # a requeued job started while the node still cleans up its first run is killed at once ("Job credential
        # revoked", exit 1: seen in a loaded suite run); Slurm's own requeue delay leaves that time, StartTime=now not
        wait_until(slurm.node_idle, "the node to finish the stopped run", slurm, log, timeout=120)
        slurm.scontrol("update", f"jobid={job}", "StartTime=now")
        wait_until(lambda: slurm.job(job).get("JobState") == "COMPLETED", "the resumed job", slurm, log, timeout=300)
    finally:
        subprocess.run(["scancel", job], env=env)
    info = slurm.job(job)
    assert (info["Restarts"], info["ExitCode"]) == ("1", "0:0"), info
    metrics = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, TOTAL + 1))
    assert [r["version"] for r in metrics] == list(range(1, TOTAL + 1))
    trained = [i for r in jsonl(run / "trained_ids.jsonl") for i in r["traj_ids"]]
    assert len(trained) == len(set(trained)) == TOTAL * 32, "a trajectory was trained twice"
    assert [r["step"] for r in jsonl(run / "resumes.jsonl")] == [k]
    assert sorted(p.name for p in run.glob("slurm-megarl-*.out")) == [f"slurm-megarl-{job}.engine0.out",
                                                                       f"slurm-megarl-{job}.trainer.out"]
    node3 = slurm.hosts.host("node3").addr  # where the plan put the engine, and where it served
    assert f"on http://{node3}:8100" in (run / f"slurm-megarl-{job}.engine0.out").read_text()
    assert "logging.resume=" in log.read_text()  # the requeued run resumed, it did not start over
    # nothing an engine sampled before the stop was sampled again: the running groups went on from the checkpoint
    resumed = {key: sum(r[key] for r in metrics[k:]) for key in
               ("n_continued_after_resume", "n_regenerated_after_resume", "n_tokens_regenerated_after_resume")}
    n_kept = sum(len(g["trajectories"]) for g in kept)
    assert resumed == {"n_continued_after_resume": n_kept, "n_regenerated_after_resume": 0,
                       "n_tokens_regenerated_after_resume": 0}, resumed
    partial = [t["traj_id"] for g in kept for t in g["trajectories"] if t["response_ids"] and not t["finished"]]
    assert set(partial) <= set(trained), "a partial trajectory the checkpoint kept was not trained under its id"
    # episodes the cut found past a tool answer (tool tokens carry no version): they went on in a later turn
    past_tool = [t["traj_id"] for g in kept for t in g["trajectories"] if -1 in t["versions"] and not t["finished"]]
    assert past_tool, "the stop cut no episode past its first turn: the multi-turn resume was not tested"
    print(f"\nslurm x3 nodes: stopped at step {k} with {len(kept)} groups running ({len(partial)} partial "
          f"trajectories, {len(past_tool)} of them past a tool answer, "
          f"{sum(len(t['response_ids']) for g in kept for t in g['trajectories'])} tokens kept)")
