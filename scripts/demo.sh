#!/usr/bin/env bash
# The demo: set everything up, bring up a 2-host lab on this machine, train examples/train.py on
# 2 nodes x 2 processes over SSH with ddpfab, then take the lab down (also on failure or Ctrl-C).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
LAB_DIR=${LAB_DIR:-$PWD/.lab/demo}
DDPFAB=.venv/bin/ddpfab
trap '$DDPFAB lab down --dir "$LAB_DIR" >/dev/null' EXIT
$DDPFAB lab up --hosts 2 --dir "$LAB_DIR" --subnet "${LAB_SUBNET:-10.213.0.0/24}"
echo
echo "\$ ddpfab run --inventory $LAB_DIR/inventory.yml --nproc-per-node 2 examples/train.py --steps 5"
$DDPFAB run --inventory "$LAB_DIR/inventory.yml" --nproc-per-node 2 examples/train.py --steps 5
