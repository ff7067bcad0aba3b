#!/usr/bin/env bash
# GPU checks of megarl on one GPU, mostly with the tiny model, ~10 min on an H200 (see tests/gpu/gpu_check.py
# for what each does): env, rendezvous (NCCL through launch/torchrun.sh), megatron_parity (Megatron vs HF),
#   vllm_parity (official vLLM wheel generate + logprobs vs the Megatron trainer), broadcast_gloo /
#   broadcast_nccl / hf_broadcast / hf_broadcast_nccl (trainer step -> weights into the GPU engine -> parity),
#   te_spec (TransformerEngine layer spec, if installed), bf16_step, train_loop, verify_recovery,
#   plan_vs_peak (the memory plan vs measured bf16 steps and a checkpoint save on a 2-layer, full-width
#   Qwen3-30B-A3B, 0.8-1.1x, and the weight sender's device bytes: writes a ~7.5 GB random checkpoint first,
#   the slowest check), publish_memory (three broadcast publishes leave GPU
#   and shared memory at their baseline), cuda_ipc (CUDA-IPC buckets to a second process, freed after),
#   te_grouped_gemm (the MoE's experts as TE's grouped GEMM, if TE is installed), ewma_device (ewma's fold on
#   the GPU: a host phi and a phi kept on the GPU agree bit for bit, no copy of theta taken), pinned_bytes
#   (kept host copies: one page-locked flat buffer each, within 1% of the host plan's pinned bytes),
#   nccl_init_deadline (a receiver whose sender never sets the NCCL communicator up leaves at its deadline),
#   sender_kill (a weight sender killed mid-publish leaves the trainer's GPU memory at its baseline).
# Every check runs in its own process with a time limit and prints PASS, SKIP or FAIL; the script
# exits 1 if any check failed.
#
#   bash launch/gpu_check.sh                 all checks
#   bash launch/gpu_check.sh vllm_parity     some checks
#   bash launch/gpu_check.sh --self-test     no GPU: syntax, the APIs the checks call, the harness itself
#
# Environment: PYTHON (default .venv/bin/python), GPU_CHECK_TIMEOUT (s per check, default 240: room for
# plan_vs_peak's checkpoint; the others take far less),
# GPU_CHECK_WORKDIR (scratch; default a new temp dir), GPU_CHECK_FORCE_NCCL=1 (try NCCL on one GPU).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
PATH="$(dirname "$PY"):$PATH"
export PATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
TIMEOUT=${GPU_CHECK_TIMEOUT:-240}
WORK=${GPU_CHECK_WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/megarl-gpu-check.XXXXXX")}
mkdir -p "$WORK"

# run_checks NAME...: each check in its own process; prints a summary; returns the number failed
run_checks() {
  local name rc status line failed=0
  local -a summary=()
  for name in "$@"; do
    echo "=== gpu_check $name (limit ${TIMEOUT}s, log $WORK/$name.log)"
    local t0=$SECONDS
    timeout --kill-after=15 "$TIMEOUT" "$PY" tests/gpu/gpu_check.py "$name" --workdir "$WORK" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    line=$(grep -E "^GPU_CHECK (PASS|SKIP|FAIL) $name:" "$WORK/$name.log" | tail -n 1)
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
      status="FAIL $name: timed out after ${TIMEOUT}s"
    elif [[ -z "$line" ]]; then
      status="FAIL $name: exited $rc without a result line (crashed)"
    elif [[ $rc -ne 0 && "$line" != *" FAIL "* ]]; then
      status="FAIL $name: exited $rc after: ${line#GPU_CHECK }"
    else
      status=${line#GPU_CHECK }
    fi
    [[ "$status" == FAIL* ]] && failed=$((failed + 1))
    summary+=("$(printf '%4ss  %s' $((SECONDS - t0)) "$status")")
  done
  echo "=== gpu_check summary ($WORK)"
  printf '%s\n' "${summary[@]}"
  return "$failed"
}

if [[ "${1:-}" == "--self-test" ]]; then
  bash -n "${BASH_SOURCE[0]}" || { echo "GPU_CHECK FAIL self-test: bash syntax"; exit 1; }
  "$PY" tests/gpu/gpu_check.py --self-test --workdir "$WORK" || exit 1
  # the harness must report a passing and a failing check as such, and count the failure
  out=$(run_checks _pass _fail 2>&1); n=$?
  if [[ $n -ne 1 || "$out" != *"PASS _pass: ok"* || "$out" != *"FAIL _fail: CheckFailed: deliberate failure"* ]]; then
    echo "$out"
    echo "GPU_CHECK FAIL self-test: harness did not report _pass/_fail correctly (failed count $n)"
    exit 1
  fi
  echo "GPU_CHECK PASS self-test: harness reports PASS/FAIL per check"
  echo "gpu_check self-test passed"
  exit 0
fi

if [[ $# -gt 0 ]]; then
  checks=("$@")
else
  read -r -a checks <<< "$("$PY" tests/gpu/gpu_check.py --list)"
fi
run_checks "${checks[@]}"
failed=$?
if [[ $failed -gt 0 ]]; then
  echo "gpu_check: $failed check(s) FAILED"
  exit 1
fi
echo "gpu_check: all checks passed or skipped"
