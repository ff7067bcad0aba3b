"""The engines of one node share one Slurm step, a task each with its own slice of the step's GPUs as
CUDA_VISIBLE_DEVICES (megarl/launch/slurm_scripts.py): read from the rendered commands and run by bash as
Slurm would start each task."""
import os
import subprocess

from test_placement import CFG_30B, CFG_TINY, plan_for

from megarl.launch.cluster import Allocation
from megarl.launch.role_commands import render

FAKE_PYTHON = ('#!/bin/sh\n'
               'echo "$CUDA_VISIBLE_DEVICES|$MEGARL_ENGINE_INDEX|$MEGARL_SERVER_PORT|$MEGARL_WEIGHT_SYNC_RANK"\n')


def _task(cmd, localid: int, visible: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(SLURM_LOCALID=str(localid), **({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}))
    assert cmd.argv[-3:-1] == ("bash", "-c")
    return subprocess.run(["bash", "-c", cmd.argv[-1]], env=env, capture_output=True, text=True, timeout=30)


def test_engines_of_a_node_share_one_step_with_their_own_gpus(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    alloc = Allocation(("g1", "g2", "g3", "g4"), 8, "slurm", job_id="42", cpus_per_node=96)
    cmds = render(plan_for(CFG_30B, alloc=alloc), "slurm", python=str(fake))
    assert [c.name for c in cmds] == ["trainer", "engines.g3", "engines.g4"]
    step = cmds[1]
    assert step.argv[:6] == ("srun", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--nodelist=g3",
                             "--gpus-per-node=8")
    assert "--kill-on-bad-exit=1" in step.argv and step.server and step.role == "engine"
    # Slurm's own numbering of the step's GPUs (global ids without cgroups, 0..7 with ConstrainDevices)
    for visible, halves in (("0,1,2,3,4,5,6,7", ("0,1,2,3", "4,5,6,7")), (None, ("0,1,2,3", "4,5,6,7")),
                            ("8,9,10,11,12,13,14,15", ("8,9,10,11", "12,13,14,15"))):
        outs = [_task(step, i, visible) for i in (0, 1)]
        assert [o.returncode for o in outs] == [0, 0], [o.stderr for o in outs]
        assert [o.stdout.strip() for o in outs] == [f"{halves[0]}|0|8100|1", f"{halves[1]}|1|8101|5"]
    assert _task(cmds[2], 1, None).stdout.strip() == "4,5,6,7|3|8101|13"
    too_few = _task(step, 0, "0,1,2,3")
    assert too_few.returncode == 1 and "the engine step sees 4 GPUs" in too_few.stderr and "need 8" in too_few.stderr
    stray = _task(step, 2, None)
    assert stray.returncode == 1 and "task 2 of the engine step has no engine" in stray.stderr


def test_one_engine_on_a_node_and_cpu_engines(tmp_path):
    alloc = Allocation(("g1", "g2", "g3", "g4"), 8, "slurm", job_id="42", cpus_per_node=96)
    single = render(plan_for(CFG_30B, ["rollout.n_engines=3"], alloc=alloc), "slurm", python="py")
    assert [c.name for c in single] == ["trainer", "engines.g3", "engine2"]  # g4 runs one engine: its own step
    cpu = render(plan_for(CFG_TINY, ["placement.engine_nodes=1", "rollout.n_engines=2"], nodes=2, gpus=0), "slurm",
                 python="py")
    assert [c.name for c in cpu] == ["trainer", "engines.node02"]
    assert "CUDA_VISIBLE_DEVICES" not in cpu[1].argv[-1] and "--gpus-per-node" not in " ".join(cpu[1].argv)
