"""One run through a seeded schedule of faults, over three attempts of the real `megarl train` CLI with `--resume`.

Attempt 1 (fresh): the engine, then the reward worker are SIGKILLed (the run
goes on: the supervisor restarts the engine and resubmits its requests, the
worker pool replaces the worker and the call that finds it dead counts as a
failed reward), then the dedicated scoring process is SIGKILLed between steps
(the run stops with its error; the strategy's state cannot be saved without the
process, so the newest periodic checkpoint stands). Between attempts the newest
checkpoint is damaged. Attempt 2 resumes from the newest valid one, setting the
damaged one aside, checkpoints after every step and is stopped by SIGTERM
(checkpoint, exit code 75). Attempt 3 resumes and finishes.

Checked at the end (the definitions of "accepted" and "trained" are
megarl/checkpoint/run_checkpoint.py's): metrics hold steps and versions 1..N without a gap or a
repeat; every trajectory accepted before the checkpoint an attempt resumed from
is trained exactly once, later accepts of that attempt are generated again under
new ids (or, running at that checkpoint, kept in it and continued under their own),
no id is trained twice, every id accepted up to the final checkpoint is
trained or waits in its buffer; the damaged checkpoint is set aside whole and
it and the valid ones are kept as ``logging.keep_last`` says. Attempt 1's kill leaves
groups accepted after the checkpoint attempt 2 resumes from, redone under new
ids (a non-empty set). From the tensors alone (tests/e2e/adam_oracle.py):
attempt 2's first step is one AdamW step from that checkpoint's trainer state,
the weights it published are the ones it trained, and the dedicated scorer's
weights in both checkpoints are their trainer's.

The scorer is killed between steps, not half way through a reply: from outside
its process the moment its queue's feeder thread writes cannot be hit
reliably (tests/unit/test_dedicated_queue_link.py writes half a reply itself).
"""
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

from adam_oracle import assert_resumed_from, equal, params, strategy_state, to_hf, trainer_state
from conftest import ROOT, run_megarl
from test_resume import SMALL, jsonl, kept_running, process_gone, start, wait_for

SEED = 3
TOTAL = 10
KEEP = 3
ARGS = ["--config", "configs/tiny_cpu.yaml", "recovery.name=dedicated", "rollout.backend=hf",
        "rollout.health_interval_s=1", *[a for a in SMALL if not a.startswith("logging.keep_last")],
        f"logging.keep_last={KEEP}", f"trainer.total_steps={TOTAL}"]


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process below ``pid``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        out.append((p, cmd))
        todo.extend(children.get(p, []))
    return out


def the_process(run_pid: int, marker: str) -> int:
    """The one process below the run whose command line holds ``marker``."""
    found = [p for p, cmd in descendants(run_pid) if marker in cmd]
    assert len(found) == 1, f"{marker!r}: {descendants(run_pid)}"
    return found[0]


def steps_done(run: Path) -> int:
    return len(jsonl(run / "metrics.jsonl"))


def step_dirs(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))


def kill_at(proc, run: Path, log: Path, step: int, pid: int, what: str, schedule: list) -> None:
    """SIGKILL ``pid`` once ``step`` steps are done; record what was done when."""
    wait_for(lambda: steps_done(run) >= step, proc, log)
    os.kill(pid, signal.SIGKILL)
    schedule.append((what, steps_done(run)))
    assert process_gone(pid), f"{what} {pid} survived SIGKILL"


def test_a_seeded_schedule_of_faults_loses_nothing(ckpt, tmp_path):
    rng = random.Random(SEED)
    engine_at = rng.randint(1, 2)
    worker_at = engine_at + rng.randint(1, 2)
    scorer_at = worker_at + rng.randint(2, 3)
    sigterm_after = rng.randint(1, 2)  # steps attempt 2 does before its SIGTERM
    run, args, schedule, t_start = tmp_path / "run", [*ARGS, f"model.checkpoint={ckpt}"], [], time.monotonic()

    # -- attempt 1: engine, reward worker, then the dedicated scorer are killed
    log1 = tmp_path / "attempt1.log"
    first = start(["train", "--output-dir", str(run), *args], log1)
    try:
        wait_for(lambda: (run / "engine0.pid").is_file() and steps_done(run) >= 1, first, log1)
        engine = int((run / "engine0.pid").read_text())
        kill_at(first, run, log1, engine_at, engine, "engine", schedule)
        worker = the_process(first.pid, "megarl.workers.process")
        kill_at(first, run, log1, worker_at, worker, "reward worker", schedule)
        scorer = the_process(first.pid, "multiprocessing.spawn")
        kill_at(first, run, log1, scorer_at, scorer, "dedicated scorer", schedule)
        rc1 = first.wait(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    text = log1.read_text()
    print(f"\nschedule (fault, steps done when injected): {schedule}; attempt 1: {time.monotonic() - t_start:.1f} s")
    # one clear line (a MegarlError: no traceback) that says how to go on
    assert rc1 == 2 and ("megarl train: error: dedicated scoring process died (exit code -9)" in text
                         and "--resume RUN_DIR" in text), text[-3000:]
    metrics1 = jsonl(run / "metrics.jsonl")
    assert metrics1[-1]["n_engine_restarts"] == 1 and metrics1[-1]["n_engine_failures"] == 1, text[-3000:]
    assert sum(r["n_engine_resubmits"] for r in metrics1) > 0
    # one worker: the call that finds it dead fails (a reward of 0), the pool replaces it
    assert sum(r["n_reward_failed"] for r in metrics1) == 1, "the killed worker's sample is a failed reward"
    assert "reward 'reverse_digits' failed (crash)" in text
    journal1 = {name: jsonl(run / name) for name in ("accepted.jsonl", "trained_ids.jsonl")}
    # without its scoring process the strategy's state cannot be saved (the segments it had not scored yet
    # are lost with it): the step reached is not checkpointed, the newest periodic checkpoint stands
    reached = len(metrics1)
    k1 = step_dirs(run)[-1]
    assert k1 % 2 == 0 and reached - 2 <= k1 <= reached, (reached, step_dirs(run))
    if k1 != reached:
        assert "the checkpoint before stopping on ScorerError failed" in text, text[-3000:]

    # -- between attempts: the newest checkpoint is damaged (its trainer state cut short)
    valid = step_dirs(run)[:-1]
    assert valid, f"no older checkpoint to fall back on: {step_dirs(run)}"
    damaged = run / "checkpoints" / f"step_{k1}" / "trainer" / "__0_0.distcp"
    size = damaged.stat().st_size
    os.truncate(damaged, size // 2)
    back_to = valid[-1]
    manifest2 = json.loads((run / "checkpoints" / f"step_{back_to}" / "manifest.json").read_text())
    resumed_from = tmp_path / f"step_{back_to}"  # attempt 2's keep_last may remove it
    shutil.copytree(run / "checkpoints" / f"step_{back_to}", resumed_from)
    _, running2 = kept_running(resumed_from)

    # -- attempt 2: resumes from the newest valid checkpoint, checkpoints every step, stopped by SIGTERM
    log2 = tmp_path / "attempt2.log"
    t2 = time.monotonic()
    second = start(["train", "--resume", str(run), *args, "logging.save_every=1"], log2)
    try:
        # metrics.jsonl holds attempt 1's lines until the resume rewinds it, then records the attempt
        wait_for(lambda: len(jsonl(run / "resumes.jsonl")) == 1 and steps_done(run) >= back_to + sigterm_after,
                 second, log2)
        second.send_signal(signal.SIGTERM)
        rc2 = second.wait(timeout=120)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    text = log2.read_text()
    k2 = steps_done(run)
    assert rc2 == 75 and f"stopped by SIGTERM at step {k2}, checkpointed" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert process_gone(int((run / "engine0.pid").read_text())), "the engine is stopped with the SIGTERMed run"
    written2 = list(range(back_to + 1, k2 + 1))
    kept2 = sorted({*valid, *written2})[-KEEP:]
    set_aside = run / "checkpoints" / f"damaged_step_{k1}"
    if k1 > kept2[0]:  # else pruned with the checkpoints older than those kept
        assert (set_aside / "trainer" / "__0_0.distcp").stat().st_size == size // 2, "the damaged one is kept as it was"
    else:
        assert not set_aside.exists(), "the damaged checkpoint outlived keep_last"
    assert step_dirs(run) == kept2, "only keep_last removes valid checkpoints"
    # the trainer attempt 2 resumed is step back_to's; the dedicated scorer's weights are its trainer's
    first_step = run / "checkpoints" / f"step_{back_to + 1}"
    hf = json.loads((ckpt / "config.json").read_text())
    published = assert_resumed_from(resumed_from, first_step, hf, ROOT / "configs" / "tiny_cpu.yaml",
                                    total_steps=TOTAL)
    for step_dir, version, weights in ((resumed_from, back_to, to_hf(params(trainer_state(resumed_from)), hf)),
                                       (first_step, back_to + 1, published)):
        scorer = strategy_state(step_dir)
        assert scorer["version"] == version and equal(scorer["weights"]["model.safetensors"], weights), step_dir
    journal2 = {name: jsonl(run / name) for name in ("accepted.jsonl", "trained_ids.jsonl")}
    manifest3 = json.loads((run / "checkpoints" / f"step_{k2}" / "manifest.json").read_text())
    _, running3 = kept_running(run / "checkpoints" / f"step_{k2}")
    print(f"attempt 1 stopped at step {reached}; attempt 2 resumed from step {back_to} (step_{k1} damaged), "
          f"SIGTERM at step {k2}: "
          f"{time.monotonic() - t2:.1f} s")

    # -- attempt 3: resumes from the SIGTERM's checkpoint and finishes
    t3 = time.monotonic()
    third = run_megarl("train", "--resume", str(run), *args, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    print(f"attempt 3 from step {k2} to {TOTAL}: {time.monotonic() - t3:.1f} s; "
          f"total {time.monotonic() - t_start:.1f} s")

    metrics = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, TOTAL + 1))
    assert [r["version"] for r in metrics] == list(range(1, TOTAL + 1)), "versions continue without a gap"
    assert [(r["attempt"], r["step"]) for r in jsonl(run / "resumes.jsonl")] == [(1, back_to), (2, k2)]

    trained_lines = jsonl(run / "trained_ids.jsonl")
    assert [r["step"] for r in trained_lines] == list(range(1, TOTAL + 1))
    trained = [i for r in trained_lines for i in r["traj_ids"]]
    assert len(trained) == len(set(trained)) == TOTAL * 32, "a trajectory was trained twice"
    accepted_lines = jsonl(run / "accepted.jsonl")
    accepted = [i for r in accepted_lines for i in r["traj_ids"]]
    assert len(accepted) == len(set(accepted)) and set(trained) <= set(accepted)
    redone = []  # per attempt: its accepts after the checkpoint the next one resumed from
    for journal, step, total, running in ((journal1, back_to, manifest2["accepted_total"], running2),
                                          (journal2, k2, manifest3["accepted_total"], running3)):
        before = [r for r in journal["accepted.jsonl"] if r["accepted_total"] <= total]
        assert before and accepted_lines[:len(before)] == before
        for i in (i for r in before for i in r["traj_ids"]):
            assert trained.count(i) == 1, f"{i} was accepted before step {step}'s checkpoint but trained " \
                                          f"{trained.count(i)} times"
        after = {i for r in journal["accepted.jsonl"] if r["accepted_total"] > total for i in r["traj_ids"]}
        assert after & set(accepted) <= running, \
            f"groups accepted after step {step}'s checkpoint come back under new ids, unless it kept them running"
        redone.append(after)
        assert trained_lines[:step] == [r for r in journal["trained_ids.jsonl"] if r["step"] <= step]
    assert redone[0], f"attempt 1 accepted nothing after step {back_to}'s checkpoint: nothing was redone"
    # the end: every trajectory accepted up to the final checkpoint is trained once or waits in its buffer
    from megarl.checkpoint.run_checkpoint import load_file

    final = run / "checkpoints" / f"step_{TOTAL}"
    state = load_file(final / "controller.pt")["buffer"]
    waiting = [t["traj_id"] for g in state["ready"] for t in g["trajectories"]]
    upto = [i for r in accepted_lines if r["accepted_total"] <= state["accepted_total"] for i in r["traj_ids"]]
    assert sorted(upto) == sorted(trained + waiting), "an accepted trajectory was neither trained nor kept"
    written3 = [s for s in range(k2 + 1, TOTAL + 1) if s % 2 == 0 or s == TOTAL]
    kept3 = sorted({*kept2, *written3})[-KEEP:]
    assert step_dirs(run) == kept3
    assert [p.name for p in (run / "checkpoints").glob("damaged_*")] == ([f"damaged_step_{k1}"] if k1 > kept3[0]
                                                                         else []), "damaged ones go with keep_last"
    assert (run / "final" / "model.safetensors").is_file()
    assert process_gone(int((run / "engine0.pid").read_text())), "the engine is stopped with the run"
