#!/usr/bin/env bash
# Set everything up, then run the whole test suite: unit tests, lab tests on real sshd hosts in
# network namespaces (root), and the provisioning tests. Extra arguments go to pytest.
#
# Test files run in DDPFAB_TEST_WORKERS processes at once (pytest-xdist, default 2; 0 = one
# process): each worker brings up a lab of its own on a subnet of its own, and a file stays on one
# worker, since the tests in a file share labs and fixtures; the longest files start first
# (tests/conftest.py). Two workers pay off even on two cores; a third is not the default: the lab
# files that train are CPU-bound (every rank and torchrun imports torch), so a third worker makes
# every file slower and the whole barely shorter (docs/testing.md has the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# ddpfab's bytecode, as `pip install` of a wheel leaves it: the editable install writes none, and
# where PYTHONDONTWRITEBYTECODE is set (sandboxes, CI) no process would, so each of the suite's
# `python -m ddpfab` processes compiled every module again (0.15 s of CPU each, measured)
.venv/bin/python -m compileall -q ddpfab  # -q: errors only
.venv/bin/ruff check --quiet ddpfab  # the rules: [tool.ruff] in pyproject.toml
.venv/bin/mypy  # [tool.mypy] in pyproject.toml: what it checks, and the modules still listed as typing debt
# the docs site: a broken link or anchor, a page missing from the nav fails (mkdocs.yml's validation)
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
workers=${DDPFAB_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest -q --durations=25 "$@"
fi
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --durations=25 "$@"
