#!/usr/bin/env bash
# Set everything up, then run the whole test suite: unit tests, lab tests on real sshd hosts in
# network namespaces (root), and the provisioning tests. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q "$@"
