"""Run outputs: metrics lines, evaluation lines, journals, and Weights & Biases in offline mode."""
import json

from wandb_offline import history

from megarl.loop.run_log import RunLogger


def test_steps_evaluations_and_journals(tmp_path):
    log = RunLogger(tmp_path, total_steps=2, tensorboard=False, progress="none")
    log.log({"step": 1, "reward_mean": 0.5, "version_lag_hist": {0: 3}})
    log.log_eval({"step": 1, "eval/reward_mean": 0.25, "eval/pass@1": 0.0})
    log.write("samples", {"step": 1, "answer": {"nested": 1}, "reward": float("nan")})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "reward_mean": 0.5, "version_lag_hist": {"0": 3}},
                     {"step": 1, "eval/reward_mean": 0.25, "eval/pass@1": 0.0}]
    assert json.loads((tmp_path / "samples.jsonl").read_text()) == {"step": 1, "answer": {"nested": 1},
                                                                     "reward": None}


def test_wandb_offline_without_an_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLogger(tmp_path, total_steps=1, tensorboard=False, progress="none",
                    wandb={"project": "megarl-test", "config": {"trainer": {"lr": 0.001}}})
    assert log._wandb.settings.mode == "offline"
    log.log({"step": 1, "reward_mean": 0.5})
    log.log_eval({"step": 1, "eval/reward_mean": 0.25})
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert history(tmp_path) == [{"step": 1, "rollout/reward_mean": 0.5}, {"eval/step": 1, "eval/reward_mean": 0.25}]


def test_wandb_keeps_an_evaluation_logged_after_later_steps(tmp_path, monkeypatch):
    # evaluation runs in the background and reports at the step it started, after later steps were logged:
    # W&B drops a row whose step= is below the current one, so evaluations live on a step axis of their own
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLogger(tmp_path, total_steps=4, tensorboard=False, progress="none",
                    wandb={"project": "megarl-test", "config": {}})
    for step in (1, 2, 3, 4):
        log.log({"step": step, "reward_mean": step / 10})
    log.log_eval({"step": 2, "eval/pass@1": 0.5})
    log.close()
    rows = history(tmp_path)
    assert [(r["step"], r["rollout/reward_mean"]) for r in rows if "step" in r] == [(1, 0.1), (2, 0.2), (3, 0.3),
                                                                                   (4, 0.4)]
    assert [r for r in rows if "eval/pass@1" in r] == [{"eval/step": 2, "eval/pass@1": 0.5}]


def test_the_reader_sees_what_wandb_wrote(tmp_path, monkeypatch):
    # the offline-file reader of these tests against a run written by W&B itself, with its own step argument
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="megarl-test", dir=str(tmp_path), mode="offline")
    run.log({"a": 1}, step=3)
    run.log({"b": 2.5}, step=5)
    run.finish()
    assert history(tmp_path) == [{"a": 1}, {"b": 2.5}]


def test_progress_bar_counts_steps(tmp_path):
    # records carry the step just done (1-based): 3 of 3 after the last, not 4 of 3
    from megarl.loop.run_log import RunLogger

    logger = RunLogger(tmp_path, total_steps=3, tensorboard=False, progress="rich")
    for step in (1, 2, 3):
        logger.log({"step": step, "version": step, "reward_mean": 0.5, "staleness_max": 0, "n_spliced": 0})
    assert logger._bar.tasks[0].completed == 3
    logger.close()


STEP = {"version": 2, "reward_mean": 0.25, "staleness_max": 1, "n_spliced": 0}


def test_a_piped_run_prints_one_line_per_step(tmp_path, capsys):
    # under pytest stdout is a pipe, as in `megarl train ... | tee log`: the progress display does not draw there
    logger = RunLogger(tmp_path, total_steps=3, tensorboard=False, progress="rich", summary_every_s=0)
    for step in (1, 2, 3):
        logger.log({"step": step, **STEP, "reward_mean": step / 4})
    logger.close()
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert [x.split(" elapsed ")[0] for x in lines] == [
        "step 1/3 v2 reward 0.250 stale max 1 spliced 0",
        "step 2/3 v2 reward 0.500 stale max 1 spliced 0",
        "step 3/3 v2 reward 0.750 stale max 1 spliced 0"]


def test_piped_summaries_are_spaced_in_time(tmp_path, capsys):
    # an hour apart: only the first step (the run is alive) and the last one print
    logger = RunLogger(tmp_path, total_steps=4, tensorboard=False, progress="none", summary_every_s=3600)
    for step in (1, 2, 3, 4):
        logger.log({"step": step, **STEP})
    logger.close()
    steps = [x.split()[1] for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert steps == ["1/4", "4/4"]


def test_an_evaluation_is_printed_on_the_console(tmp_path, capsys):
    # the held-out numbers are what a demo shows: they must reach the console, not only metrics.jsonl
    log = RunLogger(tmp_path, total_steps=4, tensorboard=False, progress="none")
    log.log_eval({"step": 2, "eval/reward_mean": 0.8125, "eval/pass@1": 0.5, "eval/pass@k": 0.75, "eval/k": 4,
                  "eval/n_prompts": 64})
    log.log_eval({"step": 4, "eval/reward_mean": 0.25})  # an evaluation without pass@ keys
    log.close()
    assert capsys.readouterr().out.splitlines() == [
        "eval at step 2: held-out pass@1 0.500, pass@4 0.750, reward 0.812 (64 prompts)",
        "eval at step 4: held-out reward 0.250"]
