#!/usr/bin/env bash
# Creates (or reuses) .venv in the repository root with what the job that sources it needs:
#   source scripts/setup_env.sh demo   (demo.sh) converting and running: ggml-python built from
#                                      source, the project and its install_requires (setup.cfg)
#   source scripts/setup_env.sh test   (test.sh) all that, plus the test, interop and server extras
#                                      (torch, llama-cpp-python, ...) and llama.cpp's own tools
# The demo's level is the small one so that its first line comes within about 2 minutes on a fresh
# machine; what only the tests use takes about 12 minutes more and comes with the test command.
# Idempotent and quiet once set up: each level leaves a stamp in .venv named with a hash of this
# file and the project's metadata (a change to them sets up again). The test level is built on top
# of the demo level and stamped apart, so a demo-only .venv is never taken for a test one (the
# test command completes it) and a test .venv serves the demo at once.
# Each step says what it builds and about how long it takes; its output goes to a log under
# .venv/setup-logs/, whose tail is printed if the step fails.
set -euo pipefail
# Given explicitly: a script sourced without arguments would see its caller's.
LEVEL="${1:-}"
[ "$LEVEL" = demo ] || [ "$LEVEL" = test ] \
    || { echo "error: usage: source scripts/setup_env.sh demo|test (got '$LEVEL')" >&2; exit 2; }
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
HASH="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)"
DEMO_STAMP="$ROOT/.venv/.installed-demo-$HASH"
TEST_STAMP="$ROOT/.venv/.installed-test-$HASH"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)

if [ ! -f "$DEMO_STAMP" ]; then
    for tool in cc c++ cmake; do
        command -v "$tool" >/dev/null || { echo "error: '$tool' not found: a C/C++ compiler and cmake are needed to build ggml" >&2; exit 2; }
    done
    echo "setup: first run: installing what converting and running need in .venv (about 2 minutes on 2 cores)" >&2
    setup_step pip "upgrading pip (seconds)" -- "${PIP[@]}" --upgrade pip
    # ggml-python vendors ggml with its standalone default, llamafile's sgemm off; llama.cpp builds
    # it in. Without it a prompt batch's BF16/F16/Q8_0 matmuls run about 2.3x slower
    # (bench/graph.py). RPC is ggml's own backend for running layers on other hosts. pip keys its
    # wheel cache on the sdist, not on CMAKE_ARGS, so this one package is built outside the cache:
    # a cached build without these options is never reused. No GPU flag: the runtime is CPU-only.
    GGML_PYTHON="$(grep -Eo 'ggml-python==[0-9.]+' "$ROOT/setup.cfg")"
    setup_step ggml-python "building $GGML_PYTHON from source with llamafile and RPC (about a minute)" -- \
        env CMAKE_ARGS="-DGGML_LLAMAFILE=ON -DGGML_RPC=ON" "${PIP[@]}" \
        --no-cache-dir --no-binary ggml-python --force-reinstall --no-deps "$GGML_PYTHON"
    # install_requires only: no torch, no llama-cpp-python, nothing compiled but ggml above.
    setup_step project "installing the project and its runtime packages from setup.cfg (seconds)" -- \
        "${PIP[@]}" -e "$ROOT"
    touch "$DEMO_STAMP"
fi
if [ "$LEVEL" = test ] && [ ! -f "$TEST_STAMP" ]; then
    echo "setup: the tests need more than the demo: completing .venv (about 5 minutes the first time on 2 cores)" >&2
    # torch==2.13.0 is pinned in the test extra: that version installs the CPU build from local disk.
    # llama-cpp-python builds llama.cpp from its sdist the first time; pip caches that wheel.
    setup_step extras "installing the test, interop and server extras: torch (CPU), llama-cpp-python (llama.cpp is compiled: about 5 minutes the first time, seconds once pip has cached it), the clients the tests drive" -- \
        "${PIP[@]}" -e "$ROOT[test,interop,server]"
    touch "$TEST_STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
if [ "$LEVEL" = test ]; then
    # llama.cpp's own tools (llama-cli, llama-perplexity, llama-imatrix, llama-quantize, ...) from
    # the pinned llama-cpp-python sdist, built once per machine into a cache; exports
    # KIMI_K3_LLAMA_BIN. Only the tests use them.
    source "$ROOT/scripts/build_llama_tools.sh"
fi
# tests/test_demo.py runs demo.sh only when demo.sh's setup would be a no-op (this stamp exists).
export KIMI_K3_VENV_STAMP="$DEMO_STAMP"
