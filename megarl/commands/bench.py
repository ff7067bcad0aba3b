"""`megarl bench`: run every recovery strategy from the same config and seed; report costs and errors."""
from __future__ import annotations

from megarl.bench.report import print_table
from megarl.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark recovery strategies: step time, overheads, memory, exactness")
    p.add_argument("--config", default="configs/bench_cpu.yaml", help="run config shared by every strategy")
    p.add_argument("--strategies", default="all", help="comma-separated strategy names, or 'all'")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per strategy (default: trainer.total_steps)")
    p.add_argument("--output", required=True,
                   help="directory for report.json, report.md, overhead.png, reward.png and one run per strategy")
    p.add_argument("--compare-sync", action="store_true",
                   help="also run behav with eta=0 and with the configured eta and report the throughput ratio")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the comparison with the true logp_old (max_abs_err_vs_exact becomes null)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides for every run")
    p.set_defaults(func=run)


def run(args) -> int:
    # the loop's modules (torch, Megatron) load only when the command runs, not for `megarl --help`
    from megarl.bench.run import bench
    from megarl.builder import strategy_names

    chosen = strategy_names(args.strategies)
    if args.steps is not None and args.steps < 2:
        raise ConfigError(f"--steps={args.steps}: the bench needs at least 2 steps (the first one is start-up)")
    report = bench(args.config, chosen, args.steps, args.output, list(args.overrides),
                   compare_sync=args.compare_sync, verify=not args.no_verify)
    print_table(report)
    print(f"wrote {args.output}/report.json, report.md, overhead.png, reward.png")
    return 0
