"""The real `megarl logprobs` console script on tiny checkpoints, against HF transformers."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
MEGARL = shutil.which("megarl", path=str(Path(sys.executable).parent)) or "megarl"
ROWS = [[1, 5, 6, 7, 2, 7, 6, 5, 3], [1, 4], [1, 9, 10, 11, 12, 13, 2, 13, 12, 11, 10, 9, 3], [7]]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _hf_logprobs(ckpt: Path, ids: list[int]) -> list[float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    t = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(t).logits[0, :-1].float(), -1)
    return logp.gather(-1, t[0, 1:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from megarl.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("cli")
    dense = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", root / "dense", seed=5)
    moe = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3_moe.yaml", root / "moe", seed=5)
    path = root / "in.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ROWS))
    return root, dense, moe, path


def _check_against_hf(out: Path, ckpt: Path) -> float:
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == len(ROWS)
    worst = 0.0
    for row, line in zip(ROWS, lines):
        assert len(line["logprobs"]) == len(row) - 1
        if len(row) >= 2:
            ref = _hf_logprobs(ckpt, row)
            worst = max(worst, max(abs(a - b) for a, b in zip(line["logprobs"], ref)))
    return worst


def test_cli_logprobs_dense_matches_hf(inputs):
    root, dense, _, path = inputs
    out = root / "dense_out.jsonl"
    proc = subprocess.run([MEGARL, "logprobs", "--checkpoint", str(dense), "--input", str(path),
                           "--output", str(out)], env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = _check_against_hf(out, dense)
    print(f"\n[e2e] megarl logprobs dense vs HF: max diff {diff:.3g}")
    assert diff <= 1e-4


def test_cli_logprobs_moe_under_torchrun_ep2(inputs):
    root, _, moe, path = inputs
    out = root / "moe_out.jsonl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           "-m", "megarl.cli", "logprobs", "--checkpoint", str(moe), "--input", str(path), "--output", str(out),
           "--ep", "2"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote 4 lines") == 1  # only rank 0 writes
    diff = _check_against_hf(out, moe)
    print(f"\n[e2e] megarl logprobs MoE EP2 vs HF: max diff {diff:.3g}")
    assert diff <= 1e-4


def test_cli_rejects_too_long_input(inputs):
    root, dense, _, _ = inputs
    bad = root / "too_long.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps({"input_ids": [4] * 200}) + "\n")
    proc = subprocess.run([MEGARL, "logprobs", "--checkpoint", str(dense), "--input", str(bad),
                           "--output", str(root / "never.jsonl")], env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "too_long.jsonl:2: 200 tokens > max_position_embeddings 128" in proc.stderr
    assert "Traceback" not in proc.stderr and not (root / "never.jsonl").exists()
