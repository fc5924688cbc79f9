#!/usr/bin/env bash
# Creates (or reuses) .venv in the repository root and installs the project with its test extras.
# Sourced by demo.sh and test.sh; idempotent, quiet when everything is already installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
    "$PY" -m venv "$ROOT/.venv"
fi
VPY="$ROOT/.venv/bin/python"
STAMP="$ROOT/.venv/.installed-$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
    "$VPY" -m pip install -q --disable-pip-version-check --upgrade pip
    # torch==2.13.0 is pinned in the test extra: that version installs the CPU build from local disk.
    "$VPY" -m pip install -q --disable-pip-version-check -e "$ROOT[test,interop]"
    touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
