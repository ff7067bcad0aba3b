"""Runs through one EnginePool: the second run's engine is the first's, reset to the base checkpoint.

Two synchronous runs (rollout.eta=0, the HF engine: every sample is a function of the seed and the
weights) with the same config, one after the other on the same pooled engine, sample, train and save
exactly the same; without the reset the second run would sample from the first run's last weights.
"""
import json

from megarl.builder import load_run_config
from megarl.rollout.engine_pool import EnginePool
from megarl.train import train


def _run(ckpt, run_dir, pool):
    cfg = load_run_config("configs/tiny_cpu.yaml", [
        f"model.checkpoint={ckpt}", "rollout.backend=hf", "rollout.eta=0", "trainer.total_steps=2",
        "trainer.batch_size=8", "rollout.group_size=4", "logging.progress=none", "logging.tensorboard=false",
        "eval.path=", f"logging.output_dir={run_dir}"])
    train(cfg, engine_pool=pool)
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_two_runs_through_one_pool_sample_and_train_alike(ckpt, tmp_path):
    with EnginePool(tmp_path / "engines") as pool:
        first = _run(ckpt, tmp_path / "first", pool)
        second = _run(ckpt, tmp_path / "second", pool)
        assert pool.n_started == 1  # one engine served both runs
    # samples.jsonl holds 4 samples of each of the 2 steps (logging.n_samples): step 1's sampled by version 0
    # (the base checkpoint), step 2's by version 1
    assert [s["step"] for s in second] == [1] * 4 + [2] * 4
    assert [s["versions"][0][0] for s in second] == [0] * 4 + [1] * 4, [s["versions"] for s in second]
    assert second == first
    weights = [(tmp_path / run / "final" / "model.safetensors").read_bytes() for run in ("first", "second")]
    assert weights[0] == weights[1]
    assert "megarl engine (hf" in (tmp_path / "engines" / "engine0.log").read_text()
