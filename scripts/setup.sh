#!/usr/bin/env bash
# Install everything ddpfab, its demo and its tests need, on Debian/Ubuntu as root. Idempotent:
# a second run checks and returns in seconds.
#   - Debian packages: sshd/ssh, rsync, iptables, nftables, iproute2 (the lab), python3-venv
#   - .venv with torch==2.13.0 installed FIRST (the CPU wheel; a plain `torch` would pull a
#     multi-GB CUDA build), then ddpfab itself with its node, test and docs extras.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PKGS=(openssh-server openssh-client rsync iptables nftables iproute2 procps util-linux python3 python3-venv git)
# Only for the test suite (`setup.sh --test`): Vagrantfile checks, the real-Slurm export test, the
# benchmark harness test (pdsh is one of the tools it compares), the zsh completion test, and
# `run --tmux` (tmux on the controller).
TEST_PKGS=(ruby vagrant slurmctld slurmd slurm-client munge pdsh zsh tmux)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for p in "${PKGS[@]}"; do installed "$p" || missing+=("$p"); done
missing_test=()
if [ "${1:-}" = "--test" ]; then
  for p in "${TEST_PKGS[@]}"; do installed "$p" || missing_test+=("$p"); done
fi
apt_pid=""
apt_log=""
guard=""
# on any exit: the background apt-get finishes before its guard goes
cleanup() {
  if [ -n "$apt_pid" ]; then wait "$apt_pid" 2>/dev/null || true; fi
  if [ -n "$guard" ]; then rm -f /usr/sbin/policy-rc.d; fi
}
trap cleanup EXIT
if [ "${#missing[@]}" -gt 0 ] || [ "${#missing_test[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  # keep packages from starting system services (sshd, munge, slurm) on this machine: the lab
  # starts its own, inside namespaces
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && guard=1
  fi
  apt-get update -qq
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  if [ "${#missing_test[@]}" -gt 0 ]; then
    # the test-only packages (minutes: ruby, vagrant, slurm) install while pip installs below; no
    # pip step needs them, and the venv needs only the packages above
    echo "setup: installing ${missing_test[*]} (in the background, while pip runs)"
    apt_log=$(mktemp)
    apt-get install -y -qq --no-install-recommends "${missing_test[@]}" >"$apt_log" 2>&1 &
    apt_pid=$!
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU)"
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
fi
if ! .venv/bin/python -c 'import ddpfab, fabric, ansible, pytest, testinfra, hypothesis, numpy, xdist, mkdocs, material' 2>/dev/null \
   || [ pyproject.toml -nt .venv/.ddpfab-installed ]; then
  echo "setup: installing ddpfab with its node, test and docs extras"
  .venv/bin/pip install -q --disable-pip-version-check -e '.[node,test,docs]'
  touch .venv/.ddpfab-installed
fi
if [ -n "$apt_pid" ]; then
  rc=0
  wait "$apt_pid" || rc=$?
  apt_pid=""
  if [ "$rc" != 0 ]; then
    cat "$apt_log" >&2
    echo "setup: apt-get install of ${missing_test[*]} failed (exit $rc, output above)" >&2
    exit 1
  fi
  rm -f "$apt_log"
fi
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
