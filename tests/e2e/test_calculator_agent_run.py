"""The calculator agent through the real `megarl train` CLI (configs/tiny_calc_agent_cpu.yaml; the hf engine: no
engine start-up): episodes whose first reply is an operator get the calculator's result and a second turn."""
import json
import re

from conftest import run_megarl

from megarl.workflows.calculator import calculate, parse_problem


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_calculator_agent_trains_and_calls_the_tool(tmp_path):
    run_dir = tmp_path / "run"
    r = run_megarl("train", "--config", "configs/tiny_calc_agent_cpu.yaml", "--output-dir", str(run_dir),
                   f"model.checkpoint={tmp_path / 'ckpt'}", "trainer.total_steps=3", "trainer.batch_size=64",
                   "rollout.backend=hf", "eval.every=2", "eval.n_samples=1", "logging.progress=none",
                   "logging.tensorboard=false", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = _lines(run_dir / "metrics.jsonl")
    steps = [x for x in lines if "reward_mean" in x]
    assert len(steps) == 3 and sum(x["n_agent_failed"] + x["n_reward_failed"] + x["n_dropped"] for x in steps) == 0
    calls, episodes = sum(x["n_tool_calls"] for x in steps), sum(x["n_reward_calls"] for x in steps)
    # an episode has a second turn exactly when it called the calculator
    assert calls > 0 and sum(x["n_agent_turns"] for x in steps) == episodes + calls
    evals = [x for x in lines if "eval/reward_mean" in x]
    assert [x["step"] for x in evals] == [2, 3] and all(x["eval/n_reward_failed"] == 0 for x in evals)
    # samples.jsonl holds the steps' episodes: a reply starting with an operator got the calculator's result on the
    # problem's operands, then a second reply, in the same trajectory or, where the re-rendered conversation did
    # not extend the first reply's tokens (a reply cut at max_new_tokens, say), in the episode's next part
    # (traj_id + ".t1", whose prompt holds the conversation so far)
    samples = _lines(run_dir / "samples.jsonl")
    by_id = {s["traj_id"]: s for s in samples}
    called = [s for s in samples if s["response"].lstrip()[:1] in ("+", "*") and "." not in s["traj_id"]]
    tool = [s for s in called if "\nuser\n<tool_response>" in s["response"] or s["traj_id"] + ".t1" in by_id]
    assert tool
    for s in tool:
        a, _, b = parse_problem(re.search(r"user\n(\d+[+*]\d+)<", s["prompt"]).group(1))
        result = calculate(a, s["response"].lstrip()[0], b)
        rendered = f"user\n<tool_response>\n{result}\n</tool_response>"
        part = by_id.get(s["traj_id"] + ".t1")
        assert f"\n{rendered}\nassistant\n" in s["response"] or (part and rendered in part["prompt"]), (s, part)
