"""Every code block of README.md and docs/guide.md is checked (tests/doc_blocks.py lists how), and the blocks a
CPU can run run here as written, their text read from the docs.

The GPU quick start's blocks run in test_gpu_quickstart.py, the README's `megarl train` commands in
tests/e2e/test_train.py; this file checks that those are the blocks' commands.
"""
from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import CHECKS, DOCS, ROOT, Block, Check, all_blocks, block, extract, problems
from test_agents import ScriptedModel

from megarl.builder import load_run_config
from megarl.cli import main
from megarl.types import Trajectory
from megarl.workflows.agent_http import AgentHttpWorkflow
from megarl.workflows.registry import build_workflow

#: the config the agent examples' settings are applied to: the shipped agent config
AGENT_CONFIG = "configs/tiny_agent_cpu.yaml"


def header_overrides(b: Block) -> list[str]:
    """The settings an example's first line names: ``# file.py -- key=value key=value``."""
    first = b.text.splitlines()[0]
    assert first.startswith("# ") and " -- " in first, f"{b.where}: the example's first line names no settings"
    return shlex.split(first.split(" -- ", 1)[1])


# -- the listing ----------------------------------------------------------------------------------------------
def test_every_block_of_the_docs_is_checked():
    assert problems(all_blocks(), CHECKS) == []


def test_the_listing_names_an_unmarked_an_unlisted_and_an_edited_block(tmp_path):
    (tmp_path / "t.py").write_text("def test_x():\n    assert 'other'\n")
    (tmp_path / "doc.md").write_text(
        "Intro:\n\n    echo unmarked\n\n<!-- doc-test: unlisted -->\n    echo 1\n\n"
        "<!-- doc-test: listing -->\n```text\nan output\n```\n\n<!-- doc-test: runs -->\n    echo 2\n")
    blocks = extract("doc.md", tmp_path)
    assert [(b.line, b.name) for b in blocks] == [(3, None), (6, "unlisted"), (10, "listing"), (14, "runs")]
    checks = {"listing": Check("not-runnable", "an output listing", sha=blocks[2].sha),
              "runs": Check("run", "t.py::test_x"), "gone": Check("same", "t.py::test_x")}
    assert problems(blocks, checks, tmp_path) == [
        "doc.md:3: a code block without a <!-- doc-test: NAME --> marker on the line before it; mark it and say "
        "in tests/doc_blocks.py CHECKS how it is checked",
        "doc.md:6: block 'unlisted' is not in tests/doc_blocks.py CHECKS: add how it is checked",
        "doc.md:14: block 'runs': t.py::test_x does not name the block 'runs': it cannot be the test that runs it",
        "tests/doc_blocks.py CHECKS: 'gone' names no block in the docs"]
    (tmp_path / "doc.md").write_text("<!-- doc-test: listing -->\n```text\nan edited output\n```\n")
    (edited,) = extract("doc.md", tmp_path)
    assert problems([edited], checks, tmp_path)[0].startswith(
        "doc.md:3: block 'listing' changed since it was classed not runnable (an output listing)")


def test_the_blocks_are_those_a_commonmark_reader_finds():
    markdown_it = pytest.importorskip("markdown_it")
    for doc in DOCS:
        tokens = markdown_it.MarkdownIt("commonmark").parse((ROOT / doc).read_text())
        code = [(t.map[0] + 1 + (t.type == "fence"), t.content) for t in tokens if t.type in ("fence", "code_block")]
        assert [(b.line, b.text) for b in extract(doc)] == code, doc


# -- commands that CI or a longer test runs ------------------------------------------------------------------
def test_ci_runs_exactly_the_readme_test_command():
    ci = [x for x in (ROOT / ".ci/run").read_text().splitlines() if x.strip() and not x.startswith(("#", "set ",
                                                                                                      "cd "))]
    assert ci == block("tests").commands() == ["bash scripts/test.sh"]


def test_the_demo_is_the_train_command_the_e2e_run_starts():
    # the demo is `megarl train --config configs/tiny_cpu.yaml` for 1000 steps; tests/e2e/test_train.py runs the
    # README's strategy commands, which are the same command with recovery.name set, for 3 and 8 steps
    assert block("demo").commands() == ["bash scripts/demo.sh"]
    (exec_line,) = [x for x in (ROOT / "scripts/demo.sh").read_text().splitlines() if x.startswith("exec ")]
    demo = shlex.split(exec_line)[1:]
    assert demo[0] == ".venv/bin/megarl" and demo[-1] == "$@", exec_line
    for cmd in block("train-strategies").commands():
        argv = shlex.split(cmd)
        assert argv[:len(demo) - 1] == ["megarl", *demo[1:-1]] and argv[len(demo) - 1].startswith("recovery."), cmd


def test_the_gpu_quick_start_blocks_are_what_its_test_runs():
    from test_gpu_quickstart import quickstart_commands

    names = ("gpu-install", "gpu-check", "gpu-download", "gpu-data-check", "gpu-plan", "gpu-plan-30b", "gpu-submit")
    assert [shlex.split(c) for name in names for c in block(name).commands()] == \
        [shlex.split(c) for c in quickstart_commands()]


def _loop_multirank():
    path = ROOT / "tests/distributed/test_loop_multirank.py"
    spec = importlib.util.spec_from_file_location("doc_loop_multirank", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.test_two_trainer_ranks_end_to_end


def test_the_guides_two_rank_commands_are_what_the_distributed_test_runs():
    # tests/distributed/test_loop_multirank.py runs them on the HF engine for 3 steps: it appends
    # rollout.backend=hf and its step limits to the guide's settings
    test = _loop_multirank()
    (params,) = [m.args[1] for m in test.pytestmark if m.name == "parametrize"]
    assert '"--config", "configs/tiny_cpu.yaml", "placement.trainer_ranks=2"' in inspect.getsource(test)
    for cmd in block("guide-ranks").commands():
        argv = shlex.split(cmd)
        launcher, settings = Path(argv[1]).name, set(argv[4:])
        assert argv[0] == "bash" and argv[2:4] == ["--config", "configs/tiny_cpu.yaml"], cmd
        runs = [set(extra) | {"placement.trainer_ranks=2"} for name, extra in params if name == launcher]
        assert any(settings <= run and run - settings == {"rollout.backend=hf"} for run in runs), (cmd, runs)


# -- blocks run here ------------------------------------------------------------------------------------------
def test_the_data_rows_load_as_rows(tmp_path, text_tokenizer):
    from megarl.data import PromptDataset

    path = tmp_path / "rows.jsonl"
    path.write_text(block("data-rows").text)
    ds = PromptDataset(str(path), text_tokenizer, shuffle=False, max_prompt_len=1000)
    first, second = next(ds), next(ds)
    assert (first.answer, second.answer) == ("22", "...")
    assert "What is 17 + 5?" in text_tokenizer.decode_prompt(first.prompt_ids)


def test_prepare_data_runs_as_written(tmp_path, monkeypatch, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_prepare_data import ROWS

    (cmd,) = block("prepare-data").commands()
    argv = shlex.split(cmd)
    src, dst = Path(argv[argv.index("--input") + 1]), Path(argv[argv.index("--output") + 1])
    monkeypatch.chdir(tmp_path)  # GSM8K's file where the command says, in a fresh working directory
    src.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS), src)
    assert argv[0] == "megarl" and main(argv[1:]) == 0
    assert f"wrote 2 rows to {dst}" in capsys.readouterr().out
    assert [json.loads(x)["answer"] for x in dst.read_text().splitlines()] == ["7", "2400"]


def test_the_guides_dry_run_runs_as_written():
    (cmd,) = block("guide-dry-run").commands()
    r = subprocess.run(shlex.split(cmd), cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "qwen3_30b_a3b_h100.yaml" in r.stdout + r.stderr


def test_the_guides_advise_command_loads_its_config():
    # the calibration takes minutes of CPU (tests/e2e/test_advise.py runs `megarl advise` on the tiny MoE):
    # here the command is one megarl knows and its config and settings load
    (cmd,) = block("guide-advise").commands()
    argv = shlex.split(cmd)
    assert argv[:3] == ["megarl", "advise", "--config"]
    cfg = load_run_config(ROOT / argv[3], argv[4:])
    assert cfg.rollout.dtype == "bfloat16"
    with pytest.raises(SystemExit) as e:
        main(["advise", "--help"])
    assert e.value.code == 0


def test_every_path_of_the_guides_layout_exists():
    paths = [p.strip() for line in block("guide-layout").text.splitlines() if not line.startswith(" ")
             for p in line.split("  ")[0].split(",")]
    assert len(paths) >= 30 and "megarl/types.py" in paths
    assert [p for p in paths if not (ROOT / p).exists()] == []


async def _episode(wf, row: dict, outputs: list[str]):
    """One episode of ``wf`` on ``row`` with the model replying ``outputs``; the trajectory and the model."""
    model = ScriptedModel(wf.tokenizer, outputs)
    traj = Trajectory("g0-0", "g0", [1], meta={"row": row}, logp_old=[])
    try:
        return await wf.run(traj, model), model
    finally:
        if isinstance(wf, AgentHttpWorkflow):  # its endpoint listens on this event loop
            await wf.aclose()
        wf.close()


def test_the_agent_function_example_runs_an_episode_with_its_tool(tmp_path, monkeypatch, text_tokenizer):
    b = block("agent-fn")
    settings = header_overrides(b)
    module, _, _ = next(s for s in settings if s.startswith("agent.fn=")).split("=", 1)[1].partition(":")
    (tmp_path / f"{module}.py").write_text(b.text)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_run_config(ROOT / AGENT_CONFIG, settings)
    wf = build_workflow(cfg.rollout.workflow, cfg, text_tokenizer)
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
    traj, model = asyncio.run(_episode(wf, {"prompt": "what is 6 * 7?", "answer": "42"}, [call, "\\boxed{42}"]))
    assert "agent_error" not in traj.meta, traj.meta.get("agent_error")
    assert traj.meta["final_response"] == "\\boxed{42}" and wf.stats()["n_tool_calls"] == 1
    assert "what is 6 * 7?" in text_tokenizer.decode_prompt(model.contexts[0])
    assert "42" in text_tokenizer.decode_prompt(model.contexts[1][len(model.contexts[0]):])  # the tool's result


def test_the_agent_command_example_runs_an_episode(tmp_path, monkeypatch, text_tokenizer):
    # the command as written, `python agent.py`, in a directory holding the example as agent.py; the command's
    # /tmp is its own, so that directory is made visible to it (agent.command_writable, appended here)
    b = block("agent-http")
    settings = header_overrides(b)
    (script,) = [a for a in shlex.split(next(s for s in settings if s.startswith("agent.command=")).split("=", 1)[1])
                 if a.endswith(".py")]
    (tmp_path / script).write_text(b.text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # `python`
    cfg = load_run_config(ROOT / AGENT_CONFIG, [*settings, f"agent.command_writable=[{tmp_path}]"])
    wf = build_workflow(cfg.rollout.workflow, cfg, text_tokenizer)
    traj, model = asyncio.run(_episode(wf, {"prompt": "what is 1 + 2?", "answer": "3"}, ["it is\n\\boxed{3}"]))
    assert "agent_error" not in traj.meta, traj.meta.get("agent_error")
    assert traj.meta["final_response"] == "it is \\boxed{3}" and wf.stats()["n_agent_failed"] == 0
    assert len(model.contexts) == 1
