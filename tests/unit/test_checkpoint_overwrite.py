"""Overwriting a step's checkpoint never leaves a moment where a kill loses both copies; set-aside damaged
checkpoints are pruned like the rest.

The kill is real: a forked child writes the new checkpoint and ``os._exit``\\ s
at the k-th rename of the write (before it, and after the last one), so no
``except``/``finally`` of the writer runs; the parent then resumes as
``megarl train --resume`` does (find the newest valid checkpoint, prepare the
run directory) and must find a complete copy of the step, old or new.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.resume import prepare_resume
from megarl.checkpoint.run_checkpoint import (
    find_latest_checkpoint,
    list_checkpoints,
    verify_checkpoint,
    write_checkpoint,
)
from megarl.isolation.run_key import checkpoint_key, sign


def filler(tag: str):
    def fill(tmp: Path) -> None:
        torch.save({"version": 0, "tag": tag}, tmp / "controller.pt")
        (tmp / "trainer").mkdir()
        (tmp / "trainer" / "rank0.pt").write_bytes(tag.encode() * 100)
    return fill


def meta(step: int) -> dict:
    return {"version": 0, "accepted_total": 8 * step}


def tag_of(step_dir: Path) -> str:
    verify_checkpoint(step_dir)
    return torch.load(step_dir / "controller.pt", weights_only=False)["tag"]


def overwrite_killed_at(root: Path, kill_at: int) -> int:
    """In a forked child: overwrite step_6 with 'new', exiting at the ``kill_at``-th rename (1-based, before it
    runs); returns how many renames the child made (all of them when it was not killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        calls = [0]
        real_rename = os.rename

        def rename(src, dst):
            calls[0] += 1
            os.write(w, b".")
            if calls[0] == kill_at:
                os._exit(9)
            real_rename(src, dst)

        os.rename = rename
        try:
            write_checkpoint(root, 6, filler("new"), keep_last=0, meta=meta(6))
        finally:
            os._exit(0)
    os.close(w)
    seen = b""
    while chunk := os.read(r, 64):
        seen += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return len(seen) - (1 if len(seen) == kill_at else 0)


def run_with_step_6(tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 4, filler("four"), meta=meta(4))
    write_checkpoint(root, 6, filler("old"), meta=meta(6))
    return root


def test_a_kill_at_any_rename_of_an_overwrite_leaves_a_valid_copy_of_the_step(tmp_path):
    n_renames = overwrite_killed_at(run_with_step_6(tmp_path / "whole"), kill_at=10**6)
    assert n_renames >= 2
    found = []
    for k in range(1, n_renames + 2):  # before each rename, then after the last one
        run = tmp_path / f"kill{k}"
        root = run_with_step_6(run)
        overwrite_killed_at(root, k)
        step_dir = find_latest_checkpoint(run)
        assert step_dir.name == "step_6", f"killed before rename {k}: the resume fell back to {step_dir.name}"
        point = prepare_resume(run, step_dir)
        assert point.step_dir == root / "step_6" and (root / "step_6").is_dir()
        found.append(tag_of(root / "step_6"))
        assert [s for s, _ in list_checkpoints(root)] == [4, 6]
        assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6"], "leftovers of the write remain"
    assert found[0] == "old" and found[-1] == "new", found
    assert found == sorted(found, key=lambda t: t == "new"), f"once complete, the new copy wins: {found}"


def test_the_states_between_the_renames_are_recognised(tmp_path):
    """Each state an overwrite passes through, made by hand: the resume finds the copy it should."""
    from megarl.checkpoint.dirs import OVERWRITE_PREFIXES

    new, old = OVERWRITE_PREFIXES["new"], OVERWRITE_PREFIXES["old"]
    for case, names, want in (("new beside the step", {"step_6": "old", f"{new}step_6-a": "new"}, "new"),
                              ("new and old, no step", {f"{old}step_6-a": "old", f"{new}step_6-a": "new"}, "new"),
                              ("old only", {f"{old}step_6-a": "old", ".tmp-step_6-1-a": "new"}, "old"),
                              ("step and old", {"step_6": "new", f"{old}step_6-a": "old"}, "new")):
        run = tmp_path / case.replace(" ", "_")
        root = run / "checkpoints"
        write_checkpoint(root, 4, filler("four"), meta=meta(4))
        for name, tag in names.items():
            os.rename(write_checkpoint(root, 99, filler(tag), meta=meta(6)), root / name)
            manifest = root / name / "manifest.json"  # a checkpoint of step 6 under its in-between name
            signed = sign({**json.loads(manifest.read_text()), "step": 6}, checkpoint_key(run))  # as the run would
            manifest.write_text(json.dumps(signed))
        assert find_latest_checkpoint(run) == root / "step_6", case
        prepare_resume(run, root / "step_6")
        assert tag_of(root / "step_6") == want, case
        assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6"], case


def test_a_damaged_in_between_copy_is_not_taken(tmp_path):
    from megarl.checkpoint.dirs import OVERWRITE_PREFIXES

    run = tmp_path / "run"
    root = run_with_step_6(run)
    os.rename(write_checkpoint(root, 7, filler("new"), meta=meta(6)), root / f"{OVERWRITE_PREFIXES['new']}step_6-b")
    (root / f"{OVERWRITE_PREFIXES['new']}step_6-b" / "controller.pt").write_bytes(b"garbage")
    assert find_latest_checkpoint(run) == root / "step_6"
    assert tag_of(root / "step_6") == "old"


def test_damaged_checkpoints_are_pruned_with_the_rest(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (4, 6):
        write_checkpoint(root, step, filler(str(step)), keep_last=2, meta=meta(step))
    (root / "step_6" / "controller.pt").write_bytes(b"garbage")
    prepare_resume(run, find_latest_checkpoint(run))
    assert sorted(p.name for p in root.iterdir()) == ["damaged_step_6", "step_4"]
    for step in (5, 6):  # the resumed run passes the damaged one's step: it is kept while a kept one is older
        write_checkpoint(root, step, filler(str(step)), keep_last=2, meta=meta(step))
    assert sorted(p.name for p in root.iterdir()) == ["damaged_step_6", "step_5", "step_6"]
    write_checkpoint(root, 7, filler("7"), keep_last=2, meta=meta(7))
    assert sorted(p.name for p in root.iterdir()) == ["step_6", "step_7"], "damaged_step_6 outlived keep_last"


@pytest.mark.parametrize("keep_last", [0, 1])
def test_keep_last_0_keeps_damaged_ones_and_suffixed_ones_are_pruned(tmp_path, keep_last):
    root = tmp_path / "checkpoints"
    for name in ("damaged_step_3", "damaged_step_3-1a2b3c4d", "damaged_step_9"):
        (root / name).mkdir(parents=True)
    write_checkpoint(root, 5, filler("5"), keep_last=keep_last, meta=meta(5))
    left = sorted(p.name for p in root.iterdir())
    if keep_last == 0:
        assert left == ["damaged_step_3", "damaged_step_3-1a2b3c4d", "damaged_step_9", "step_5"]
    else:
        assert left == ["damaged_step_9", "step_5"]
