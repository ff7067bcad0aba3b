#!/usr/bin/env bash
# Set up .venv if needed, then run the tiny CPU training demo (configs/tiny_cpu.yaml).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec .venv/bin/megarl train --config configs/tiny_cpu.yaml "$@"
