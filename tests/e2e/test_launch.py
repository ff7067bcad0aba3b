"""`megarl launch` and the launch/ scripts, run for real on CPU (no Slurm, no GPU)."""
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ENGINE_VARS

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
CFG_30B = "configs/qwen3_30b_a3b_h100.yaml"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MEGARL_DEDICATED_AUTHKEY")}
    env.update(OMP_NUM_THREADS="1", PYTHON=PY, **extra)
    return env


def run(cmd: list[str], timeout: float = 60, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def test_launch_dry_run_30b_on_four_simulated_nodes():
    p = run([PY, "-m", "megarl.cli", "launch", "--dry-run", "--config", CFG_30B, "--nodes", "4", "--gpus-per-node", "8",
             "--launcher", "slurm"])
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "allocation  simulated: 4 node(s) x 8 GPUs (node[01-04])" in out
    assert "tp=2 pp=1 ep=8 dp=8 (expert dp=1), sequence parallel; 16 ranks" in out
    assert out.count("vLLM TP=4") == 4 and "engine3     node04" in out
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=node01,node02 --gpus-per-node=8" in out
    assert out.count("srun --nodes=1 --ntasks=2 --ntasks-per-node=2") == 2  # one step per engine node, a task each
    assert f"-m megarl.train --config {CFG_30B}" in out


def test_launch_dry_run_json_and_errors():
    # the scorer holds all of the 30B's weights on one GPU: an H200 (141 GB), not an 80 GB H100
    p = run([PY, "-m", "megarl.cli", "launch", "--dry-run", "--json", "--config", CFG_30B, "--recovery", "dedicated",
             "--nodes", "5", "--gpus-per-node", "8", "placement.gpu_memory_gb=141"])
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["plan"]["dedicated"]["host"] == "node05" and data["launcher"] == "torchrun"
    assert "recovery.name=dedicated" in data["commands"][0]["argv"]
    # the scorer's own command: its port and address; the trainer's: where to reach it; no command: a key
    cmds = {c["name"]: c["argv"] for c in data["commands"]}
    assert {"MEGARL_ROLE=dedicated", "MEGARL_SERVER_PORT=8100", "MEGARL_SERVER_HOST=node05"} <= set(cmds["dedicated"])
    assert "MEGARL_DEDICATED_ADDR=node05:8100" in cmds["trainer.node0"]
    assert not any("AUTHKEY" in a for argv in cmds.values() for a in argv)
    # Qwen3-4B trains with tp=2; the scorer gets one GPU, and a tp=2 scorer is refused
    p = run([PY, "-m", "megarl.cli", "launch", "--dry-run", "--config", "configs/qwen3_4b_h100.yaml", "--recovery",
             "dedicated", "--nodes", "3", "--gpus-per-node", "8"])
    assert p.returncode == 0 and "dedicated   node03         gpu 0" in p.stdout, p.stdout + p.stderr
    p = run([PY, "-m", "megarl.cli", "launch", "--dry-run", "--config", "configs/qwen3_4b_h100.yaml", "--recovery",
             "dedicated", "placement.dedicated_tp=2", "--nodes", "3", "--gpus-per-node", "8"])
    assert p.returncode == 2 and "set placement.dedicated_tp=1" in p.stderr, p.stderr
    p = run([PY, "-m", "megarl.cli", "launch", "--dry-run", "--config", CFG_30B, "--nodes", "2",
             "--gpus-per-node", "8"])
    assert p.returncode == 2
    assert "plan needs 32 GPUs on 4 nodes (trainer 16 + engines 16), allocation has 16 GPUs on 2 node(s)" in p.stderr
    p = run([PY, "-m", "megarl.cli", "launch", "--config", CFG_30B, "--launcher", "slurm"])
    assert p.returncode == 2 and "needs a Slurm allocation" in p.stderr


def test_launch_refuses_a_layout_that_does_not_fit_gpu_memory():
    """The memory plan of `megarl plan` is checked before anything starts; --skip-memory-check overrides it."""
    cmd = [PY, "-m", "megarl.cli", "launch", "--config", CFG_30B, "--nodes", "4", "--gpus-per-node", "8",
           "trainer.recompute=none", "trainer.micro_batch_tokens=65536"]
    p = run(cmd)
    assert p.returncode == 1, p.stderr
    assert "megarl launch: does not fit: a trainer GPU needs 449.8 GB > 80 GB; set trainer.recompute=full" in p.stderr
    assert "trainer.micro_batch_tokens=9216" in p.stderr and "parallel.tp" in p.stderr and "parallel.ep" in p.stderr
    assert "--skip-memory-check" in p.stderr
    dry = run(cmd + ["--dry-run"])  # the plan, its memory and the commands, then the same refusal
    assert dry.returncode == 1 and "DOES NOT FIT: a trainer GPU needs 449.8 GB" in dry.stdout
    assert "-m megarl.train" in dry.stdout and "does not fit" in dry.stderr
    # past the check, this torchrun launch stops at the next one: the simulated nodes are not this host
    for flag in ("--skip-memory-check", "--bootstrap-check"):  # the rendezvous check loads no model
        p = run(cmd + [flag])
        assert p.returncode == 2 and "has no role in the plan" in p.stderr, p.stderr
    assert run(cmd[:-2] + ["--dry-run"]).returncode == 0  # the shipped layout fits


def test_slurm_sbatch_dry_run_without_slurm():
    p = run(["bash", "launch/slurm.sbatch", "--dry-run", "--config", CFG_30B])
    assert p.returncode == 0, p.stderr
    assert "no allocation found: simulated the 4 node(s)" in p.stdout
    assert 'node01) r=0;; node02) r=1;;' in p.stdout and "--master-addr=node01 --master-port=29500" in p.stdout
    # inside a (pretend) allocation: hosts, job id and cores come from Slurm's variables
    p = run(["bash", "launch/slurm.sbatch", "--dry-run", "--config", CFG_30B, "--recovery", "ewma"],
            SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu[101-104]", SLURM_NNODES="4", SLURM_GPUS_ON_NODE="8",
            SLURM_CPUS_ON_NODE="96", SLURM_MEM_PER_NODE="1024000", SLURM_SUBMIT_DIR=str(ROOT),
            PATH=os.environ["PATH"] + ":/nonexistent")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "slurm job 4242: 4 node(s) x 8 GPUs (gpu[101-104])" in out
    assert "--nodelist=gpu101,gpu102 --gpus-per-node=8 --cpus-per-task=96 --mem=1024000M" in out
    assert "--master-addr=gpu101 --master-port=29500" in out
    assert "--nodelist=gpu104 --gpus-per-node=8 --cpus-per-task=48 --mem=1024000M" in out
    assert "recovery.name=ewma" in out


# a stop signal through the real launchers (torchrun, Slurm): tests/e2e/test_preempt_torchrun.py, test_preempt_slurm.py


def test_engine_role_takes_kv_cache_and_threads_from_the_config(ckpt, tmp_path):
    """A launched engine role (what a plan's engine command runs) in a shell without VLLM_CPU_KVCACHE_SPACE
    and OMP_NUM_THREADS: its KV cache and threads are rollout.kv_cache_gb and rollout.cpu_threads."""
    from megarl.rollout.client import free_port, stop_engine_process

    port = free_port()
    env = {k: v for k, v in _env(MEGARL_ROLE="engine", MEGARL_SERVER_PORT=str(port),
                                 MEGARL_SERVER_HOST="127.0.0.1").items() if k not in ENGINE_VARS}
    log = tmp_path / "engine_role.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([PY, "-m", "megarl.train", "--config", "configs/tiny_cpu.yaml",
                                 f"model.checkpoint={ckpt}", "rollout.kv_cache_gb=2", "rollout.cpu_threads=2"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        health = _wait_healthy(f"http://127.0.0.1:{port}/health", proc, log, timeout_s=240)
    finally:
        stop_engine_process(proc)
    assert (health["backend"], health["kv_cache_gb"], health["cpu_threads"]) == ("vllm", 2, 2), health


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the engine role exited with code {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return json.loads(resp.read())
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"no answer from {url} within {timeout_s} s")


def test_scripts_parse():
    for script in ("slurm.sbatch", "torchrun.sh", "mpirun.sh", "gpu_check.sh"):
        p = run(["bash", "-n", f"launch/{script}"])
        assert p.returncode == 0, (script, p.stderr)


def _rendezvous_reports(stdout: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("RENDEZVOUS_CHECK ")]


def test_mpirun_two_ranks_bootstrap():
    """MPI starts 2 ranks, rank 0 picks MASTER_ADDR/PORT, gloo all_reduce works."""
    p = run(["bash", "launch/mpirun.sh", "--bootstrap-check", "--config", "configs/tiny_cpu.yaml",
             "placement.trainer_ranks=2"], timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr
    reports = sorted(_rendezvous_reports(p.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1] and [r["local_rank"] for r in reports] == [0, 1]
    assert all(r["ok"] and r["mpi_bootstrap"] and r["backend"] == "gloo" and r["world_size"] == 2 for r in reports)
    assert reports[0]["master_port"] == reports[1]["master_port"] and reports[0]["all_reduce"] == 3.0
    assert "mpirun -n 2" in p.stderr


def test_torchrun_two_ranks_bootstrap():
    p = run(["bash", "launch/torchrun.sh", "--bootstrap-check", "--config", "configs/tiny_cpu.yaml",
             "placement.trainer_ranks=2"], timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr
    reports = _rendezvous_reports(p.stdout)
    assert len(reports) == 2 and all(r["ok"] and not r["mpi_bootstrap"] for r in reports)


def test_gpu_check_self_test():
    p = run(["bash", "launch/gpu_check.sh", "--self-test"], timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "gpu_check self-test passed" in p.stdout


def test_gpu_checks_run_on_cpu(tmp_path):
    """The device-independent GPU checks also run on CPU (GPU_CHECK_ALLOW_CPU=1), so their own code
    is exercised on every CI run: Megatron vs HF parity (dense and MoE) and the broadcast round
    trip into the HF engine."""
    p = run(["bash", "launch/gpu_check.sh", "megatron_parity", "hf_broadcast"], timeout=560,
            GPU_CHECK_ALLOW_CPU="1", GPU_CHECK_WORKDIR=str(tmp_path), GPU_CHECK_TIMEOUT="240")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "PASS megatron_parity: tiny_qwen3 max" in p.stdout and "tiny_qwen3_moe max" in p.stdout
    assert "PASS hf_broadcast:" in p.stdout


@pytest.mark.skipif(not os.environ.get("MEGARL_RUN_GPU_CHECK"), reason="set MEGARL_RUN_GPU_CHECK=1 on a GPU machine")
def test_gpu_check_on_gpu():
    p = run(["bash", "launch/gpu_check.sh"], timeout=600)
    assert p.returncode == 0, p.stdout[-4000:]
