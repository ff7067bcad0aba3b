"""Checkpoints: manifest checks, atomic writes, keep_last, log rewinding, trainer and loop state round trips.

The loop test runs the real Controller and ReplayBuffer against the timing
simulators of test_staleness_gate.py, checkpoints it, "kills" it (drops the
objects), restores a fresh controller from the checkpointed state and checks
that no accepted trajectory is lost or trained twice: by the loop's journal, and
again from the simulated engines' own logs and the trainers' records alone
(tests/unit/loop_fixtures.py), which the checkpoint does not write.
"""
import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import ROOT
from loop_fixtures import make_controller

from megarl.checkpoint.rewind import rewind_run_logs
from megarl.checkpoint.run_checkpoint import (
    find_latest_checkpoint,
    list_checkpoints,
    remove_temp_dirs,
    verify_checkpoint,
    write_checkpoint,
)
from megarl.errors import CheckpointError


def fill_files(tmp: Path) -> None:
    (tmp / "controller.pt").write_bytes(b"controller state" * 10)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "rank0.pt").write_bytes(bytes(range(256)) * 4)


def test_manifest_lists_every_file_and_verifies(tmp_path):
    path = write_checkpoint(tmp_path / "checkpoints", 4, fill_files, meta={"accepted_total": 96})
    assert path.name == "step_4"
    manifest = verify_checkpoint(path)
    assert set(manifest["files"]) == {"controller.pt", "trainer/rank0.pt"}
    assert manifest["files"]["trainer/rank0.pt"]["size"] == 1024
    assert manifest["step"] == 4 and manifest["accepted_total"] == 96


@pytest.mark.parametrize("damage,message", [
    (lambda f: f.write_bytes(f.read_bytes()[:100] + bytes([f.read_bytes()[100] ^ 1]) + f.read_bytes()[101:]),
     "does not match its sha256"),
    (lambda f: f.write_bytes(f.read_bytes()[:-1]), "has 1023 bytes"),
    (lambda f: f.unlink(), "is missing"),
])
def test_damaged_file_is_refused_by_name(tmp_path, damage, message):
    path = write_checkpoint(tmp_path / "checkpoints", 2, fill_files)
    target = path / "trainer" / "rank0.pt"
    damage(target)
    with pytest.raises(CheckpointError, match=message) as e:
        verify_checkpoint(path)
    assert str(target) in str(e.value)


def test_missing_manifest_is_refused(tmp_path):
    path = write_checkpoint(tmp_path / "checkpoints", 2, fill_files)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        verify_checkpoint(path)


def test_failed_fill_leaves_nothing(tmp_path):
    def fill(tmp):
        fill_files(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_checkpoint(tmp_path / "checkpoints", 2, fill)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_crash_mid_write_leaves_no_step_dir(tmp_path):
    # a real crash: the writing process dies (os._exit) half-way through its files
    code = (f"import os; from pathlib import Path; from megarl.checkpoint.run_checkpoint import write_checkpoint\n"
            f"def fill(tmp):\n"
            f"    (tmp / 'controller.pt').write_bytes(b'x' * 1000)\n"
            f"    os._exit(9)\n"
            f"write_checkpoint(Path({str(tmp_path / 'checkpoints')!r}), 6, fill)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    root = tmp_path / "checkpoints"
    assert list_checkpoints(root) == []
    assert [p.name.startswith(".tmp-step_6") for p in root.iterdir()] == [True]
    with pytest.raises(CheckpointError, match="no checkpoint"):
        find_latest_checkpoint(tmp_path)
    remove_temp_dirs(root)
    assert list(root.iterdir()) == []


def test_keep_last_and_newest_valid(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        write_checkpoint(root, step, fill_files, keep_last=2)
    assert [s for s, _ in list_checkpoints(root)] == [6, 8]
    assert find_latest_checkpoint(tmp_path).name == "step_8"
    (root / "step_8" / "controller.pt").write_bytes(b"garbage")
    assert find_latest_checkpoint(tmp_path).name == "step_6"  # the newest whose files match
    (root / "step_6" / "controller.pt").unlink()
    with pytest.raises(CheckpointError) as e:
        find_latest_checkpoint(tmp_path)
    assert str(root / "step_8" / "controller.pt") in str(e.value)
    assert str(root / "step_6" / "controller.pt") in str(e.value)
    for step in (10, 12, 14):
        write_checkpoint(root, step, fill_files, keep_last=0)
    assert [s for s, _ in list_checkpoints(root)] == [6, 8, 10, 12, 14]


def test_same_step_is_replaced(tmp_path):
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 2, fill_files)
    write_checkpoint(root, 2, lambda tmp: (tmp / "controller.pt").write_bytes(b"new"))
    assert verify_checkpoint(root / "step_2")["files"].keys() == {"controller.pt"}
    assert [p.name for p in root.iterdir()] == ["step_2"]


def test_resume_of_missing_dir_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such run directory"):
        find_latest_checkpoint(tmp_path / "nope")


def test_rewind_run_logs(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)) + '{"st')
    (tmp_path / "trained_ids.jsonl").write_text("".join(json.dumps({"step": s, "traj_ids": [f"g{s}-0"]}) + "\n"
                                                        for s in range(1, 7)))
    (tmp_path / "accepted.jsonl").write_text("".join(json.dumps({"accepted_total": 8 * k}) + "\n"
                                                     for k in range(1, 10)))
    rewind_run_logs(tmp_path, {"step": 4, "accepted_total": 48})
    read = lambda name: [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    assert [r["step"] for r in read("metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["step"] for r in read("trained_ids.jsonl")] == [1, 2, 3, 4]
    assert [r["accepted_total"] for r in read("accepted.jsonl")] == [8, 16, 24, 32, 40, 48]


# -- trainer state ------------------------------------------------------------------------
def test_trainer_state_round_trip_is_bitwise(tmp_path):
    from recovery_scorer import make_traj, tiny_checkpoint

    from megarl.trainer.megatron_trainer import MegatronTrainer
    from megarl.types import TrainBatch

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    batch = TrainBatch.from_trajectories([make_traj("s0", [1, 4, 5], [("policy", 6, 0)], seed=11),
                                          make_traj("s1", [1, 6], [("policy", 5, 0)], seed=12)], version=0)

    def loss_fn(logp, mb, normalizer):
        return -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"], {}

    a = MegatronTrainer(str(ckpt), lr=1e-2, micro_batch_tokens=64, lr_warmup_steps=3)
    a.save_state(str(tmp_path / "before"))  # no optimizer yet: it is built lazily
    a.train_step(batch, loss_fn)
    a.train_step(batch, loss_fn)
    a.save_state(str(tmp_path / "state"))
    lr_a = a.train_step(batch, loss_fn)["lr"]
    want = a.get_params()

    b = MegatronTrainer(str(ckpt), lr=1e-2, micro_batch_tokens=64, lr_warmup_steps=3)
    b.load_state(str(tmp_path / "before"))
    assert b.version == 0 and b.optimizer is None
    b.load_state(str(tmp_path / "state"))
    assert b.version == 2
    lr_b = b.train_step(batch, loss_fn)["lr"]
    got = b.get_params()
    assert lr_a == lr_b and b.version == 3
    assert all(bool((want[k] == got[k]).all()) for k in want), "params after the resumed step differ"
    with pytest.raises(CheckpointError, match="megarl_trainer.pt is missing"):
        b.load_state(str(tmp_path / "nowhere"))


# -- the loop's state ----------------------------------------------------------------------
def _unfinished(log):
    """Trajectories an engine log leaves unfinished: a request with no answer yet, or an answer cut by an abort
    (a publish's interrupt: it is resubmitted with the partial answer)."""
    last = {}
    for kind, tid, *rest in log:
        last[tid] = kind == "start" or rest[1] == "abort"
    return [t for t, open_ in last.items() if open_]


# a trainer faster than generation is cut with groups in flight (kept in the checkpoint: continued where the
# workflow can continue an answer, else generated again under new ids); a slower one with a full buffer (carried
# over): each case is asserted non-empty where it is made sure of
@pytest.mark.parametrize("seed,slow_trainer,resumable", [(0, False, True), (1, False, False), (2, True, True),
                                                          (3, True, False)])
def test_loop_state_round_trip_loses_nothing(seed, slow_trainer, resumable):
    from megarl.types import SamplingParams
    from megarl.workflows.single_turn import SingleTurnWorkflow

    def workflow():  # megarl's single turn continues a cut answer; the gate tests' one cannot
        return SingleTurnWorkflow(SamplingParams(max_new_tokens=12)) if resumable else None

    delay = 0.03 if slow_trainer else 0.0
    for attempt in range(5):  # the fast trainer's case needs work unfinished at the cut: timing decides, so retry
        c1, t1, ck1, j1 = make_controller(seed + 1000 * attempt, train_delay_s=delay, workflow=workflow())
        asyncio.run(c1.train(8))  # "killed" after step 8; checkpoints at 3 and 6 (and 8, the end)
        if slow_trainer or _unfinished(c1.router.log[:ck1.cuts[6]]):
            break
    state = ck1.saved[6]
    c2, t2, ck2, j2 = make_controller(seed + 100, state, train_delay_s=delay, workflow=workflow())
    asyncio.run(c2.train(12))

    def ids_of(trained):
        return [i for _, _, ids in trained for i in ids]

    trained = ids_of(t1.trained[:6]) + ids_of(t2.trained)
    assert len(trained) == len(set(trained)) == 12 * 8, "a trajectory was trained twice"
    accepted_before = [i for rec in j1.lines["accepted"] if rec["accepted_total"] <= state["buffer"]["accepted_total"]
                       for i in rec["traj_ids"]]
    assert set(accepted_before) <= set(trained), "an accepted trajectory was lost"
    assert [v for v, _, _ in t2.trained] == list(range(6, 12)), "versions continue without a gap"
    assert all(max(v - x for x in vs) <= 2 for v, vs, _ in t2.trained)
    later = set(trained) - set(accepted_before)
    accepted_after = {i for rec in j2.lines["accepted"] for i in rec["traj_ids"]}
    assert later <= accepted_after, "everything else was accepted by the resumed run"
    gids = [rec["group_id"] for rec in j1.lines["accepted"]
            if rec["accepted_total"] <= state["buffer"]["accepted_total"]]
    gids += [rec["group_id"] for rec in j2.lines["accepted"]]
    assert len(gids) == len(set(gids)), "group ids are unique across the resume"
    running = {g["group_id"]: g for g in state["running_groups"]}  # kept whole by the checkpoint
    kept = {t["traj_id"]: t for g in running.values() for t in g["trajectories"]}
    resumed = [rec["group_id"] for rec in j2.lines["accepted"]]
    assert all(g in running or (g.startswith("r1.g") and int(g[4:]) >= state["group_counter"])
               for g in resumed), resumed
    assert {i for rec in j1.lines["accepted"] for i in rec["traj_ids"]} & accepted_after <= set(kept), \
        "the killed attempt's ids after the checkpoint come back only for what the checkpoint kept"

    # -- the same, from the engines' own logs (loop_fixtures.RecordingEngine) and the trainers' records alone
    log1, cut = c1.router.log, ck1.cuts[6]
    prompt = {}  # trajectory -> its prompt: the first request of it an engine saw
    for kind, tid, *rest in log1 + c2.router.log:
        if kind == "start":
            prompt.setdefault(tid, rest[0])
    trained1, trained2 = ids_of(t1.trained[:6]), ids_of(t2.trained)
    assert set(trained1 + trained2) <= set(prompt), "a trained trajectory no engine generated"
    group = lambda tid: tid.rsplit("-", 1)[0]  # noqa: E731
    started = {}  # group -> prompt, of the groups run 1's engine had started when the checkpoint was cut
    for kind, tid, *_ in log1[:cut]:
        if kind == "start":
            started.setdefault(group(tid), prompt[tid])
    want = Counter(p for p in started.values() for _ in range(4))
    assert not want - Counter(prompt[t] for t in trained1 + trained2), "a group started before the cut was lost"
    # what run 1's engine returned before the cut, per trajectory
    versions, finished = {}, {}
    for kind, tid, *rest in log1[:cut]:
        if kind == "end":
            versions.setdefault(tid, []).extend(rest[0])
            finished[tid] = rest[1] != "abort"
    cut_short = [t for t, d in kept.items() if d["response_ids"] and not d["finished"]]
    assert cut_short or slow_trainer, "the checkpoint was cut with no answer under way: nothing to continue"
    assert all(kept[t]["versions"] == versions.get(t, []) for t in kept), "the checkpoint kept other tokens than came"
    counts = {k: c2.counters[k] - state["counters"][k] for k in
              ("n_continued_after_resume", "n_regenerated_after_resume", "n_tokens_regenerated_after_resume")}
    if resumable:
        # continued under their own ids: the tokens a checkpoint kept, with their versions, then the resumed ones
        assert counts == {"n_continued_after_resume": len(kept), "n_regenerated_after_resume": 0,
                          "n_tokens_regenerated_after_resume": 0}, counts
        assert set(kept) <= set(trained2)
        for t, d in kept.items():
            assert t2.inner.row_versions[t][:len(d["versions"])] == d["versions"], "a kept token changed version"
            assert set(t2.inner.row_versions[t][len(d["versions"]):]) <= set(range(state["version"], 12))
        # run 2's engine never sampled a kept token again: each continued answer's first request holds it
        first2 = {}
        for kind, tid, *rest in c2.router.log:
            if kind == "start":
                first2.setdefault(tid, rest[0])
        for t in cut_short:
            assert list(first2[t]) == kept[t]["prompt_ids"] + kept[t]["response_ids"], t
    else:
        # an answer the workflow cannot continue is generated again from its prompt, under a new id, and counted;
        # a group with no finished trajectory starts again as a new group
        unfinished = [t for t, d in kept.items() if not d["finished"]]
        whole = {g for g, d in running.items() if not any(t["finished"] for t in d["trajectories"])}
        assert counts == {"n_regenerated_after_resume": len(unfinished),
                          "n_continued_after_resume": len(kept) - len(unfinished),
                          "n_tokens_regenerated_after_resume": sum(len(kept[t]["response_ids"]) for t in unfinished)}
        assert all(t not in trained2 and (f"r1.{t}" in trained2) != (group(t) in whole) for t in unfinished)
    # carried over in the checkpoint's buffer: finished by run 1's engine before the cut, trained by run 2 with
    # the versions that engine returned
    buffered = {t["traj_id"] for g in state["buffer"]["ready"] for t in g["trajectories"]}
    carried = [t for t in trained2 if t in buffered]
    assert carried or not slow_trainer, "the checkpoint was cut with an empty buffer: nothing carried over"
    assert all(finished.get(t) for t in carried), "run 2 trained as accepted run-1 work unfinished at the cut"
    assert all(t2.inner.row_versions[t] == versions[t] for t in carried), "token versions changed in the checkpoint"


def test_resume_from_the_end_of_a_synchronous_run():
    # the last step of a run is never published; the resumed run publishes it first, else eta=0 would stall
    c1, t1, ck1, _ = make_controller(5, eta=0)
    asyncio.run(c1.train(4))
    state = ck1.saved[4]
    assert state["trainer_version"] == 4 and state["version"] == 3
    c2, t2, _, _ = make_controller(6, state, eta=0)
    asyncio.run(asyncio.wait_for(c2.train(6), 30))
    assert [(v, set(vs)) for v, vs, _ in t2.trained] == [(4, {4}), (5, {5})]


def test_resume_past_a_damaged_checkpoint_sets_it_aside_so_pruning_keeps_the_new_ones(tmp_path):
    import torch

    from megarl.checkpoint.resume import prepare_resume

    def fill(tmp):
        torch.save({"version": 0}, tmp / "controller.pt")

    root = tmp_path / "checkpoints"
    for step in (4, 6):
        write_checkpoint(root, step, fill, keep_last=2, meta={"version": 0, "accepted_total": 8 * step})
    (root / "step_6" / "controller.pt").write_bytes(b"garbage")  # damaged: the resume continues from step 4
    point = prepare_resume(tmp_path, find_latest_checkpoint(tmp_path))
    assert point.step_dir.name == "step_4"
    assert sorted(p.name for p in root.iterdir()) == ["damaged_step_6", "step_4"]
    write_checkpoint(root, 5, fill, keep_last=1, meta={"version": 0, "accepted_total": 40})
    assert [s for s, _ in list_checkpoints(root)] == [5]  # the resumed run's own checkpoint is kept
    assert find_latest_checkpoint(tmp_path).name == "step_5"
    assert (root / "damaged_step_6" / "controller.pt").read_bytes() == b"garbage"  # kept for inspection


class FullDisk:
    """The trainer's part of a checkpoint; the saves numbered in ``fail`` (0-based) run out of space half-way."""

    def __init__(self, fail):
        self.fail = set(fail)
        self.n = 0

    def save_rank_states(self, step_dir, strategy_state):
        import errno

        n, self.n = self.n, self.n + 1
        (Path(step_dir) / "trainer").mkdir()
        (Path(step_dir) / "trainer" / "rank0.pt").write_bytes(b"half")
        if n in self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        (Path(step_dir) / "trainer" / "rank0.pt").write_bytes(b"whole")

    def prepare_rank_states(self, step_dir, strategy_state):  # logging.async_save: the same, on the writer thread
        return lambda group: self.save_rank_states(step_dir, strategy_state)


def disk_checkpointer(tmp_path, fail):
    from megarl.checkpoint.run_checkpoint import Checkpointer

    weights = tmp_path / "weights"
    for v in range(1, 20):  # what the publisher would have written for each version
        (weights / f"v{v}").mkdir(parents=True)
        (weights / f"v{v}" / "config.json").write_text("{}")

    class LoopCheckpointer(Checkpointer):  # the loop's trainer and strategy are built after it
        async def save(self, controller, **kw):
            self.trainer, self.strategy = controller.trainer, controller.strategy
            return await super().save(controller, **kw)

    return LoopCheckpointer(tmp_path, None, None, weights, keep_last=0, rank_states=FullDisk(fail))


def test_a_failed_periodic_checkpoint_keeps_the_run_and_the_previous_checkpoint(tmp_path):
    # saves at steps 2, 4, 6, 8 and the end (8, already saved); the one at step 4 runs out of disk space
    ck = disk_checkpointer(tmp_path, {1})
    c, trainer, _, _ = make_controller(0, checkpointer=ck, overrides=["logging.save_every=2"])
    asyncio.run(asyncio.wait_for(c.train(8), 60))
    assert c.step == 8 and trainer.version == 8
    root = tmp_path / "checkpoints"
    assert [s for s, _ in list_checkpoints(root)] == [2, 6, 8]  # no half-written step_4 that looks valid
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_6", "step_8"]
    assert all((p / "trainer" / "rank0.pt").read_bytes() == b"whole" for _, p in list_checkpoints(root))
    assert all(verify_checkpoint(p)["step"] == s for s, p in list_checkpoints(root))


def test_a_failed_background_write_keeps_the_run_and_the_previous_checkpoint(tmp_path):
    """logging.async_save: the write of step 4 fails on its thread; the run goes on, step_4 never appears, the
    failure is counted when the next save waits for it, and the end of the run waits for the last write."""
    ck = disk_checkpointer(tmp_path, {1})
    c, trainer, _, _ = make_controller(0, checkpointer=ck,
                                       overrides=["logging.save_every=2", "logging.async_save=true"])
    asyncio.run(asyncio.wait_for(c.train(8), 60))
    assert c.step == 8 and trainer.version == 8 and c.checkpoints.save_failures == 0
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_6", "step_8"]
    assert all((p / "trainer" / "rank0.pt").read_bytes() == b"whole" for _, p in list_checkpoints(root))


def test_checkpoints_failing_max_save_failures_times_in_a_row_stop_the_run(tmp_path):
    ck = disk_checkpointer(tmp_path, {1, 2})  # the saves at steps 4 and 6
    c, trainer, _, _ = make_controller(0, checkpointer=ck,
                                       overrides=["logging.save_every=2", "logging.max_save_failures=2"])
    with pytest.raises(CheckpointError, match=r"2 checkpoints in a row failed \(logging.max_save_failures=2\); "
                                              r"the last at step 6: OSError: \[Errno 28\] No space left on device"):
        asyncio.run(asyncio.wait_for(c.train(8), 60))
    assert c.step == 6
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [2]  # the last good one is kept


def test_a_failed_replace_of_the_same_step_keeps_the_step_as_it_was(tmp_path, monkeypatch):
    import os

    root = tmp_path / "checkpoints"
    write_checkpoint(root, 2, fill_files)
    rename = os.rename

    def no_space_for_the_new(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", no_space_for_the_new)
    with pytest.raises(OSError):
        write_checkpoint(root, 2, lambda tmp: (tmp / "controller.pt").write_bytes(b"new"))
    monkeypatch.undo()
    assert [p.name for p in root.iterdir()] == ["step_2"]
    assert verify_checkpoint(root / "step_2")["files"].keys() == {"controller.pt", "trainer/rank0.pt"}
