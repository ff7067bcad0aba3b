#!/usr/bin/env bash
# Install what the Slurm e2e test needs (tests/e2e/test_preempt_slurm.py): Debian's slurm-wlm and munge.
# A no-op when they are installed; needs root and apt-get. In CI (CI=true) a failed install is an error;
# elsewhere it is a warning and the Slurm test is skipped.
set -uo pipefail
need=()
for tool in slurmctld slurmd sbatch munged; do
  command -v "$tool" >/dev/null 2>&1 || [[ -x "/usr/sbin/$tool" ]] || need+=("$tool")
done
if [[ ${#need[@]} -eq 0 ]]; then
  exit 0
fi
fail() {
  if [[ "${CI:-}" == "true" ]]; then
    echo "[install_slurm] ERROR: $1" >&2
    exit 1
  fi
  echo "[install_slurm] warning: $1; tests/e2e/test_preempt_slurm.py will be skipped" >&2
  exit 0
}
command -v apt-get >/dev/null 2>&1 || fail "no apt-get to install slurm-wlm and munge (missing: ${need[*]})"
[[ $(id -u) -eq 0 ]] || fail "installing slurm-wlm and munge needs root (missing: ${need[*]})"
echo "[install_slurm] installing slurm-wlm and munge (missing: ${need[*]})"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || fail "apt-get update failed"
apt-get install -y -qq slurm-wlm munge >/dev/null || fail "apt-get install slurm-wlm munge failed"
