#!/usr/bin/env bash
# Set up .venv if needed, lint, then run the test suite (unit, distributed, e2e; or the paths given).
#   bash scripts/test.sh               everything (what CI runs)
#   bash scripts/test.sh tests/unit -n 2    the unit tests only, in two workers (about 4 minutes), while working
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
bash scripts/install_slurm.sh  # the real Slurm of tests/e2e/test_preempt_slurm.py (fails in CI when it cannot)
.venv/bin/ruff check .
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
PYTEST=(.venv/bin/python -m pytest -q -rs --durations=50)
if [[ $# -gt 0 ]]; then
  exec "${PYTEST[@]}" "$@"
fi
# The whole suite in two runs, both always run (exit 1 when either fails):
# - tests/unit in two worker processes (pytest-xdist), a file's tests together in one of them: most run
#   in the worker's own process on one thread (OMP_NUM_THREADS=1), so each keeps a core;
# - then the rest one test at a time: each starts engines, trainer ranks and launchers that use both
#   cores, and several of them time their processes.
rc=0
"${PYTEST[@]}" -n 2 --dist loadfile tests/unit || rc=$?
"${PYTEST[@]}" tests/distributed tests/e2e tests/gpu || rc=$?
exit "$rc"
