"""Agents on the real stack: vLLM CPU engine, Megatron trainer, a real HF tokenizer whose template shows tools."""
import json
import socket
import subprocess
import sys

from conftest import ENV, MEGARL, ROOT, assert_exact_fp32, assert_namespaced, run_megarl

SCRIPTED = "agent.fn=tests.unit.agent_fixtures:scripted"  # three turns, a tool result after each


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_scripted_agent_under_interruptions_is_recovered_exactly(tmp_path):
    # configs/verify_vllm_cpu.yaml: long answers, two requests in flight and a publish per step, so
    # publishes land inside turns and between them; and every other group's episodes are held at their 8th
    # token until a publish (rollout.splice_at_tokens), so some are spliced whatever the timing. dedicated
    # scores agent episodes in the test of spliced episodes below (and multi-turn ones in test_train.py)
    report = tmp_path / "report.json"
    r = run_megarl("verify-recovery", "--config", "configs/verify_vllm_cpu.yaml", "--strategies",
                   "snapshot,interrupt_sync", "--steps", "4", "--output", str(report),
                   f"model.checkpoint={tmp_path / 'text_model'}", "rollout.workflow=agent", SCRIPTED,
                   "agent.max_turns=3", "agent.max_tokens=400", "rollout.max_new_tokens=64", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name, s in json.loads(report.read_text())["strategies"].items():
        assert_exact_fp32(name, s)
        assert s["max_versions_per_sequence"] >= 2 and s["n_spliced_sequences"] >= 2, (name, s)
        steps = [x for x in _lines(tmp_path / f"verify-{name}" / "metrics.jsonl") if "reward_mean" in x]
        # every episode ran its three turns, each recorded token-exactly (a mismatch fails the group)
        assert sum(x["n_dropped"] for x in steps) == 0 and sum(x["n_agent_failed"] for x in steps) == 0
        assert sum(x["n_agent_turns"] for x in steps) >= 3 * 4 * 4 and sum(x["n_splice_holds"] for x in steps) > 0


def test_math_with_python_agent_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    # the hf engine: no engine start-up; the vLLM engine serves agents in the test above
    r = run_megarl("train", "--config", "configs/tiny_agent_cpu.yaml", "--output-dir", str(run_dir),
                   f"model.checkpoint={tmp_path / 'ckpt'}", "trainer.total_steps=4", "eval.every=2",
                   "rollout.backend=hf", "logging.progress=none", "logging.tensorboard=false", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = _lines(run_dir / "metrics.jsonl")
    steps = [x for x in lines if "reward_mean" in x]
    # the math reward never failed; the random model runs some episodes past their token budget (each
    # counted in n_agent_failed, and as a failed reward outcome), and the run goes on
    assert len(steps) == 4 and all(x["n_reward_failed"] == x["n_agent_failed"] for x in steps)
    assert sum(x["n_agent_failed"] for x in steps) < sum(x["n_reward_calls"] for x in steps) / 2
    assert sum(x["n_agent_turns"] for x in steps) >= 4 * 16 and sum(x["n_tool_calls"] for x in steps) > 0
    assert_namespaced(lines, verl=False)  # the agent's own counters have one too
    assert [x["step"] for x in lines if "eval/reward_mean" in x] == [2, 4]
    sample = _lines(run_dir / "samples.jsonl")[0]
    assert "<tools>" in sample["prompt"] and '"name": "python"' in sample["prompt"]


def test_an_agent_in_another_process_is_recovered_exactly_on_spliced_episodes(tmp_path):
    # each episode runs tests/e2e/agent_http_probe.py: three key probes, then the example calculator agent (the
    # official openai package, a tool of its own) against the run's endpoint. The odd groups' episodes are held
    # at their 4th token until the next publish (rollout.splice_at_tokens). With 4 agents at once, group 1's two
    # start beside group 0's and are held at version 0, long before group 0's episodes end and the first publish;
    # with eta 2 group 1 is due at step 3, so it is trained by then
    report, probe = tmp_path / "report.json", tmp_path / "probe.jsonl"
    r = run_megarl("verify-recovery", "--config", "configs/verify_cpu.yaml", "--strategies",
                   "snapshot,interrupt_sync,dedicated", "--steps", "3", "--output", str(report),
                   f"model.checkpoint={tmp_path / 'text_model'}", "rollout.workflow=agent_http", "agent.tools=[]",
                   f"agent.command={sys.executable} tests/e2e/agent_http_probe.py {probe}",
                   f"agent.command_writable=[{tmp_path}]",  # the probe's report; the rest is read-only to it
                   "rollout.splice_at_tokens=4", "rollout.max_concurrency=4", "rollout.max_new_tokens=48",
                   "agent.max_tokens=768", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    strategies = json.loads(report.read_text())["strategies"]
    episodes = 0
    for name, s in strategies.items():
        assert_exact_fp32(name, s)
        assert s["n_spliced_sequences"] >= 2 and s["max_versions_per_sequence"] >= 2, (name, s)
        steps = [x for x in _lines(tmp_path / f"verify-{name}" / "metrics.jsonl") if "reward_mean" in x]
        # every completion was recorded token-exactly (a mismatch fails its group: n_dropped)
        assert sum(x["n_dropped"] for x in steps) == 0 and sum(x["n_splice_holds"] for x in steps) >= 2
        assert all(x["n_reward_failed"] == x["n_agent_failed"] for x in steps)
        assert sum(x["n_agent_turns"] for x in steps) >= sum(x["n_reward_calls"] for x in steps) > 0
        episodes += sum(x["n_reward_calls"] for x in steps)
    # every episode's command was refused without a key and with a made-up one, and served with its own
    probes = [p for p in _lines(probe) if "no_key" in p]
    assert len(probes) >= episodes
    assert all({k: p[k] for k in ("no_key", "unknown_key", "own_key")} == {"no_key": 401, "unknown_key": 401,
                                                                           "own_key": 200} for p in probes)
    # the key of an episode that has ended is refused (later episodes find an earlier one's)
    finished = [p["finished_key"] for p in probes if "finished_key" in p]
    assert finished and set(finished) == {401}, finished
    # the tools the agent sent with its requests reached the chat template
    assert '"name": "add"' in _lines(tmp_path / "verify-snapshot" / "samples.jsonl")[0]["prompt"]


def test_an_agent_service_that_brings_its_rows_trains_the_run(tmp_path):
    # tests/e2e/row_service.py posts the rows of the arithmetic data (one malformed), three at a time, runs every
    # episode of each group it gets and reports the completion as the answer (scored by the math reward)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir, log = tmp_path / "run", tmp_path / "service.jsonl"
    env = {**ENV, "MEGARL_AGENT_SERVICE_KEY": "s3cret-service-key-0123"}
    service = subprocess.Popen([sys.executable, "tests/e2e/row_service.py", str(port),
                                "configs/data/arithmetic_train.jsonl", str(log)], cwd=ROOT, env=env)
    try:
        r = subprocess.run([*MEGARL, "train", "--config", "configs/tiny_agent_cpu.yaml", "--output-dir", str(run_dir),
                            f"model.checkpoint={tmp_path / 'ckpt'}", "trainer.total_steps=2", "rollout.backend=hf",
                            "rollout.workflow=agent_http", "agent.serve=true", "agent.rows_from_service=true",
                            f"agent.http_port={port}", "agent.row_wait_s=5", "data.path=", "agent.tools=[]",
                            "rollout.max_new_tokens=16", "eval.path=", "logging.progress=none",
                            "logging.tensorboard=false"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:
        service.terminate()
        service.wait(30)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = [x for x in _lines(run_dir / "metrics.jsonl") if "reward_mean" in x]
    assert len(steps) == 2 and sum(x["n_dropped"] for x in steps) == 0
    assert all(x["n_reward_failed"] == x["n_agent_failed"] for x in steps)
    assert sum(x["n_agent_turns"] for x in steps) >= sum(x["n_reward_calls"] for x in steps) >= 2 * 16
    posts = [x for x in _lines(log) if "post_status" in x]
    taken = [x for x in posts if x["post_status"] == 200]
    # each row taken was rolled out as one group of rollout.group_size=8 episodes, under its own group id
    assert len(taken) >= 4 and {x["n_sessions"] for x in taken} == {8}
    assert len({x["group_id"] for x in taken}) == len(taken)
    bad = [x for x in posts if x["row_id"] == "bad"]
    assert bad and bad[0]["post_status"] == 400 and "no field 'prompt' (data.prompt_key)" in bad[0]["error"]["message"]
    sample = _lines(run_dir / "samples.jsonl")[0]
    assert "Put the answer in \\boxed{}" in sample["prompt"]
