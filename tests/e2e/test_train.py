"""The real `megarl train` and `megarl verify-recovery` CLIs: vLLM CPU engine + Megatron trainer."""
import json

import pytest

from conftest import run_megarl

SMALL = ["trainer.batch_size=32", "rollout.group_size=8", "logging.progress=none"]


megarl = run_megarl


@pytest.fixture(scope="module")
def async_run(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    # few requests in flight make generation the bottleneck, so publishes find requests to interrupt
    # (with 256 in flight the engine can finish every admitted sample before the trainer publishes)
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(out), f"model.checkpoint={ckpt}",
               "trainer.total_steps=8", "rollout.eta=2", "rollout.max_concurrency=4", *SMALL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_async_run_outputs(async_run):
    records = [json.loads(line) for line in (async_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["version"] for r in records] == list(range(1, 9))
    for key in ("reward_mean", "staleness_max", "staleness_mean", "n_interrupted", "n_spliced", "tokens",
                "wait_batch_s", "train_step_s", "recovery_s"):
        assert all(key in r for r in records), key
    assert all(r["staleness_max"] <= 2 for r in records)
    assert sum(r["n_interrupted"] for r in records) > 0
    assert sum(r["n_spliced"] for r in records) > 0
    assert (async_run / "config.yaml").is_file()
    assert (async_run / "final" / "config.json").is_file()
    assert list((async_run / "tensorboard").glob("events.out.tfevents.*"))


def test_sync_run_trains_only_current_version(ckpt, tmp_path):
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(tmp_path), f"model.checkpoint={ckpt}",
               "trainer.total_steps=3", "rollout.eta=0", "logging.tensorboard=false", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness_max"] == 0 and r["n_spliced"] == 0 for r in records)


def test_verify_exact_strategies(ckpt, tmp_path):
    # configs/verify_cpu.yaml says why it makes many sequences splice across versions
    report = tmp_path / "report.json"
    r = megarl("verify-recovery", "--config", "configs/verify_cpu.yaml", "--strategies",
               "snapshot,interrupt_sync,dedicated,loglinear", "--steps", "20", "--output", str(report),
               f"model.checkpoint={ckpt}", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    strategies = json.loads(report.read_text())["strategies"]
    for name in ("snapshot", "interrupt_sync", "dedicated"):
        s = strategies[name]
        assert s["exact"] and s["max_abs_err"] <= 1e-5, (name, s)
        assert s["n_tokens"] > 0 and s["max_versions_per_sequence"] >= 2, (name, s)
        assert s["spliced_frac"] >= 0.1, (name, s)
    assert not strategies["loglinear"]["exact"] and strategies["loglinear"]["max_abs_err"] > 0


def test_verify_exact_strategies_multi_turn(ckpt, tmp_path):
    # a multi-turn trajectory waits between its turns (tool, next turn) through publishes: it must be
    # reported as partial then, or its earlier-version segments are lost to dedicated
    report = tmp_path / "report.json"
    r = megarl("verify-recovery", "--config", "configs/verify_cpu.yaml", "--strategies", "interrupt_sync,dedicated",
               "--steps", "12", "--output", str(report), f"model.checkpoint={ckpt}", "rollout.workflow=multi_turn",
               "rollout.max_turns=4", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name, s in json.loads(report.read_text())["strategies"].items():
        assert s["exact"] and s["max_abs_err"] <= 1e-5, (name, s)
        assert s["max_versions_per_sequence"] >= 2 and s["spliced_frac"] >= 0.1, (name, s)
        # no stop token but the tool call: every response fills its 64 tokens unless tool tokens are in it
        assert 0 < s["n_tokens"] < 12 * 2 * 64, (name, s)


@pytest.mark.parametrize("override,message", [
    ("data.path={missing}", "does not exist"),
    ("reward.fn=no_such_module.fn", "no_such_module"),
    ("data.max_prompt_len=200", "max_position_embeddings"),
    ("trainer.batch_size=30", "multiple of rollout.group_size"),
    ("trainer.publish_every=4", "set trainer.publish_every <= 3"),  # tiny_cpu.yaml: eta = 2
])
def test_bad_input_fails_before_the_run(ckpt, tmp_path, override, message):
    out = tmp_path / "run"
    override = override.format(missing=tmp_path / "missing.jsonl")
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(out), f"model.checkpoint={ckpt}",
               override, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not out.exists(), "nothing is written for a run that never started"


def test_empty_dataset_and_too_long_prompt(ckpt, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", f"model.checkpoint={ckpt}", f"data.path={empty}",
               "--output-dir", str(tmp_path / "r1"), timeout=120)
    assert r.returncode == 2 and "empty" in r.stderr.lower(), r.stderr[-2000:]
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt_ids": [1] + [4] * 30 + [2]}) + "\n")
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", f"model.checkpoint={ckpt}", f"data.path={long}",
               "--output-dir", str(tmp_path / "r2"), timeout=120)
    assert r.returncode == 2 and "longer than" in r.stderr, r.stderr[-2000:]


def test_multi_turn_workflow_with_reference_kl(ckpt, tmp_path):
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(tmp_path), f"model.checkpoint={ckpt}",
               "rollout.workflow=multi_turn", "rollout.max_turns=3", "advantage.kl_coef=0.05",
               "recovery.name=interrupt_sync", "trainer.total_steps=3", "logging.tensorboard=false", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kl_ref"] == 0.0  # the first step trains the reference weights themselves
    assert all(x["kl_ref"] >= 0.0 for x in records) and records[-1]["kl_ref"] > 0.0
    assert all(x["staleness_max"] <= 2 for x in records)


def test_unwired_settings_are_refused(ckpt, tmp_path):
    for overrides in (["placement.trainer_ranks=2", "advantage.kl_coef=0.1"],):
        r = megarl("train", "--config", "configs/tiny_cpu.yaml", f"model.checkpoint={ckpt}", *overrides,
                   "--output-dir", str(tmp_path / "r"), timeout=120)
        assert r.returncode == 2 and overrides[-1].split("=")[0] in r.stderr, r.stderr[-2000:]
        assert not (tmp_path / "r").exists()
