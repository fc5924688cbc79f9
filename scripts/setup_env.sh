#!/usr/bin/env bash
# Creates (or reuses) .venv in the repository root and installs the project with its test extras.
# Sourced by demo.sh and test.sh; idempotent, quiet when everything is already installed.
# Each step says what it builds and about how long it takes; its output goes to a log under
# .venv/setup-logs/, whose tail is printed if the step fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
LOGS="$ROOT/.venv/setup-logs"

source "$ROOT/scripts/setup_step.sh"

if [ ! -x "$ROOT/.venv/bin/python" ]; then
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "error: Python 3.11 or newer is needed ($PY is $("$PY" -V 2>&1))" >&2; exit 2; }
    "$PY" -m venv "$ROOT/.venv" \
        || { echo "error: '$PY -m venv' failed: install Python's venv module (Debian: python3-venv)" >&2; exit 2; }
fi
mkdir -p "$LOGS"
VPY="$ROOT/.venv/bin/python"
STAMP="$ROOT/.venv/.installed-$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
    for tool in cc c++ cmake; do
        command -v "$tool" >/dev/null || { echo "error: '$tool' not found: a C/C++ compiler and cmake are needed to build ggml" >&2; exit 2; }
    done
    echo "setup: first run: building the environment in .venv (about 12 minutes on 2 cores)" >&2
    setup_step pip "upgrading pip (seconds)" -- \
        "$VPY" -m pip install -q --disable-pip-version-check --upgrade pip
    # ggml-python vendors ggml with its standalone default, llamafile's sgemm off; llama.cpp builds
    # it in. Without it a prompt batch's BF16/F16/Q8_0 matmuls run about 2.3x slower
    # (bench/graph.py). RPC is ggml's own backend for running layers on other hosts. pip keys its
    # wheel cache on the sdist, not on CMAKE_ARGS, so this one package is built outside the cache:
    # a cached build without these options is never reused.
    GGML_PYTHON="$(grep -Eo 'ggml-python==[0-9.]+' "$ROOT/setup.cfg")"
    setup_step ggml-python "building $GGML_PYTHON from source with llamafile and RPC (about 2 minutes)" -- \
        env CMAKE_ARGS="-DGGML_LLAMAFILE=ON -DGGML_RPC=ON" "$VPY" -m pip install -q --disable-pip-version-check \
        --no-cache-dir --no-binary ggml-python --force-reinstall --no-deps "$GGML_PYTHON"
    # torch==2.13.0 is pinned in the test extra: that version installs the CPU build from local disk.
    # llama-cpp-python builds llama.cpp from its sdist the first time; pip caches that wheel.
    setup_step project "installing the project, torch (CPU) and llama-cpp-python (about 9 minutes the first time: llama.cpp is compiled; seconds once pip has cached it)" -- \
        "$VPY" -m pip install -q --disable-pip-version-check -e "$ROOT[test,interop,server]"
    touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
# llama.cpp's own tools (llama-cli, llama-perplexity, llama-imatrix, llama-quantize, ...) from the
# pinned llama-cpp-python sdist, built once per machine into a cache; exports KIMI_K3_LLAMA_BIN.
source "$ROOT/scripts/build_llama_tools.sh"
# tests/test_demo.py runs demo.sh only when this setup is current (its setup step is then a no-op).
export KIMI_K3_VENV_STAMP="$STAMP"
