#!/usr/bin/env bash
# The test command of README.md: set up .venv if needed, then run the whole suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
exec python -m pytest -q "$@"
