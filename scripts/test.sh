#!/usr/bin/env bash
# The test command of README.md: set up .venv for the tests if needed (completing a demo-only one),
# then run the whole suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" test
cd "$ROOT"
exec python -m pytest -q "$@"
