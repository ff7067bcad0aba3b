"""`megarl advise`: measure, in a short calibration run on this config, which old-logit strategy to use.

Prints the table (strategy, measured cost per step, memory fit, distance of
its anchor from the exact logp_old, expected effect), the reasons for the
choice, and the paths of advise.json (every measurement) and advise.png.
The logic is in megarl/advise/; docs/guide.md ("Choosing a strategy: megarl
advise") explains how to read it.
"""
from __future__ import annotations


def register(sub) -> None:
    from megarl.advise import calibrate, costs

    p = sub.add_parser("advise", help="which old-logit strategy for this model and cluster, measured in a few steps")
    p.add_argument("--config", required=True, help="run config (the engines, trainer and layout you will train with)")
    p.add_argument("--steps", type=int, default=calibrate.DEFAULT_STEPS,
                   help=f"calibration steps (default {calibrate.DEFAULT_STEPS})")
    p.add_argument("--cost-steps", type=int, default=calibrate.DEFAULT_COST_STEPS,
                   help=f"steps of each strategy's timing run (default {calibrate.DEFAULT_COST_STEPS}; 0: none)")
    p.add_argument("--repeats", type=int, default=calibrate.DEFAULT_REPEATS,
                   help=f"rounds of timing runs, interleaved: every strategy once per round, the order reversed "
                        f"every other round; costs are medians over them with a 90%% t interval (default "
                        f"{calibrate.DEFAULT_REPEATS}; a later round runs only when all of it fits the budget)")
    p.add_argument("--strategies", default=",".join(costs.ORDER),
                   help="strategies to time, in this order, while the budget lasts (default all, cheapest first)")
    p.add_argument("--time-budget-s", type=float, default=calibrate.DEFAULT_TIME_BUDGET_S,
                   help=f"seconds for the whole command (default {calibrate.DEFAULT_TIME_BUDGET_S:g}): the "
                        f"calibration first, then timing runs while they fit; the skipped ones are named")
    p.add_argument("--host-memory-gb", type=float, default=None,
                   help="host memory per trainer node the strategies' copies must fit (default: this machine's)")
    p.add_argument("--output", default="runs/advise", help="RUN_DIR for advise.json, advise.md, advise.png and runs")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.set_defaults(func=run)


def run(args) -> int:
    from megarl.advise import report
    from megarl.advise.calibrate import advise
    from megarl.builder import strategy_names

    chosen = tuple(strategy_names(args.strategies))
    m = advise(args.config, args.overrides, args.output, steps=args.steps, cost_steps=args.cost_steps,
               strategies=chosen, time_budget_s=args.time_budget_s, host_memory_gb=args.host_memory_gb,
               repeats=args.repeats)
    print()
    print(report.render_markdown(m))
    for note in m["notes"]:
        print(f"note: {note}")
    print(f"wrote {m['paths']['json']}")
    print(f"wrote {m['paths']['picture']}")
    return 0
