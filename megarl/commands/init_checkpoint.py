"""`megarl init-checkpoint`: write a random-initialized HF checkpoint from a model YAML."""
from __future__ import annotations

from megarl.models.tiny import write_tiny_checkpoint


def register(sub) -> None:
    p = sub.add_parser("init-checkpoint", help="write a random-initialized HF-format checkpoint (tests, demo)")
    p.add_argument("--model", required=True, help="YAML of HF config.json fields, e.g. configs/models/tiny_qwen3.yaml")
    p.add_argument("--output", required=True, help="directory to write config.json and model.safetensors to")
    p.add_argument("--seed", type=int, default=0, help="initialization seed")
    p.set_defaults(func=run)


def run(args) -> int:
    out = write_tiny_checkpoint(args.model, args.output, seed=args.seed)
    print(f"wrote {out}")
    return 0
