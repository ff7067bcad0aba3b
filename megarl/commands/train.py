"""`megarl train`: run the asynchronous RL loop from a config."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("train", help="train a policy with asynchronous RL")
    p.add_argument("--config", help="YAML config (e.g. configs/tiny_cpu.yaml)")
    p.add_argument("--output-dir", help="run directory (default: a new timestamped directory under runs/)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest valid checkpoint (same config; it keeps "
                        "writing to RUN_DIR)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=1e-3")
    p.set_defaults(func=run)


def run(args) -> int:
    from megarl.config.loader import describe, dump_yaml, load_config

    if args.help_config:
        print("\n".join(describe()))
        return 0
    overrides = list(args.overrides)
    if args.resume and args.output_dir:
        from megarl.errors import ConfigError

        raise ConfigError("--resume RUN_DIR continues writing to RUN_DIR; drop --output-dir")
    if args.output_dir:
        overrides.append(f"logging.output_dir={args.output_dir}")
    if args.resume:
        overrides.append(f"logging.resume={args.resume}")
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    from megarl.train import train

    run_dir = train(cfg)
    print(f"run finished: {run_dir}")
    return 0
