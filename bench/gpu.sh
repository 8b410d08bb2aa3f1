#!/usr/bin/env bash
# The `specdec bench` comparison on a CUDA machine, sized to finish in under 8 minutes, writing
# results.md, speedup.png and results.json to OUT_DIR (plus nvidia-smi.txt / cost-curve.txt).
#
#   bash bench/gpu.sh OUT_DIR [extra `specdec bench` arguments]
#
# Without CUDA it runs a tiny subset on CPU (1 prompt, 8 tokens: slow but quick), so the test
# suite exercises the script. PYTHON picks the interpreter (default: .venv/bin/python, else python3).
set -euo pipefail
out=${1:?usage: bash bench/gpu.sh OUT_DIR [extra specdec bench arguments]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-}
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
mkdir -p "$out"
cd "$root"
if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
  # v(k) on the GPU (a few seconds), then the comparison: every method, both backends, 2 prompts
  # per category x 128 tokens, stopping new prompts after 330 s so the whole script stays < 8 min.
  timeout 60 "$py" -m specdec.cli cost-curve --device cuda --ks 1-8,12,16,24,32,48,64 --repeats 10 \
    > "$out/cost-curve.txt" || echo "cost-curve failed or timed out" >> "$out/cost-curve.txt"
  timeout 420 "$py" -m specdec.cli bench --device cuda --backend hf,fast --per-category 2 --max-new-tokens 128 \
    --time-budget 330 --out "$out" "$@"
else
  echo "gpu.sh: no CUDA device: running a tiny CPU subset" >&2
  "$py" -m specdec.cli bench --device cpu --per-category 1 --categories chat --max-new-tokens 8 \
    --out "$out" "$@"
fi
echo "gpu.sh: wrote $out/results.md and $out/speedup.png" >&2
