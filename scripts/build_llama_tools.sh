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

LLAMA_TOOLS=(llama-cli llama-completion llama-perplexity llama-imatrix llama-quantize llama-gguf-split)
# Static binaries (the cache directory can move), no network at build time (no curl, no OpenSSL,
# no prebuilt web UI download), no tests or examples.
LLAMA_CMAKE_OPTS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF)

llama_tools_dir() {
    local version recipe
    version="$(grep -Eo 'llama-cpp-python==[0-9.]+' "$ROOT/setup.cfg" | head -n1 | cut -d= -f3)"
    recipe="$(printf '%s\n' "$version" "${LLAMA_CMAKE_OPTS[@]}" "${LLAMA_TOOLS[@]}" | sha256sum | cut -c1-12)"
    echo "${KIMI_K3_CACHE:-$HOME/.cache/kimi-k3-gguf}/llama.cpp-$version-$recipe"
}

llama_tools_build() {
    local dest="$1" version tmp log start
    version="${dest##*/llama.cpp-}"; version="${version%-*}"
    mkdir -p "$(dirname "$dest")"
    tmp="$(mktemp -d "$dest.partial.XXXXXX")"
    log="$tmp/build.log"
    echo "building llama.cpp tools from llama-cpp-python $version (about 6 minutes on 2 cores): ${LLAMA_TOOLS[*]}" >&2
    echo "  into $dest (log: $log)" >&2
    start=$SECONDS
    if ! llama_tools_steps "$tmp" "$version" >"$log" 2>&1; then
        echo "error: building llama.cpp tools failed; last lines of $log:" >&2
        tail -n 40 "$log" >&2
        return 1
    fi
    echo "  built in $((SECONDS - start)) s" >&2
    mv "$log" "$tmp/bin/build.log"
    rm -rf "$tmp/src" "$tmp/build" "$tmp/sdist"
    # A concurrent setup may have finished first: its build is as good as ours.
    if [ -e "$dest" ]; then rm -rf "$tmp"; else mv -T "$tmp" "$dest"; fi
}

llama_tools_complete() {
    local tool
    for tool in "${LLAMA_TOOLS[@]}"; do
        [ -x "$1/bin/$tool" ] || return 1
    done
}

llama_tools_steps() {
    local tmp="$1" version="$2" tool
    "$VPY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
        "llama-cpp-python==$version" -d "$tmp/sdist"
    mkdir -p "$tmp/src"
    tar -xzf "$tmp/sdist"/llama_cpp_python-"$version".tar.gz -C "$tmp/src" --strip-components=1
    nice -n 10 cmake -S "$tmp/src/vendor/llama.cpp" -B "$tmp/build" "${LLAMA_CMAKE_OPTS[@]}"
    nice -n 10 cmake --build "$tmp/build" -j "$(nproc)" --target "${LLAMA_TOOLS[@]}"
    mkdir -p "$tmp/bin"
    for tool in "${LLAMA_TOOLS[@]}"; do
        cp "$tmp/build/bin/$tool" "$tmp/bin/$tool"
    done
}

LLAMA_TOOLS_DIR="$(llama_tools_dir)"
if ! llama_tools_complete "$LLAMA_TOOLS_DIR"; then
    rm -rf "$LLAMA_TOOLS_DIR"    # only ever a finished build someone has since emptied
    llama_tools_build "$LLAMA_TOOLS_DIR"
fi
export KIMI_K3_LLAMA_BIN="$LLAMA_TOOLS_DIR/bin"
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    echo "$KIMI_K3_LLAMA_BIN"
fi
