"""The stop protocol's pieces (megarl/stop_protocol.py): the stop marker makes `megarl launch` exit 75 whatever
the launcher reported, a follower rank's signal stops rank 0 too, the stop budget bounds a slow wait at close,
mpirun passes the user's environment on (never a secret) and Slurm steps ask for GPUs in the batch's form.

The real launchers under a stop signal are tests/e2e/test_preempt_torchrun.py and test_preempt_slurm.py."""
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from megarl.builder import load_run_config
from megarl.errors import ConfigError
from megarl.launch import cluster
from megarl.launch.cluster import Allocation
from megarl.launch.placement import load_hf_config, resolve_plan
from megarl.launch.role_commands import LaunchSettings, RoleCommand, forwarded_env, render
from megarl.launch.runner import run_commands
from megarl.stop_protocol import EXIT_STOPPED, STOP_MARKER_ENV, early_stop, stop_budget

ROOT = Path(__file__).resolve().parents[2]
CFG_30B = ROOT / "configs" / "qwen3_30b_a3b_h100.yaml"


def _plan(overrides=(), alloc=None):
    cfg = load_run_config(str(CFG_30B), list(overrides))
    hf, _ = load_hf_config(cfg)
    return resolve_plan(cfg, hf, alloc or cluster.simulated(4, 8), config_path=str(CFG_30B),
                        overrides=list(overrides))


# -- the stop marker ---------------------------------------------------------------------------------
def _trainer(tmp_path: Path, marker: Path | None, exit_code: int) -> RoleCommand:
    """A trainer command that exits as torchrun does after its workers stopped (exit 1), having written the marker
    the way trainer rank 0 does (megarl.stop_protocol.write_stop_marker, from MEGARL_STOP_MARKER)."""
    code = ("import sys\nfrom megarl.stop_protocol import write_stop_marker\n"
            "write_stop_marker('SIGTERM', 7, True)\n" if marker is not None else "import sys\n")
    env = ["env", f"{STOP_MARKER_ENV}={marker}"] if marker is not None else []
    return RoleCommand("trainer", "trainer", "", (*env, sys.executable, "-c", code + f"sys.exit({exit_code})"), False)


def test_the_stop_marker_makes_launch_exit_75_whatever_the_launcher_reported(tmp_path):
    marker = tmp_path / "run" / "stop.json"
    assert run_commands([_trainer(tmp_path, marker, 1)], poll_s=0.05, stop_marker=marker) == EXIT_STOPPED
    assert not marker.exists()  # read and removed: the next launch starts without it
    # negative controls: no marker, the failure stands; a stale marker of an earlier launch is removed first
    assert run_commands([_trainer(tmp_path, None, 1)], poll_s=0.05, stop_marker=marker) == 1
    marker.write_text(json.dumps({"signal": "SIGTERM", "step": 3, "checkpointed": True}))
    assert run_commands([_trainer(tmp_path, None, 1)], poll_s=0.05, stop_marker=marker) == 1
    assert run_commands([_trainer(tmp_path, None, 0)], poll_s=0.05, stop_marker=marker) == 0


def test_a_server_that_stopped_on_the_signal_is_a_stop_not_a_failure(tmp_path):
    """Preemption signals every task: the engine exits 75 at once, the trainer checkpoints and stops later."""
    marker, ready, done = tmp_path / "stop.json", tmp_path / "trainer_ready", tmp_path / "checkpointed"
    # the engine exits once the trainer has its handler: a SIGUSR1 before it would kill the trainer (-10)
    engine = RoleCommand("engine0", "engine", "", (sys.executable, "-c", f"import pathlib, sys, time\nwhile not "
                                                   f"pathlib.Path({str(ready)!r}).exists(): time.sleep(0.01)\n"
                                                   f"sys.exit(75)\n"), True)
    slow = ("import pathlib, signal, sys, time\n"
            "def stop(*_):\n    from megarl.stop_protocol import write_stop_marker\n    time.sleep(1)\n"
            f"    pathlib.Path({str(done)!r}).touch(); write_stop_marker('SIGUSR1', 2, True); sys.exit(1)\n"
            f"signal.signal(signal.SIGUSR1, stop)\npathlib.Path({str(ready)!r}).touch()\n"
            "from megarl.loop.stop_ready import announce_stop_ready\nannounce_stop_ready()\n"  # as trainer rank 0 does
            "time.sleep(60)\n")
    trainer = RoleCommand("trainer", "trainer", "", ("env", f"{STOP_MARKER_ENV}={marker}", sys.executable, "-c", slow),
                          False)
    t0 = time.monotonic()
    assert run_commands([engine, trainer], poll_s=0.05, stop_marker=marker) == EXIT_STOPPED
    assert done.exists(), "the trainer was killed before its checkpoint"
    assert time.monotonic() - t0 < 30


# -- a follower's signal -----------------------------------------------------------------------------
def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from megarl.loop.follower import follow
    from megarl.loop.spmd import ControlChannel, DrivingTrainer
    from megarl.stop_protocol import RunStopped

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    channel = ControlChannel()
    result = {}
    if rank == 0:
        driver = DrivingTrainer(trainer=None, channel=channel)
        result["before"] = driver.followers_stop_reason()
        dist.barrier(group=channel.group)  # the follower sends itself SIGUSR1 now
        dist.barrier(group=channel.group)
        result["after"] = driver.followers_stop_reason()
        driver.stopped_by = result["after"]
        driver.stop_followers()
    else:
        with early_stop.installed():
            assert channel.recv() == ("stop_poll",)
            from megarl.loop import spmd
            spmd._stop_votes(channel, early_stop.received)
            dist.barrier(group=channel.group)
            os.kill(os.getpid(), signal.SIGUSR1)  # caught by the latch: the follower stops at the next poll
            dist.barrier(group=channel.group)
            try:
                follow(None, None, channel, None, None)
                result["follower"] = "returned"
            except RunStopped as e:
                result["follower"] = f"RunStopped: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_a_signal_that_reached_only_a_follower_stops_the_run(tmp_path):
    import torch.multiprocessing as tmp

    from megarl.rollout.client import free_port

    tmp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0 == {"before": None, "after": "SIGUSR1 on rank 1"}  # before the signal: no stop (negative control)
    assert r1["follower"].startswith("RunStopped: rank 0 stopped the run (SIGUSR1 on rank 1)")


# -- the stop budget ---------------------------------------------------------------------------------
class _Client:
    async def close(self):
        return None


def test_the_stop_budget_bounds_the_wait_for_an_engine_restart_at_close():
    """close() waited for a restart still starting for as long as that start took (300 s engine start timeout)."""
    from megarl.rollout.supervisor import EngineSupervisor

    release = threading.Event()

    def launch(index):  # an engine start that hangs (a cold vLLM start, or one that never comes up)
        release.wait(60)
        return None, _Client()

    async def main():
        sup = EngineSupervisor([(None, _Client())], launch=launch, weights=("ckpt", 0), health_interval_s=3600)
        sup._fail(sup.slots[0], 0, "killed by the same preemption")
        await asyncio.sleep(0.2)  # the restart is launching
        stop_budget.configure(0.5)
        stop_budget.start()
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(sup.close(), 10)
            return time.monotonic() - t0
        finally:
            release.set()  # asyncio.run waits for the launch's thread

    try:
        took = asyncio.run(main())
    finally:
        release.set()
    assert took < 2.0, took
    assert stop_budget.cut_short == ["an engine restart still starting at close (it exits with this process)"]


def test_the_stop_budget():
    assert stop_budget.bound(600) == 600 and stop_budget.remaining() is None  # no stop: waits keep their timeouts
    stop_budget.configure(5)
    stop_budget.start()
    assert 4 < stop_budget.bound(600) <= 5 and stop_budget.bound(1) == 1
    with pytest.raises(ConfigError, match=r"logging.stop_grace_s=0 must be > 0"):
        stop_budget.configure(0)


# -- launch commands -----------------------------------------------------------------------------------
def test_mpirun_forwards_the_users_environment_but_no_secret(monkeypatch):
    for k, v in {"NCCL_IB_HCA": "mlx5", "HF_HOME": "/data/hf", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                 "MEGARL_RUN_TAG": "a", "WANDB_DIR": "/w", "MEGARL_ENGINE_KEY": "s", "MEGARL_ENGINE_KEY_FILE": "/k",
                 "MEGARL_DEDICATED_AUTHKEY": "s", "MEGARL_AGENT_SERVICE_KEY": "s", "UNRELATED": "x"}.items():
        monkeypatch.setenv(k, v)
    plan = _plan(["placement.forward_env=[WANDB_DIR, NOT_SET_ANYWHERE]"])
    settings = LaunchSettings(forward_env=("WANDB_DIR", "NOT_SET_ANYWHERE"))
    argv = render(plan, "mpirun", python="py", settings=settings)[0].argv
    forwarded = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
    assert {"PATH", "NCCL_IB_HCA", "HF_HOME", "CUDA_DEVICE_MAX_CONNECTIONS", "MEGARL_RUN_TAG", "WANDB_DIR"} <= forwarded
    assert not forwarded & {"UNRELATED", "NOT_SET_ANYWHERE"}
    names = forwarded_env(settings.forward_env)  # the list this adds; a secret travels its own way or not at all
    assert {"NCCL_IB_HCA", "HF_HOME", "MEGARL_RUN_TAG", "WANDB_DIR"} <= set(names)
    assert not [n for n in names if n.startswith(("MEGARL_ENGINE_KEY", "MEGARL_DEDICATED_AUTHKEY",
                                                  "MEGARL_AGENT_SERVICE_KEY"))]
    with pytest.raises(ConfigError, match="placement.forward_env names MEGARL_ENGINE_KEY: a run secret"):
        forwarded_env(("MEGARL_ENGINE_KEY",))
    assert load_run_config(str(CFG_30B), ["placement.forward_env=[A]"]).placement.forward_env == ["A"]


def test_slurm_steps_ask_for_gpus_as_the_batch_does_and_log_per_role():
    """Slurm refuses a step's --gres=gpu beside the SLURM_GPUS_PER_NODE the batch's --gpus-per-node exports
    (srun reads it as --gpus-per-node: "--gres=gpu ... and --gpus-per-node are mutually exclusive")."""
    alloc = Allocation(("g1", "g2", "g3", "g4"), 8, "slurm", job_id="42", cpus_per_node=96)
    cmds = render(_plan(alloc=alloc), "slurm", python="py", settings=LaunchSettings(log_dir="/runs/r1"))
    assert all("--gres" not in " ".join(c.argv) for c in cmds)
    sbatch = (ROOT / "launch" / "slurm.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=8" in sbatch and "--gres" not in sbatch
    assert all("--gpus-per-node=8" in c.argv for c in cmds)  # the trainer's, and each node's two engines'
    logs = [a for c in cmds for a in c.argv if a.startswith("--output=")]
    assert logs == ["--output=/runs/r1/slurm-megarl-%j.trainer.out"] + [  # one log per task of a shared step
        f"--output=/runs/r1/slurm-megarl-%j.engines.{h}.%t.out" for h in ("g3", "g4")]


def test_torchrun_waits_longer_than_the_stop_budget_and_passes_sigusr1_on():
    for launcher, i in (("torchrun", 0), ("slurm", 0)):
        cmd = render(_plan(), launcher, python="py", settings=LaunchSettings(stop_grace_s=200))[i]
        text = " ".join(cmd.argv)
        assert "--shutdown-timeout=230" in text and "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in text


# -- a stop whose checkpoint cannot finish -------------------------------------------------------------
def test_a_stop_whose_checkpoint_fails_in_the_budget_still_exits_75_and_says_so(tmp_path, monkeypatch):
    """The dedicated scorer's state wait cut short by the budget fails the stop's checkpoint: reported in one
    line, the marker says not checkpointed (the newest earlier one stands), and the run stops with 75."""
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).parent))
    from loop_fixtures import CapturingCheckpointer, make_controller

    from megarl.errors import ScorerError
    from megarl.stop_protocol import RunStopped

    class CutShort(CapturingCheckpointer):
        async def save(self, controller, background=False):
            if controller.stop_requested:
                raise ScorerError("dedicated scoring process: state_dict did not finish within 0.5 s")
            await super().save(controller)

    monkeypatch.setenv(STOP_MARKER_ENV, str(tmp_path / "stop.json"))
    c, trainer, ck, _ = make_controller(3, checkpointer=CutShort())
    inner = trainer.train_step

    async def main():
        loop = asyncio.get_running_loop()

        def train_step(batch, loss_fn):
            if trainer.version == 4:
                loop.call_soon_threadsafe(c.request_stop, "SIGTERM")
            return inner(batch, loss_fn)

        trainer.train_step = train_step
        await c.train(40)

    with pytest.raises(RunStopped, match="at step 5, not checkpointed"):
        asyncio.run(asyncio.wait_for(main(), 60))
    assert sorted(ck.saved) == [3]  # the periodic one stands
    marker = json.loads((tmp_path / "stop.json").read_text())
    assert (marker["step"], marker["checkpointed"]) == (5, False)
    assert stop_budget.cut_short and "state_dict did not finish" in stop_budget.cut_short[0]


def test_a_launched_scorer_serves_the_stopping_trainer_then_exits_75_after_the_budget():
    """The dedicated scorer outlives a stop signal (the trainer's checkpoint still needs its state) for at most
    logging.stop_grace_s, then exits 75; a second signal changes nothing."""
    import subprocess

    code = ("import os, signal, time\nfrom megarl.commands.train import _stop_role_on_signals\n"
            "_stop_role_on_signals('dedicated', 1.0)\nos.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.3)\nprint('still serving', flush=True)\nos.kill(os.getpid(), signal.SIGUSR1)\n"
            "time.sleep(30)\n")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == EXIT_STOPPED, p.stderr[-2000:]
    assert "still serving" in p.stdout and "did not finish within logging.stop_grace_s=1 s" in p.stderr
    assert took < 20
