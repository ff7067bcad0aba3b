"""A resume reads a damaged journal line as damaged: skipped, counted and named in one warning, never a crash.

Before, a line of ``metrics.jsonl`` with a byte that is not UTF-8 failed every resume with UnicodeDecodeError, a
line ``[1, 2]`` with AttributeError and ``{"step": null}`` with TypeError (megarl/checkpoint/rewind.py
rewind_run_logs).
"""
import json
import logging

import torch

from megarl.checkpoint.resume import prepare_resume
from megarl.checkpoint.run_checkpoint import write_checkpoint

GOOD = [json.dumps({"step": s, "loss": 0.5}).encode() for s in range(1, 7)]
DAMAGED = [b'{"step": 3, "note": "\xff"}', b"[1, 2]", b'{"step": null}', b'{"step": "2"}', b'{"st']


def a_checkpoint(run, step: int = 4, accepted_total: int = 48):
    state = {"step": step, "version": 0, "buffer": {"accepted_total": accepted_total}}
    return write_checkpoint(run / "checkpoints", step, lambda tmp: torch.save(state, tmp / "controller.pt"),
                            meta={"version": 0, "accepted_total": accepted_total})


def test_a_resume_skips_counts_and_names_damaged_journal_lines(tmp_path, caplog):
    run = tmp_path / "run"
    step_dir = a_checkpoint(run)
    metrics = GOOD[:2] + DAMAGED[:3] + GOOD[2:] + DAMAGED[3:]  # the cut-short line last, as a kill leaves it
    (run / "metrics.jsonl").write_bytes(b"\n".join(metrics))
    (run / "accepted.jsonl").write_bytes(b"\n".join([json.dumps({"accepted_total": 8 * k}).encode()
                                                     for k in range(1, 9)] + [b"[8]"]) + b"\n")
    (run / "resumes.jsonl").write_bytes(b'{"attempt": 1, "x": "\xfe"}\n')
    with caplog.at_level(logging.WARNING, logger="megarl.checkpoint.run_checkpoint"):
        point = prepare_resume(run, step_dir)
        again = prepare_resume(run, step_dir)  # the damaged lines are gone from the journal: no second warning
    assert (point.attempt, again.attempt) == (2, 3)
    kept = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [1, 2, 3, 4]
    assert [json.loads(x)["accepted_total"] for x in (run / "accepted.jsonl").read_text().splitlines()] == \
        [8, 16, 24, 32, 40, 48]
    warnings = [r.getMessage() for r in caplog.records if "damaged journal line" in r.getMessage()]
    assert len(warnings) == 1, warnings
    (warning,) = warnings
    assert warning.startswith("resume: 6 damaged journal line(s) skipped"), warning
    for named in ("metrics.jsonl line 3 (not UTF-8)", "metrics.jsonl line 4 (not a JSON object: [1, 2])",
                  "metrics.jsonl line 5 (step is not an integer: null)", "and 1 more"):
        assert named in warning, warning
    assert (run / "metrics.jsonl.damaged").read_bytes().splitlines() == DAMAGED
    assert (run / "accepted.jsonl.damaged").read_bytes() == b"[8]\n"
