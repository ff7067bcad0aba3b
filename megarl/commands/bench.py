"""`megarl bench`: run every recovery strategy from the same config and seed; report costs and errors.

Three more modes: ``--compare-sync`` (async vs sync on shared and on disjoint cores,
megarl/bench/compare_sync.py), ``--sweep`` (model size x eta x strategy,
megarl/bench/sweep.py) and ``--quality`` (strategy x eta x seed learning curves,
megarl/bench/quality.py). The sweep and the quality grid print their estimated run
time before they start (``--estimate-only`` stops there). ``--quality --from-runs
runs.jsonl`` reruns nothing: it prints the quality tables re-derived from a grid's
per-run summary (megarl/bench/quality_runs.py). With ``rollout.routing_replay=true`` the
bench also reports what replay costs (megarl/bench/replay_cost.py). ``--packing`` compares
the trainer's packing plan with the round-robin deal it replaced and times both on 2 CPU
ranks (megarl/bench/packing.py); it needs no config. ``--preemption`` stops a run with SIGTERM
at ``--stops`` and resumes it, with running groups kept whole and with their prompts only, and
reports the generation thrown away and the time to the first step after each resume
(megarl/bench/preemption.py).
"""
from __future__ import annotations

import functools
from pathlib import Path

from megarl.bench.report_render import print_table
from megarl.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark recovery strategies: step time, overheads, memory, exactness")
    p.add_argument("--config", default="configs/bench_cpu.yaml", help="run config shared by every strategy")
    p.add_argument("--strategies", default=None,
                   help="comma-separated strategy names, 'all' or 'none' (default: all; with --quality: behav, "
                        "recompute, loglinear, ewma, snapshot, interrupt_sync; with --compare-sync alone: none). "
                        "--quality also takes variants: NAME:KEY=VALUE[;KEY=VALUE...] sets recovery.NAME.KEY, e.g. "
                        "'behav,ewma,ewma:auto_reset=false' (quote the ';')")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per run (default: trainer.total_steps)")
    p.add_argument("--output", default=None,
                   help="directory for report.json, report.md, the plots and one run directory per run (required "
                        "except with --from-runs)")
    p.add_argument("--compare-sync", action="store_true",
                   help="also run behav async (--eta) and sync (eta 0), on shared and on disjoint cores, and report "
                        "the throughput ratios")
    p.add_argument("--eta", type=int, default=None, help="--compare-sync: eta of the async runs (default rollout.eta)")
    p.add_argument("--disjoint-cores", default=None, metavar="TRAINER:ENGINES",
                   help="--compare-sync: cores of the trainer and of the engines in the disjoint runs, e.g. 0:1 or "
                        "0-3:4-7 (default: the available cores halved)")
    p.add_argument("--sweep", action="store_true", help="model size x eta x strategy grid (megarl/bench/sweep.py)")
    p.add_argument("--models", default=None,
                   help="--sweep: model YAMLs or names under configs/models/ (default tiny_qwen3, tiny_qwen3_s, "
                        "tiny_qwen3_m, tiny_qwen3_moe_m)")
    p.add_argument("--etas", default=None, help="--sweep / --quality: comma-separated etas (default 1,2,4,8 / 1,8)")
    p.add_argument("--quality", action="store_true",
                   help="strategy x eta x seed learning curves (quality.png), final-window reward per cell and its "
                        "difference to behav at the same eta with a 90%% t interval (paired by seed when both cells "
                        "ran the same seeds, Welch otherwise; n and a verdict beside it), one line per run in "
                        "runs.jsonl; re-run with the same --output to resume: finished runs are reused")
    p.add_argument("--from-runs", default=None, metavar="PATH",
                   help="--quality: rerun nothing; print the report's tables (final-window reward, steps to "
                        "threshold, pass@1, differences to behav with their intervals) re-derived from the "
                        "runs.jsonl at PATH")
    p.add_argument("--seeds", type=int, default=None, help="--quality: seeds per cell (default 3)")
    p.add_argument("--final-window", type=int, default=None,
                   help="--quality: steps of the final-window reward (default a tenth of the steps, at least 5)")
    p.add_argument("--threshold", type=float, default=None,
                   help="--quality: reward for 'steps to threshold' (default half the best cell's mean final-window "
                        "reward)")
    p.add_argument("--estimate-only", action="store_true", help="--sweep / --quality: print the estimate and stop")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per strategy (and per --compare-sync run), interleaved: every strategy once per "
                        "round, the order reversed every other round; each ratio gets a 90%% t interval over the "
                        "repeats (default 3)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the comparison with the true logp_old (max_abs_err_vs_exact becomes null)")
    p.add_argument("--packing", action="store_true",
                   help="packing plan vs round-robin deal: padding, DP balance, micro-batches at dp 1, 2, 8, 64, "
                        "and the CPU trainer step at dp 2 (--steps: timed steps per plan, default 5; 0 skips it)")
    p.add_argument("--packing-rows", type=int, default=256, help="--packing: rows per batch (default 256)")
    p.add_argument("--packing-budget", type=int, default=32768,
                   help="--packing: micro_batch_tokens of the table (default 32768)")
    p.add_argument("--packing-runs", default="", metavar="RUN_DIR[,RUN_DIR...]",
                   help="--packing: also the batches these runs trained (their trained_ids.jsonl row lengths)")
    p.add_argument("--preemption", action="store_true",
                   help="stop each run with SIGTERM after the steps of --stops and resume it, with running groups "
                        "kept whole in the checkpoint (logging.keep_running_groups=true) and with their prompts only; "
                        "report generated tokens thrown away per stop, time to the first trained step after a "
                        "resume and generated tokens per trained token (megarl/bench/preemption.py)")
    p.add_argument("--stops", default=None, metavar="K[,K...]",
                   help="--preemption: the steps after which SIGTERM is sent (default: a third and two thirds of "
                        "--steps)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides for every run")
    p.set_defaults(func=run)


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}={text!r}: give comma-separated integers, e.g. 1,2,4,8") from None


def _strategies(spec: str | None, default: str) -> list[str]:
    from megarl.builder import strategy_names

    spec = default if spec is None else spec
    return [] if spec == "none" else strategy_names(spec)


def _hms(seconds: float) -> str:
    h, rem = divmod(int(seconds), 3600)
    return f"{h} h {rem // 60:02d} min" if h else f"{rem // 60} min {rem % 60:02d} s"


def _from_runs(args) -> int:
    """``--quality --from-runs``: the tables from a runs.jsonl alone (no config, no engine, no run)."""
    from megarl.bench.quality_runs import read_runs, render_runs_markdown, runs_report

    if not args.quality:
        raise ConfigError("--from-runs re-derives a --quality report; add --quality")
    # each line holds the window, smoothing and threshold its grid used: flags that would change them, or
    # ask for runs, cannot apply to numbers that are already computed
    given = [flag for flag, value in (("--output", args.output), ("--steps", args.steps), ("--seeds", args.seeds),
                                      ("--etas", args.etas), ("--strategies", args.strategies),
                                      ("--final-window", args.final_window), ("--threshold", args.threshold),
                                      ("--sweep", args.sweep), ("--compare-sync", args.compare_sync),
                                      ("--estimate-only", args.estimate_only), ("key=value overrides", args.overrides))
             if value is not None and value is not False and value != []]
    if given:
        raise ConfigError(f"--from-runs reruns nothing, so {', '.join(given)} cannot apply (each runs.jsonl line "
                          "holds the window, smoothing and threshold of its grid)")
    print(render_runs_markdown(runs_report(read_runs(args.from_runs)), args.from_runs), end="")
    return 0


def _preemption(args) -> int:
    from megarl.bench.interleave import DEFAULT_REPEATS
    from megarl.bench.preemption import render, run_preemption
    from megarl.bench.run import write_report
    from megarl.builder import load_run_config

    others = [f for f, on in (("--sweep", args.sweep), ("--quality", args.quality),
                              ("--compare-sync", args.compare_sync)) if on]
    if others:
        raise ConfigError(f"--preemption is a benchmark of its own; run {', '.join(others)} apart from it")
    from megarl.preflight import ensure_checkpoint

    cfg = load_run_config(args.config, list(args.overrides))  # fails fast on a bad config or override
    steps = args.steps or cfg.trainer.total_steps
    stops = _ints(args.stops, "--stops") if args.stops else [steps // 3, 2 * steps // 3]
    ensure_checkpoint(cfg)  # megarl launch plans from the checkpoint's config.json: written first, as train would
    rep = run_preemption(args.config, list(args.overrides), args.output, stops, steps,
                         DEFAULT_REPEATS if args.repeats is None else args.repeats,
                         trainer_ranks=cfg.placement.trainer_ranks)
    text = render(rep)
    write_report(Path(args.output), rep, text)
    print(text, end="")
    print(f"wrote {args.output}/report.json, report.md")
    return 0


def run(args) -> int:
    if args.repeats is not None and (args.sweep or args.quality or args.packing):
        raise ConfigError("--repeats repeats the strategies' runs of a plain bench; --sweep, --quality and "
                          "--packing do not take it (--quality repeats with --seeds)")
    if args.from_runs is not None:
        return _from_runs(args)
    if args.packing:
        from megarl.bench.packing import run_packing

        if args.packing_rows < 1 or args.packing_budget < 1 or (args.steps or 0) < 0:
            raise ConfigError("--packing needs --packing-rows >= 1, --packing-budget >= 1 and --steps >= 0")
        print(run_packing(args.output, args.packing_rows, args.packing_budget, 5 if args.steps is None else args.steps,
                          runs=[r for r in args.packing_runs.split(",") if r.strip()]), end="")
        return 0
    if args.output is None:
        raise ConfigError("--output is required (except with --quality --from-runs)")
    if args.preemption:
        return _preemption(args)
    # the loop's modules (torch, Megatron) load only when the command runs, not for `megarl --help`
    from megarl.bench import quality, sweep
    from megarl.bench.run import bench, machine_meta, run_strategy, write_report
    from megarl.builder import load_run_config
    from megarl.rollout.engine_pool import EnginePool

    if args.sweep and args.quality:
        raise ConfigError("--sweep and --quality are separate benchmarks; run them one after the other")
    if args.steps is not None and args.steps < 2:
        raise ConfigError(f"--steps={args.steps}: the bench needs at least 2 steps (the first one is start-up)")
    overrides = list(args.overrides)
    cfg = load_run_config(args.config, overrides)  # fails fast on a bad config or override
    steps = args.steps or cfg.trainer.total_steps
    meta = {"config": args.config, "overrides": overrides, "steps": steps, **machine_meta()}
    if args.sweep or args.quality:
        if args.sweep:
            models = [m for m in (args.models or ",".join(sweep.DEFAULT_MODELS)).split(",") if m]
            etas = _ints(args.etas, "--etas") if args.etas else list(sweep.DEFAULT_ETAS)
            strategies = _strategies(args.strategies, "all")
            grid = sweep.cells([sweep.model_info(sweep.resolve_model(m)) for m in models], etas, strategies)
            estimate, n_runs = sweep.estimate_seconds(grid, steps), len(grid)
        else:
            from megarl.launch.placement import load_hf_config, param_counts

            etas = _ints(args.etas, "--etas") if args.etas else list(quality.DEFAULT_ETAS)
            from megarl.bench.variants import parse_strategies
            from megarl.builder import strategy_names

            variants = parse_strategies(args.strategies or ",".join(quality.DEFAULT_STRATEGIES),
                                        lambda extra: load_run_config(args.config, [*overrides, *extra]),
                                        strategy_names("all"))
            seeds = quality.DEFAULT_SEEDS if args.seeds is None else args.seeds
            cells = quality.plan(args.config, variants, etas, seeds, steps, args.output, overrides)
            n_runs = sum(c["records"] is None for c in cells)
            estimate = n_runs * sweep.estimate_run_seconds(param_counts(load_hf_config(cfg)[0])[1], steps)
            if n_runs < len(cells):
                print(f"{len(cells) - n_runs} of {len(cells)} runs finished before under {args.output}: reused")
        print(f"{n_runs} runs of {steps} steps: about {_hms(estimate)} on an idle 2-core machine "
              f"(megarl/bench/sweep.py ESTIMATE_*)", flush=True)
        if args.estimate_only:
            return 0
        # one set of engines for every cell whose engine settings agree (a sweep's models each get their own)
        with EnginePool(Path(args.output) / "engines") as pool:
            run_cell = functools.partial(run_strategy, pool=pool)
            if args.sweep:
                rep = sweep.run_sweep(args.config, models, etas, strategies, steps, args.output, overrides,
                                      run=run_cell, meta=meta)
            else:
                window = args.final_window or max(5, steps // 10)
                rep = quality.run_quality(args.config, variants, etas, seeds, steps, args.output, overrides,
                                          run=run_cell, meta=meta, window=window, threshold=args.threshold)
        if args.sweep:
            rep["meta"]["loadavg_end"] = machine_meta()["loadavg_start"]
            write_report(Path(args.output), rep, sweep.render_sweep_markdown(rep))
            print(f"wrote {args.output}/report.json, report.md, scaling.png")
        else:
            rep["meta"]["loadavg_end"] = machine_meta()["loadavg_start"]
            write_report(Path(args.output), rep, quality.render_quality_markdown(rep))
            print(f"wrote {args.output}/report.json, report.md, runs.jsonl, quality.png")
        return 0
    chosen = _strategies(args.strategies, "none" if args.compare_sync and args.strategies is None else "all")
    if not chosen and not args.compare_sync and not cfg.rollout.routing_replay:
        raise ConfigError("--strategies none runs nothing; add --compare-sync or name strategies (with "
                          "rollout.routing_replay=true it measures the replay's cost alone)")
    from megarl.bench.interleave import DEFAULT_REPEATS, ratio_lines

    repeats = DEFAULT_REPEATS if args.repeats is None else args.repeats
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: give at least 1 (3 or more for an interval that means something)")
    report = bench(args.config, chosen, args.steps, args.output, overrides, compare_sync=args.compare_sync,
                   verify=not args.no_verify, eta=args.eta, disjoint_cores=args.disjoint_cores, repeats=repeats)
    print_table(report)
    for line in ratio_lines(report):
        print(line)
    if "routing_replay" in report:
        from megarl.bench.replay_cost import summary_line

        print(summary_line(report["routing_replay"]))
    print(f"wrote {args.output}/report.json, report.md" + (", overhead.png, reward.png" if chosen else ""))
    return 0
