#!/usr/bin/env bash
# Install what the Slurm and multi-host e2e tests need (tests/e2e/test_preempt_slurm.py, test_multihost.py,
# tests/cluster_hosts.py): Debian's slurm-wlm and munge, iproute2 (ip) and util-linux (nsenter, unshare).
# A no-op when they are installed; needs root and apt-get. In CI (CI=true) a failed install is an error;
# elsewhere it is a warning and those tests are skipped.
set -uo pipefail
need=()
packages=()
for tool in slurmctld slurmd sbatch munged ip nsenter unshare; do
  command -v "$tool" >/dev/null 2>&1 || [[ -x "/usr/sbin/$tool" ]] || need+=("$tool")
done
if [[ ${#need[@]} -eq 0 ]]; then
  exit 0
fi
for tool in "${need[@]}"; do
  case $tool in
    ip) packages+=(iproute2) ;;
    nsenter|unshare) packages+=(util-linux) ;;
    *) packages+=(slurm-wlm munge) ;;
  esac
done
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u)
fail() {
  if [[ "${CI:-}" == "true" ]]; then
    echo "[install_slurm] ERROR: $1" >&2
    exit 1
  fi
  echo "[install_slurm] warning: $1; the Slurm and multi-host tests will be skipped" >&2
  exit 0
}
command -v apt-get >/dev/null 2>&1 || fail "no apt-get to install ${packages[*]} (missing: ${need[*]})"
[[ $(id -u) -eq 0 ]] || fail "installing ${packages[*]} needs root (missing: ${need[*]})"
echo "[install_slurm] installing ${packages[*]} (missing: ${need[*]})"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || fail "apt-get update failed"
apt-get install -y -qq "${packages[@]}" >/dev/null || fail "apt-get install ${packages[*]} failed"
