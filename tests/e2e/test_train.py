"""The real `megarl train` and `megarl verify-recovery` CLIs: vLLM CPU engine + Megatron trainer."""
import json
import shlex

import pytest
from conftest import assert_exact_fp32, assert_namespaced, run_megarl
from doc_blocks import block

SMALL = ["trainer.batch_size=32", "rollout.group_size=8", "logging.progress=none", "eval.path="]


megarl = run_megarl


def readme_train(strategy: str) -> list[str]:
    """The README's `megarl train` command that sets recovery.name=STRATEGY (its block "train-strategies"), its
    words after `megarl`; the runs below append their own settings (steps, batch, output) to it."""
    (cmd,) = [c for c in block("train-strategies").commands() if f"recovery.name={strategy}" in shlex.split(c)]
    argv = shlex.split(cmd)
    assert argv[:2] == ["megarl", "train"], cmd
    return argv[1:]


@pytest.fixture(scope="module")
def async_run(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    # few requests in flight make generation the bottleneck, so publishes often find requests to interrupt;
    # rollout.splice_at_tokens makes sequences of several versions certain (a fast engine can finish every
    # admitted sample before a publish)
    # the README's snapshot command, as written, with these settings appended
    r = megarl(*readme_train("snapshot"), f"logging.output_dir={out}", f"model.checkpoint={ckpt}",
               "trainer.total_steps=8", "rollout.eta=2", "rollout.max_concurrency=4", "rollout.splice_at_tokens=2",
               *SMALL,
               "eval.path=configs/data/reverse_digits_eval.jsonl", "eval.every=4", "eval.n_samples=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_async_run_outputs(async_run):
    lines = [json.loads(line) for line in (async_run / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if "reward_mean" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["version"] for r in records] == list(range(1, 9))
    for key in ("reward_mean", "staleness_max", "staleness_mean", "n_interrupted", "n_spliced", "tokens",
                "wait_batch_s", "train_step_s", "recovery_s"):
        assert all(key in r for r in records), key
    assert all(r["staleness_max"] <= 2 for r in records)
    # rollout.splice_at_tokens holds trajectories until a publish, so this run splices by construction; whether a
    # publish also finds requests in flight to abort depends on how fast the engine is beside the trainer (a
    # fast engine finishes what eta admits before each publish), so aborts are not asserted here: the abort path
    # through the vLLM engine is certified in test_verify_recovery.py, whose config keeps generation the bottleneck
    assert sum(r["n_splice_holds"] for r in records) > 0
    assert sum(r["n_spliced"] for r in records) > 0
    assert all(r["n_reward_failed"] == 0 for r in records) and sum(r["n_reward_calls"] for r in records) >= 8 * 32
    assert (async_run / "config.yaml").is_file()
    assert (async_run / "final" / "config.json").is_file()
    assert list((async_run / "tensorboard").glob("events.out.tfevents.*"))
    assert_namespaced(lines)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(async_run / "tensorboard"))
    tb.Reload()
    tags = set(tb.Tags()["scalars"])
    assert {"actor/pg_loss", "rollout/reward_mean", "timing/step_s", "recovery/behav_w/masked_frac",
            "eval/pass@1"} <= tags and "reward_mean" not in tags


def test_evaluation_every_k_steps_and_at_the_end(async_run):
    lines = [json.loads(line) for line in (async_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [4, 8]  # eval.every=4, and once at the end
    for r in evals:
        assert 0.0 <= r["eval/pass@1"] <= r["eval/pass@k"] <= 1.0 and r["eval/k"] == 2
        assert r["eval/n_prompts"] == 64 and r["eval/n_reward_failed"] == 0
    assert evals[-1]["eval/version_min"] == 8  # the final weights were published for it


def test_final_is_a_complete_hf_model_directory(async_run, ckpt):
    from transformers import AutoTokenizer

    final = async_run / "final"
    tok = AutoTokenizer.from_pretrained(str(final))
    assert tok.apply_chat_template([{"role": "user", "content": "12"}], tokenize=False, add_generation_prompt=True) \
        == "<|im_start|>user\n12<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((final / "generation_config.json").read_text()) == \
        json.loads((ckpt / "generation_config.json").read_text())


def test_samples_are_decoded_text(async_run):
    samples = [json.loads(line) for line in (async_run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [k for k in range(1, 9) for _ in range(4)]  # logging.log_samples=4
    for s in samples:
        assert s["prompt"].startswith("<|im_start|>user\n") and s["prompt"].endswith("<|im_start|>assistant\n")
        assert s["answer"] == s["prompt"].split("\n")[1].split("<")[0][::-1]
        assert "<|im_end|>" not in s["response"] and set(s["response"]) <= set("0123456789\nusersystemassistant")
        # [version, tokens] per segment: the policy tokens, each written by a version before this step's
        assert sum(n for _, n in s["versions"]) >= 1 and all(0 <= v < s["step"] for v, _ in s["versions"])
        assert 0.0 <= s["reward"] <= 1.0


def test_sync_run_trains_only_current_version(ckpt, tmp_path):
    # the README's ewma command, as written, with these settings appended
    r = megarl(*readme_train("ewma"), f"logging.output_dir={tmp_path}", f"model.checkpoint={ckpt}",
               "trainer.total_steps=3", "rollout.eta=0", "logging.tensorboard=false", "rollout.backend=hf", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness_max"] == 0 and r["n_spliced"] == 0 for r in records)


def test_verify_exact_strategies(text_ckpt, tmp_path):
    # configs/verify_cpu.yaml splices by construction (rollout.splice_at_tokens): the odd groups' trajectories,
    # two per group, stop at 8 tokens until the next publish. Group 1's reach their 8th token while group 0's
    # batch trains (one request at a time: group 0's go first), so they are held at version 0 and spliced
    report = tmp_path / "report.json"
    r = megarl("verify-recovery", "--config", "configs/verify_cpu.yaml", "--strategies",
               "snapshot,interrupt_sync,dedicated,loglinear", "--steps", "8", "--output", str(report),
               f"model.checkpoint={text_ckpt}", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    strategies = json.loads(report.read_text())["strategies"]
    for name in ("snapshot", "interrupt_sync", "dedicated"):
        s = strategies[name]
        assert_exact_fp32(name, s)
        assert s["n_tokens"] > 0 and s["max_versions_per_sequence"] >= 2, (name, s)
        assert s["n_spliced_sequences"] >= 2, (name, s)
    loglinear = strategies["loglinear"]
    assert not loglinear["claims_exact"] and loglinear["max_abs_err"] > 0
    # both v_theta conventions are measured; the run trained with megarl's, so its error is that one
    assert loglinear["convention"] == "megarl" and set(loglinear["conventions"]) == {"megarl", "areal"}
    assert loglinear["max_abs_err"] == loglinear["conventions"]["megarl"]["max_abs_err"]


def assert_spliced_across_the_restart(name: str, s: dict) -> None:
    """A --restart-at run: rows that hold tokens of both sides of the restart were checked, and the resume
    continued every trajectory the checkpoint kept, generating none again."""
    r = s["restart"]
    assert 2 <= r["stopped_at_step"] <= 5 and r["n_partial_rows_kept"] >= 1, (name, r)
    assert r["n_spliced_across_restart"] >= 1, (name, r)
    assert s["n_continued_after_resume"] >= r["n_partial_rows_kept"] and s["n_regenerated_after_resume"] == 0, s


def test_verify_exact_strategies_multi_turn(text_ckpt, tmp_path):
    # a multi-turn trajectory waits between its turns (tool, next turn) through publishes: it must be
    # reported as partial then, or its earlier-version segments are lost to dedicated. --restart-at 2: each run
    # is stopped by SIGTERM from step 2 on with an answer under way and resumed from its checkpoint, where the
    # episode goes on at its turn: every exact strategy is checked on rows spliced across the restart too
    report = tmp_path / "report.json"
    r = megarl("verify-recovery", "--config", "configs/verify_cpu.yaml", "--strategies",
               "snapshot,interrupt_sync,dedicated", "--steps", "6", "--restart-at", "2", "--output", str(report),
               f"model.checkpoint={text_ckpt}", "rollout.workflow=multi_turn", "rollout.max_turns=4", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name, s in json.loads(report.read_text())["strategies"].items():
        assert_exact_fp32(name, s)
        assert s["max_versions_per_sequence"] >= 2 and s["n_spliced_sequences"] >= 2, (name, s)
        # policy tokens only: tool output is never scored
        assert 0 < s["n_tokens"] < 6 * 2 * 64, (name, s)
        assert_spliced_across_the_restart(name, s)


def test_verify_across_a_restart_fails_on_a_wrong_version_in_the_checkpoint(text_ckpt, tmp_path):
    # the negative control of the restart mode: the kept tokens of one partial answer claim the version before
    # their own in the checkpoint the resume loads (signed again with the run's key, so it is loaded)
    report = tmp_path / "report.json"
    r = megarl("verify-recovery", "--config", "configs/verify_cpu.yaml", "--strategies", "interrupt_sync",
               "--steps", "6", "--restart-at", "2", "--negative-control", "restart_wrong_version", "--output",
               str(report), f"model.checkpoint={text_ckpt}", "rollout.workflow=multi_turn", "rollout.max_turns=4",
               timeout=600)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(report.read_text())["strategies"]["interrupt_sync"]
    assert s["restart"]["wrong_version_stored_for"], s["restart"]
    assert not s["measured_exact"] and s["max_abs_err"] > 1e-3, s
    assert s["oracle"]["passed"] is False and "the engine oracle failed" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("override,message", [
    ("data.path={missing}", "does not exist"),
    ("eval.path={missing}", "does not exist"),
    ("data.prompt_key=question", "reverse_digits_short_train.jsonl:1: no field 'question' (data.prompt_key)"),
    ("model.tokenizer={tmp}", "no tokenizer files"),
    ("reward.fn=no_such_module.fn", "no_such_module"),
    ("data.max_prompt_len=200", "max_position_embeddings"),
    ("trainer.batch_size=30", "multiple of rollout.group_size"),
    ("trainer.publish_every=4", "set trainer.publish_every <= 3"),  # tiny_cpu.yaml: eta = 2
])
def test_bad_input_fails_before_the_run(ckpt, tmp_path, override, message):
    out = tmp_path / "run"
    override = override.format(missing=tmp_path / "missing.jsonl", tmp=tmp_path)
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
    long.write_text(json.dumps({"prompt": "1" * 30, "answer": "1"}) + "\n")
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", f"model.checkpoint={ckpt}", f"data.path={long}",
               "--output-dir", str(tmp_path / "r2"), timeout=120)
    assert r.returncode == 2 and "every prompt" in r.stderr and "raise data.max_prompt_len" in r.stderr, \
        r.stderr[-2000:]
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        (no_tok / f).write_bytes((ckpt / f).read_bytes())
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", f"model.checkpoint={no_tok}",
               "--output-dir", str(tmp_path / "r3"), timeout=120)
    assert r.returncode == 2 and "no tokenizer files" in r.stderr and str(no_tok) in r.stderr \
        and "model.tokenizer" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "r3").exists()


def test_a_reward_that_fails_on_most_calls_stops_the_run(ckpt, tmp_path):
    # the code reward needs test snippets; reverse-digit rows have none, so every call raises
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(tmp_path), f"model.checkpoint={ckpt}",
               "reward.fn=code", "trainer.total_steps=5", "rollout.backend=hf", *SMALL, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "reward calls failed" in r.stderr and "reward.max_fail_frac=0.5" in r.stderr, r.stderr[-3000:]
    assert "ValueError: code reward needs tests" in r.stderr, r.stderr[-3000:]  # one failing call's exception
    assert "Traceback" not in r.stderr
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) <= 1  # it stopped at the first step


def test_math_on_text_problems_end_to_end(tmp_path):
    # text data, the math reward and evaluation; the hf engine (no engine start-up: 40 s less than vLLM here),
    # the vLLM engine runs the same loop in test_async_run_outputs
    r = megarl("train", "--config", "configs/tiny_math_cpu.yaml", "--output-dir", str(tmp_path / "run"),
               f"model.checkpoint={tmp_path / 'ckpt'}", "trainer.total_steps=4", "eval.every=2", "rollout.backend=hf",
               "logging.progress=none", "logging.tensorboard=false", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "reward_mean" in x]
    assert len(steps) == 4 and sum(x["n_reward_calls"] for x in steps) >= 4 * 32
    assert all(x["n_reward_failed"] == 0 for x in steps)
    assert [x["eval/n_reward_failed"] for x in lines if "eval/reward_mean" in x] == [0, 0]
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("<|im_start|>user\nWhat is ") and "\\boxed{}" in sample["prompt"]


def test_multi_turn_workflow_with_reference_kl(ckpt, tmp_path):
    r = megarl("train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(tmp_path), f"model.checkpoint={ckpt}",
               "rollout.workflow=multi_turn", "rollout.max_turns=3", "advantage.kl_coef=0.05",
               "recovery.name=interrupt_sync", "trainer.total_steps=3", "logging.tensorboard=false",
               "rollout.backend=hf", *SMALL)
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
