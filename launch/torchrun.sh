#!/usr/bin/env bash
# megarl under torchrun: one node runs everything (`launch/torchrun.sh --config X`); with several
# nodes run the same line on every node and each starts the roles the plan gives its host.
#
#   launch/torchrun.sh --config configs/tiny_cpu.yaml placement.trainer_ranks=2 [key=value ...]
#   launch/torchrun.sh --dry-run --config configs/qwen3_4b_h100.yaml --nodes 2 --gpus-per-node 8
#
# Environment: PYTHON (default .venv/bin/python of the repo).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
exec "$PY" -m megarl.cli launch --launcher torchrun "$@"
