"""`megarl verify-recovery`: check each strategy's anchor against the true logp_old inside the real loop.

Exit code 0 when every strategy that claims exactness was measured exact
(max abs error <= --tol, no copy of logp_behav) and, in fp32, the reference
reproduced the engine's log-probs (the oracle); 1 when a check failed (each
printed with its reason), 2 on bad input.
"""
from __future__ import annotations

import math
import sys

from megarl.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("verify-recovery", help="check recovery anchors against the true logp_old of every token")
    p.add_argument("--config", required=True, help="run config (e.g. configs/tiny_cpu.yaml); needs eta >= 2")
    p.add_argument("--strategies", default="snapshot,dedicated,interrupt_sync,ewma,recompute,loglinear",
                   help="comma-separated strategy names, or 'all'")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per strategy")
    p.add_argument("--output", default="report.json", help="where to write the JSON report")
    p.add_argument("--tol", type=float, default=None,
                   help="largest max abs error of an exact strategy's anchor, exit code 1 above it "
                        "(default recovery.verifier.DEFAULT_TOL = 1e-5)")
    p.add_argument("--negative-control", default="", metavar="NAME",
                   help="make one thing wrong on purpose, to see a check fail (exit code 1 expected): "
                        "anchor_is_behav, next_version (wrong strategies claiming exactness), routes_shifted, "
                        "routes_other_version, routes_first_prefix (wrong MoE routes; the engine oracle in fp32), "
                        "restart_wrong_version (with --restart-at: a partial answer's kept tokens claim an older "
                        "version in the checkpoint the resume loads)")
    p.add_argument("--restart-at", type=int, default=0, metavar="K",
                   help="stop each run with SIGTERM at the first step from K on where an answer is under way, then "
                        "resume it from its checkpoint (as `megarl train --resume` does): the sequences spliced "
                        "across the restart are checked too (0: no restart)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.set_defaults(func=run)


def run(args) -> int:
    # the loop's modules (torch, Megatron) load only when the command runs, not for `megarl --help`
    from megarl.builder import strategy_names
    from megarl.verify.exactness import DEFAULT_TOL, failures, verify_recovery

    tol = DEFAULT_TOL if args.tol is None else args.tol
    if not (math.isfinite(tol) and tol >= 0):
        raise ConfigError(f"--tol={tol} must be a finite number >= 0")
    chosen = strategy_names(args.strategies)
    report = verify_recovery(args.config, chosen, args.steps, args.output, args.overrides, tol=tol,
                             negative_control=args.negative_control, restart_at=args.restart_at)
    print(f"wrote {args.output}")
    failed = failures(report)
    for line in failed:
        print(f"megarl verify-recovery: FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0
