#!/usr/bin/env bash
# Regenerate the committed gRPC stubs in specdec/rpc/v1/ from protos/specdec/rpc/v1/*.proto.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: the repository root; the drift test passes a tmp dir)
# Needs grpcio-tools (pinned in pyproject.toml); PYTHON selects the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
OUT=${1:-.}
mkdir -p "$OUT/specdec/rpc/v1"
"$PY" -m grpc_tools.protoc -I protos \
  --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  protos/specdec/rpc/v1/*.proto
[ -f "$OUT/specdec/rpc/v1/__init__.py" ] || echo '"""Generated gRPC stubs (scripts/gen_protos.sh); do not edit."""' > "$OUT/specdec/rpc/v1/__init__.py"
