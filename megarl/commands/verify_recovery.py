"""`megarl verify-recovery`: check each strategy's anchor against the true logp_old inside the real loop."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("verify-recovery", help="compare recovery anchors with the true logp_old of every token")
    p.add_argument("--config", required=True, help="run config (e.g. configs/tiny_cpu.yaml); needs eta >= 2")
    p.add_argument("--strategies", default="snapshot,dedicated,interrupt_sync,ewma,recompute,loglinear",
                   help="comma-separated strategy names, or 'all'")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per strategy")
    p.add_argument("--output", default="report.json", help="where to write the JSON report")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.set_defaults(func=run)


def run(args) -> int:
    from megarl.verify import verify
    from recovery.registry import resolve_names

    chosen = resolve_names(args.strategies)
    verify(args.config, chosen, args.steps, args.output, args.overrides)
    print(f"wrote {args.output}")
    return 0
