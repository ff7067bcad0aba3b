"""The real `megarl train` CLI with model.dtype=bfloat16: bf16 Megatron trainer, HF engine in bf16, exact recovery."""
import json
import math

import torch
from adam_oracle import params, trainer_state
from conftest import run_megarl
from safetensors.torch import load_file

BF16 = ["model.dtype=bfloat16", "rollout.backend=hf", "recovery.name=snapshot", "trainer.batch_size=16",
        "rollout.group_size=8", "rollout.max_new_tokens=12", "logging.progress=none", "logging.tensorboard=false",
        "eval.path="]


def test_bf16_run(ckpt, tmp_path):
    out = tmp_path / "run"
    r = run_megarl("train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(out), f"model.checkpoint={ckpt}",
                   "trainer.total_steps=3", *BF16, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == [1, 2, 3]
    for x in records:
        assert all(math.isfinite(x[k]) for k in ("loss", "grad_norm", "abs_logp_anchor_minus_behav_mean")), x
    # exact old log-probs (bf16 Megatron) against the bf16 HF engine's: a bf16-sized gap, not zero and not more
    gaps = [x["abs_logp_anchor_minus_behav_mean"] for x in records]
    print(f"\n[bf16 e2e] loss {[round(x['loss'], 4) for x in records]}, mean |logp_old - logp_behav| {gaps}")
    assert all(g < 0.05 for g in gaps), gaps
    assert "megarl engine (hf, bfloat16)" in (out / "engine0.log").read_text()
    # what the engines load: bf16 weights, and a config.json that says so
    final = load_file(out / "final" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    (step_dir,) = sorted((out / "checkpoints").glob("step_*"))
    state = trainer_state(step_dir)
    assert state["dtype"] == "bfloat16" and state["version"] == 3
    assert {t.dtype for t in params(state).values()} == {torch.bfloat16}
    assert state["main"].keys() == params(state).keys() and {t.dtype for t in state["main"].values()} == {torch.float32}

    # resumed in bf16 it continues from the checkpoint; resumed in float32 it is refused before anything starts
    common = ["--config", "configs/tiny_cpu.yaml", f"model.checkpoint={ckpt}", *BF16]
    r = run_megarl("train", "--resume", str(out), *common, "model.dtype=float32", timeout=120)
    assert r.returncode == 2 and "model.dtype=float32 (checkpoint: bfloat16)" in r.stderr, r.stderr[-2000:]
    r = run_megarl("train", "--resume", str(out), *common, "trainer.total_steps=5", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in records] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(x["loss"]) and x["skipped"] == 0 for x in records)
