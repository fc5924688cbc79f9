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
STAMP="$ROOT/.venv/.installed-$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
    "$VPY" -m pip install -q --disable-pip-version-check --upgrade pip
    # ggml-python vendors ggml with its standalone default, llamafile's sgemm off; llama.cpp builds
    # it in. Without it a prompt batch's BF16/F16/Q8_0 matmuls run about 2.3x slower
    # (bench/graph.py). pip keys its wheel cache on the sdist, not on CMAKE_ARGS, so this one
    # package is built outside the cache: a cached build without llamafile is never reused.
    GGML_PYTHON="$(grep -Eo 'ggml-python==[0-9.]+' "$ROOT/setup.cfg")"
    CMAKE_ARGS="-DGGML_LLAMAFILE=ON -DGGML_RPC=ON" "$VPY" -m pip install -q --disable-pip-version-check \
        --no-cache-dir --no-binary ggml-python --force-reinstall --no-deps "$GGML_PYTHON"
    # torch==2.13.0 is pinned in the test extra: that version installs the CPU build from local disk.
    "$VPY" -m pip install -q --disable-pip-version-check -e "$ROOT[test,interop]"
    touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
# llama.cpp's own tools (llama-cli, llama-perplexity, llama-imatrix, llama-quantize, ...) from the
# pinned llama-cpp-python sdist, built once per machine into a cache; exports KIMI_K3_LLAMA_BIN.
source "$ROOT/scripts/build_llama_tools.sh"
# tests/test_demo.py runs demo.sh only when this setup is current (its setup step is then a no-op).
export KIMI_K3_VENV_STAMP="$STAMP"
