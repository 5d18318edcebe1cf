#!/usr/bin/env bash
# Creates .venv with everything pipefb needs (CPU torch pinned) and installs pipefb editable.
# Idempotent: a second run only checks. Used by scripts/demo.sh and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.pipefb-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: the CPU wheel; anything unpinned would pull CUDA packages.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
