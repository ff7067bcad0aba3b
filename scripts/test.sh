#!/usr/bin/env bash
# Set up .venv if needed, lint, then run the test suite (unit, distributed, e2e; or the paths given).
#   bash scripts/test.sh               everything (what CI runs)
#   bash scripts/test.sh tests/unit    the unit tests only (about 2 minutes), while working
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
bash scripts/install_slurm.sh  # the real Slurm of tests/e2e/test_preempt_slurm.py (fails in CI when it cannot)
.venv/bin/ruff check .
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec .venv/bin/python -m pytest -q -rs --durations=20 "${@:-tests}"
