"""tests/gpu/gpu_check.py's checks as pytest tests (marked ``gpu`` by tests/conftest.py): one test per check.

Each check runs in its own process with a time limit, as launch/gpu_check.sh runs it (a crashed engine
takes down only its own check), and passes on its ``GPU_CHECK PASS`` line. A check that reports SKIP
(no second GPU for NCCL, no official vLLM wheel) is skipped with its reason. Without a CUDA device
every test is skipped, saying so in the ``-rs`` summary.
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
#: seconds one check may take (GPU_CHECK_TIMEOUT, as launch/gpu_check.sh reads it)
TIMEOUT_S = float(os.environ.get("GPU_CHECK_TIMEOUT", "240"))


def _checks() -> list[str]:
    spec = importlib.util.spec_from_file_location("gpu_check", HERE / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CHECKS)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("check", _checks())
def test_gpu_check(check, tmp_path_factory):
    if not _cuda():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False): tests/gpu runs on a GPU machine")
    workdir = tmp_path_factory.getbasetemp() / "gpu_check"  # shared: the checks reuse one tiny checkpoint
    try:
        p = subprocess.run([sys.executable, str(HERE / "gpu_check.py"), check, "--workdir", str(workdir)],
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        pytest.fail(f"gpu_check {check} did not finish within {TIMEOUT_S:.0f} s (GPU_CHECK_TIMEOUT):\n{out[-4000:]}")
    results = [line for line in p.stdout.splitlines() if line.startswith("GPU_CHECK ") and f" {check}:" in line]
    assert results, f"gpu_check {check} exited {p.returncode} without a result line:\n{p.stdout[-4000:]}" \
                    f"\n{p.stderr[-4000:]}"
    status, detail = results[-1].split(" ", 2)[1], results[-1].split(": ", 1)[1]
    if status == "SKIP":
        pytest.skip(f"gpu_check {check}: {detail}")
    assert status == "PASS" and p.returncode == 0, f"{results[-1]}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
