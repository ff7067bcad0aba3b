"""`megarl bench --quality`'s runs.jsonl: one line per run (hand-computed fields), written by the grid, and the
report's tables re-derived from it alone (``--quality --from-runs``) equal to those built from the runs' records."""
import json
from pathlib import Path

import pytest

from megarl.bench import quality, quality_runs, variants
from megarl.cli import main
from megarl.errors import ConfigError

QCFG = "configs/bench_quality_cpu.yaml"


def _steps(rewards, **per_step):
    """Step records as a run's metrics.jsonl holds them; ``per_step``: metric -> one value per step (None: unlogged)."""
    recs = [{"step": i + 1, "reward_mean": r, "wall_s": 2.0 * (i + 1), "step_s": 2.0} for i, r in enumerate(rewards)]
    for key, values in per_step.items():
        for rec, v in zip(recs, values):
            if v is not None:
                rec[key] = v
    return recs


def test_run_summary_fields():
    recs = _steps([0.0, 0.2, 0.4, 0.6], active_frac=[1.0, 0.5, 0.8, 0.9],
                  abs_logp_anchor_minus_behav_mean=[0.01, 0.05, 0.02, 0.03],
                  **{"behav_w/masked_frac": [0.0, 0.2, 0.1, 0.1], "behav_w/downweighted_frac": [0.0, 0.0, 0.1, 0.3],
                     "r_d/abs_logp_mean": [None, 0.1, 0.3, None]})
    recs.insert(2, {"step": 2, "eval/pass@1": 0.25})  # an evaluation line: not a step
    recs.append({"step": 4, "eval/pass@1": 0.5})
    s = quality_runs.run_summary(recs, strategy="ewma(tau=0.3)", eta=8, seed=2, window=2, smooth=2, threshold=0.25,
                                 threshold_source="--threshold")
    assert list(s) == list(quality_runs.FIELDS)
    # final window: (0.4 + 0.6) / 2; 2-step moving average 0, .1, .3, .5 reaches 0.25 at step 3
    assert s["final_reward"] == pytest.approx(0.5) and s["steps_to_threshold"] == 3
    assert (s["strategy"], s["eta"], s["seed"], s["steps"]) == ("ewma(tau=0.3)", 8, 2, 4)
    assert (s["window"], s["smooth"], s["threshold"], s["threshold_source"]) == (2, 2, 0.25, "--threshold")
    assert s["r_d"] == pytest.approx(0.2)  # only the steps that logged it
    assert s["active_share_mean"] == pytest.approx(0.8) and s["active_share_min"] == 0.5
    assert s["masked_share"] == pytest.approx(0.1) and s["downweighted_share"] == pytest.approx(0.1)
    # per-step gaps 0.01, 0.05, 0.02, 0.03: median 0.025, max 0.05
    assert s["anchor_behav_gap_median"] == pytest.approx(0.025) and s["anchor_behav_gap_max"] == 0.05
    assert s["eval_pass1"] == 0.5 and s["wall_s"] == pytest.approx(8.0)
    bare = quality_runs.run_summary(_steps([0.1, 0.2]), strategy="behav", eta=1, seed=0, window=5, smooth=1,
                                    threshold=0.9, threshold_source="x")
    assert bare["steps_to_threshold"] is None and bare["final_reward"] == pytest.approx(0.15)
    assert all(bare[k] is None for k in ("r_d", "active_share_mean", "active_share_min", "masked_share",
                                         "downweighted_share", "anchor_behav_gap_median", "anchor_behav_gap_max",
                                         "eval_pass1"))


class FakeRun:
    """Stands in for run_strategy: rewards by seed, ewma 0.05 + 0.02 x seed above behav; writes metrics.jsonl."""

    def __init__(self):
        self.calls = []

    def __call__(self, spec):
        name = spec["run_dir"].rsplit("/", 1)[-1]
        self.calls.append(name)
        seed = int(name[-1])
        lift = 0.05 + 0.02 * seed if name.startswith("ewma") else 0.0
        recs = _steps([0.1 * seed + 0.01 * s + lift for s in range(4)], active_frac=[1.0, 0.9, 0.8, 0.7],
                      abs_logp_anchor_minus_behav_mean=[0.01] * 4)
        run_dir = Path(spec["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return {"records": recs}


def _grid(out, run):
    vs = variants.parse_strategies("behav,ewma:auto_reset=false", lambda extra: None, ["behav", "ewma"])
    return quality.run_quality(QCFG, vs, [8], 3, 4, str(out), [], run=run, meta={"steps": 4}, window=2,
                               log=lambda *_: None)


def test_runs_jsonl_rederives_the_report(tmp_path, capsys):
    rep = _grid(tmp_path, FakeRun())
    path = tmp_path / quality_runs.RUNS_FILE
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["strategy"], r["seed"]) for r in lines] == [("behav", 0), ("behav", 1), ("behav", 2),
                                                          ("ewma(auto_reset=false)", 0), ("ewma(auto_reset=false)", 1),
                                                          ("ewma(auto_reset=false)", 2)]
    assert lines == rep["runs"]
    # behav seed 1: final window (steps 3, 4) of 0.12, 0.13
    assert lines[1]["final_reward"] == pytest.approx(0.125) and lines[1]["window"] == 2
    q = quality_runs.runs_report(quality_runs.read_runs(path))
    full = rep["quality"]
    assert q["vs_behav"] == full["vs_behav"]
    assert q["final"] == [{k: row[k] for k in q["final"][0]} for row in full["final"]]
    assert {k: q[k] for k in quality_runs.GRID_FIELDS} == {k: full[k] for k in quality_runs.GRID_FIELDS}
    # the same seeds in both cells: paired; differences 0.05, 0.07, 0.09 -> mean 0.07, sd 0.02, se 0.011547,
    # t(0.95, 2) = 2.919986 -> half-width 0.033717
    (d,) = q["vs_behav"]
    assert d["interval"]["method"] == "paired t" and d["interval"]["n"] == 3
    assert d["interval"]["low"] == pytest.approx(0.036283, abs=1e-6)
    assert d["interval"]["verdict"] == "above behav" and d["verdict"] == "not called at n < 5"  # 3 seeds
    # the command prints exactly the tables report.md holds
    assert main(["bench", "--quality", "--from-runs", str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed == quality_runs.render_runs_markdown(q, path)
    md = quality.render_quality_markdown(rep)
    tables = [quality_runs.final_reward_table(q), quality_runs.threshold_table(q), quality_runs.vs_behav_table(q)]
    for table in tables:
        assert table and "\n".join(table) in printed and "\n".join(table) in md
    assert ("| ewma(auto_reset=false) | 8 | +0.0700 | [+0.0363, +0.1037] | 3 pairs | paired t | 2.0 | "
            "not called at n < 5 |") in printed


def _write(path, runs):
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    return path


def test_read_runs_rejects_what_is_not_one_grid(tmp_path):
    runs = quality_runs.grid_summaries({("behav", 8): [_steps([0.1, 0.2]), _steps([0.3, 0.4])]}, window=1, smooth=1)
    assert quality_runs.read_runs(_write(tmp_path / "ok.jsonl", runs)) == runs
    with pytest.raises(ConfigError, match="no such file; give the runs.jsonl of `megarl bench --quality`"):
        quality_runs.read_runs(tmp_path / "none.jsonl")
    with pytest.raises(ConfigError, match=r"a\.jsonl:2: a runs.jsonl line needs seed"):
        no_seed = {k: v for k, v in runs[1].items() if k != "seed"}
        quality_runs.read_runs(_write(tmp_path / "a.jsonl", [runs[0], no_seed]))
    with pytest.raises(ConfigError, match=r"run\(s\) \[\('behav', 8, 0\)\] appear more than once"):
        quality_runs.read_runs(_write(tmp_path / "b.jsonl", [runs[0], runs[0]]))
    with pytest.raises(ConfigError, match="disagree on threshold"):
        quality_runs.read_runs(_write(tmp_path / "c.jsonl", [runs[0], {**runs[1], "threshold": 0.9}]))
    (tmp_path / "d.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"d\.jsonl:1: not a JSON line"):
        quality_runs.read_runs(tmp_path / "d.jsonl")


def test_from_runs_flag_combinations(tmp_path, capsys):
    path = tmp_path / "runs.jsonl"
    assert main(["bench", "--from-runs", str(path)]) == 2
    assert "--from-runs re-derives a --quality report; add --quality" in capsys.readouterr().err
    assert main(["bench", "--quality", "--from-runs", str(path), "--threshold", "0.3", "trainer.lr=1"]) == 2
    assert "--threshold, key=value overrides cannot apply" in capsys.readouterr().err
    assert main(["bench", "--quality"]) == 2
    assert "--output is required (except with --quality --from-runs)" in capsys.readouterr().err
