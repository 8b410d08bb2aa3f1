#!/usr/bin/env bash
# Build llama.cpp's own server (llama-server) and llama-bench from the llama.cpp vendored in the
# pinned llama-cpp-python, with the same portable flags as the set-up (scripts/llama-cmake-args.sh),
# so that specdec/bench/serve.py compares specdec with the peer a CPU user would run instead, on the same
# kernels. The binaries go under the user's cache folder, keyed by version and flags; the path of
# llama-server is printed last. About 6 minutes on 2 cores the first time, nothing afterwards.
#   bash scripts/build-llama-server.sh            # then: specdec/bench/serve.py finds it there
#   bash scripts/build-llama-server.sh --check    # its path if built, else exit 1
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
req=$(grep -o '"llama-cpp-python==[^"]*"' pyproject.toml | tr -d '"')
# (llamafile back on: the peer as llama.cpp builds it by default; specdec leaves it out for exactness)
flags="$(sh scripts/llama-cmake-args.sh) -DGGML_LLAMAFILE=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF"
key=$(printf '%s\n' "$req" "$flags" "$(uname -m)" "$(${CC:-cc} --version 2>/dev/null | head -1)" | sha256sum | cut -c1-16)
out="${XDG_CACHE_HOME:-$HOME/.cache}/specdec/llama-server/$key"
if [ "${1:-}" = --check ]; then  # print the path if it is built, else exit 1 (specdec/bench/serve.py asks)
    [ -x "$out/bin/llama-server" ] && echo "$out/bin/llama-server" && exit 0
    exit 1
fi
if [ ! -x "$out/bin/llama-server" ]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/specdec-llama-server.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    echo "build-llama-server: fetching the source of $req" >&2
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$work" "$req"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
    generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
    echo "build-llama-server: compiling llama-server and llama-bench with: $flags" >&2
    start=$(date +%s)
    # shellcheck disable=SC2086  # the flags are words
    cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release $flags >"$work/cmake.log" 2>&1 \
        || { tail -30 "$work/cmake.log" >&2; exit 1; }
    cmake --build "$work/build" --target llama-server llama-bench -j "$(nproc)" >"$work/build.log" 2>&1 \
        || { tail -30 "$work/build.log" >&2; exit 1; }
    mkdir -p "$out.tmp/bin"
    cp "$work/build/bin/llama-server" "$work/build/bin/llama-bench" "$out.tmp/bin/"
    printf '%s\n%s\n' "$req" "$flags" > "$out.tmp/BUILD"
    rm -rf "$out" && mv "$out.tmp" "$out"
    echo "build-llama-server: built in $(( $(date +%s) - start )) s" >&2
fi
echo "$out/bin/llama-server"
