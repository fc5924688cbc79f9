#!/usr/bin/env bash
# Builds llama.cpp's own command-line tools from the llama.cpp tree inside the llama-cpp-python
# sdist pinned in setup.cfg (fetched with pip, from the package registry only), once per machine:
#   ${KIMI_K3_CACHE:-$HOME/.cache/kimi-k3-gguf}/llama.cpp-<version>-<hash of the recipe>/bin
# The build runs in a temporary directory beside it and is renamed into place only when every
# tool is built, so an interrupted or failed build is never taken for a finished one.
# Sourced by setup_env.sh, which then exports KIMI_K3_LLAMA_BIN (the tests find the tools there);
# also runs on its own: bash scripts/build_llama_tools.sh prints that directory.
set -euo pipefail
ROOT="${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
VPY="${VPY:-python3}"
LOGS="${LOGS:-$ROOT/.venv/setup-logs}"
source "$ROOT/scripts/setup_step.sh"

LLAMA_TOOLS=(llama-cli llama-completion llama-perplexity llama-imatrix llama-quantize llama-gguf-split llama-server)
# Files of the llama.cpp tree the tests read as llama.cpp's own statement of a behaviour (never
# committed here): K3's chat template, and the tools' READMEs with their flag tables. Kept in
# share/ beside bin/, at their paths in the tree.
LLAMA_FILES=(models/templates/Kimi-K3.jinja tools/cli/README.md tools/server/README.md tools/completion/README.md)
# Static binaries (the cache directory can move), no network at build time (no curl, no OpenSSL,
# no prebuilt web UI download), no tests or examples.
LLAMA_CMAKE_OPTS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF)
LLAMA_VERSION="$(grep -Eo 'llama-cpp-python==[0-9.]+' "$ROOT/setup.cfg" | head -n1 | cut -d= -f3)"

llama_tools_dir() {
    local recipe
    recipe="$(printf '%s\n' "$LLAMA_VERSION" "${LLAMA_CMAKE_OPTS[@]}" "${LLAMA_TOOLS[@]}" "${LLAMA_FILES[@]}" | sha256sum | cut -c1-12)"
    echo "${KIMI_K3_CACHE:-$HOME/.cache/kimi-k3-gguf}/llama.cpp-$LLAMA_VERSION-$recipe"
}

llama_tools_complete() {
    local tool file
    for tool in "${LLAMA_TOOLS[@]}"; do
        [ -x "$1/bin/$tool" ] || return 1
    done
    for file in "${LLAMA_FILES[@]}"; do
        [ -f "$1/share/$file" ] || return 1
    done
}

# The build proper, in TMP: sdist, sources, cmake build, then TMP/bin with the tools. Each step
# checks its own status: setup_step tests this function's, and bash ignores `set -e` in there.
llama_tools_steps() {
    local tmp="$1" tool
    "$VPY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMA_VERSION" -d "$tmp/sdist" || return
    mkdir -p "$tmp/src" "$tmp/bin" || return
    tar -xzf "$tmp/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$tmp/src" --strip-components=1 || return
    nice -n 10 cmake -S "$tmp/src/vendor/llama.cpp" -B "$tmp/build" "${LLAMA_CMAKE_OPTS[@]}" || return
    nice -n 10 cmake --build "$tmp/build" -j "$(nproc)" --target "${LLAMA_TOOLS[@]}" || return
    for tool in "${LLAMA_TOOLS[@]}"; do
        cp "$tmp/build/bin/$tool" "$tmp/bin/$tool" || return
    done
    for file in "${LLAMA_FILES[@]}"; do
        mkdir -p "$(dirname "$tmp/share/$file")" && cp "$tmp/src/vendor/llama.cpp/$file" "$tmp/share/$file" || return
    done
}

llama_tools_build() {
    local dest="$1" tmp rc=0
    mkdir -p "$(dirname "$dest")" "$LOGS"
    # What an interrupted build left (a day old: not one running beside us right now).
    find "$(dirname "$dest")" -maxdepth 1 -name "$(basename "$dest").partial.*" -mmin +1440 -exec rm -rf {} +
    tmp="$(mktemp -d "$dest.partial.XXXXXX")"
    chmod 755 "$tmp"
    setup_step llama-tools "building llama.cpp's tools from llama-cpp-python $LLAMA_VERSION into $dest (about 6 minutes on 2 cores): ${LLAMA_TOOLS[*]}" -- \
        llama_tools_steps "$tmp" || rc=$?
    rm -rf "$tmp/src" "$tmp/build" "$tmp/sdist"
    if [ "$rc" -ne 0 ]; then
        rm -rf "$tmp"
        return "$rc"
    fi
    # A concurrent setup may have finished first: its build is as good as ours.
    if [ -e "$dest" ]; then rm -rf "$tmp"; else mv -T "$tmp" "$dest"; fi
}

LLAMA_TOOLS_DIR="$(llama_tools_dir)"
if ! llama_tools_complete "$LLAMA_TOOLS_DIR"; then
    rm -rf "$LLAMA_TOOLS_DIR"    # only ever a finished build someone has since emptied
    llama_tools_build "$LLAMA_TOOLS_DIR"
fi
export KIMI_K3_LLAMA_BIN="$LLAMA_TOOLS_DIR/bin"
export KIMI_K3_LLAMA_SHARE="$LLAMA_TOOLS_DIR/share"
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    echo "$KIMI_K3_LLAMA_BIN"
fi
