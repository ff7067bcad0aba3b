"""The README's GPU quick start, followed on CPU as far as a CPU goes: every command it names exists, and the
ones that need no GPU (the data check on a verl-style Parquet file, the plan, the Slurm dry run with a
simulated allocation) run as written and succeed. What needs a cluster is replaced by its dry run (sbatch ->
`bash launch/slurm.sbatch --dry-run` on the same arguments), what needs the GPU stack by its self-test."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def quickstart_commands() -> list[str]:
    """The commands of the README's "GPU quick start" section, continuation lines joined."""
    text = (REPO / "README.md").read_text()
    section = text.split("## GPU quick start", 1)[1].split("\n## ", 1)[0]
    commands, current = [], ""
    for line in section.splitlines():
        if not line.startswith("       "):  # code lines are indented under the numbered steps
            continue
        current += line.strip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        commands.append(current)
        current = ""
    return commands


def run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def verl_parquet(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path_factory.mktemp("data") / "train.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {a} + {a}?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * a)}} for a in range(1, 9)]),
        path)
    return path


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    from megarl.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3_text.yaml", tmp_path_factory.mktemp("c") / "c")


def test_the_quick_start_names_the_steps_it_should():
    cmds = quickstart_commands()
    firsts = [shlex.split(c)[0] for c in cmds]
    assert firsts.count("megarl") >= 2 and "sbatch" in firsts and "hf" in firsts and "pip" in firsts, cmds


def test_every_command_of_the_quick_start_exists_and_the_cpu_ones_succeed(verl_parquet, text_ckpt):
    import setup_extras

    for cmd in quickstart_commands():
        argv = shlex.split(cmd)
        if "-m venv" in cmd:  # a shell line of its own (python -m venv, then `. activate`): the python exists
            assert shutil.which(argv[0]) or argv[0] == "python3.11", cmd
            continue
        if argv[0] == "pip":  # the extras it names are the project's
            extras = re.search(r"\.\[([\w,]+)\]", cmd)
            if extras:
                assert set(extras.group(1).split(",")) <= setup_extras.names(), cmd
            continue
        if argv[0] == "hf":
            assert run([str(Path(sys.executable).parent / "hf"), "download", "--help"]).returncode == 0
            continue
        if argv[:2] == ["bash", "launch/gpu_check.sh"]:
            r = run(["bash", "launch/gpu_check.sh", "--self-test"], timeout=120)
        elif argv[0] == "sbatch":  # no cluster here: the same arguments through the script's dry run
            nodes = next(a.split("=")[1] for a in argv if a.startswith("--nodes="))
            script = argv.index("launch/slurm.sbatch")
            r = run(["bash", "launch/slurm.sbatch", "--dry-run", "--nodes", nodes, "--gpus-per-node", "8",
                     *argv[script + 1:]])
        elif argv[0] == "megarl" and "--check" in argv:  # the data step: the tiny text model stands in for Qwen3
            argv = [a.replace("data/gsm8k/train.parquet", str(verl_parquet)).replace("data/gsm8k/test.parquet",
                                                                                   str(verl_parquet)) for a in argv]
            r = run([sys.executable, "-m", "megarl.cli", *argv[1:], f"model.checkpoint={text_ckpt}",
                     "placement.device=cpu", "data.max_prompt_len=256", "rollout.max_new_tokens=256"])
            assert "all checks passed" in r.stdout and "8 training rows" in r.stdout, r.stdout + r.stderr
        elif argv[0] == "megarl":
            r = run([sys.executable, "-m", "megarl.cli", *argv[1:]])
        else:
            r = run(argv)
        assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    for sub in ("export-hf", "prepare-data"):  # named in the text
        assert run([sys.executable, "-m", "megarl.cli", sub, "--help"]).returncode == 0
