#!/bin/sh
# The one definition of how llama.cpp (inside llama-cpp-python, built from source) is compiled:
# scripts/bootstrap.sh, scripts/build-llama-server.sh and the Dockerfile all take their CMake flags
# from here. Prints them on one line.
#
# The build must run wherever it may be reused (a venv on shared storage, a wheel cache, an image
# layer), not only on the host that compiled it, so it never uses -march=native:
#   SPECDEC_LLAMA_CPU=x86-64-v3   (default on x86-64 hosts with AVX2) AVX2, FMA, F16C, BMI2: every
#                                 x86 server CPU since 2013-2015 (Intel Haswell, AMD Excavator/Zen).
#   SPECDEC_LLAMA_CPU=x86-64-v4   adds AVX-512 F/CD/BW/DQ/VL, VBMI, VNNI, BF16 (Intel Skylake-SP and
#                                 later, AMD Zen 4 and later). Not the default: measured no faster
#                                 on the embedded Q4_1 model (README, "Set-up").
#   SPECDEC_LLAMA_CPU=generic     no SIMD extension beyond the architecture's baseline (any CPU of
#                                 the architecture; the default on non-x86 machines and on x86
#                                 hosts without AVX2).
#   SPECDEC_LLAMA_AMX=1           also compile llama.cpp's AMX kernels (x86-64-v4 only). Off by
#                                 default: a VM that advertises AMX without letting a guest run it
#                                 dies at the first batched forward (general protection fault at
#                                 ldtilecfg). Turn it on only on bare-metal Sapphire Rapids or later.
# llamafile's tinyBLAS kernels are left out (-DGGML_LLAMAFILE=OFF): they take a matmul from 2 tokens up
# (Q8_0, F16, Q4_0 ...) and round otherwise than the 1-token vec_dot, so a k-token verify gave other
# logits than a 1-token step (by up to 0.65 on the embedded target) and greedy speculative output could
# part from plain decoding at a near-tie. Without them every output element of a matmul is the same
# vec_dot whatever the width (specdec.backends.llamacpp.model: flash attention is off for the same
# reason). llama-server, the peer, is built with llama.cpp's default (scripts/build-llama-server.sh).
# Anything in SPECDEC_LLAMA_CMAKE_EXTRA is appended as it is (e.g. -DGGML_BLAS=ON).
set -eu
cpu=${SPECDEC_LLAMA_CPU:-}
amx=${SPECDEC_LLAMA_AMX:-0}
case "$(uname -m)" in
    x86_64|amd64)
        # A host without AVX2 (rare: pre-2013 servers, some emulators) could not run the default.
        if [ -z "$cpu" ] && [ -r /proc/cpuinfo ] && ! grep -qw avx2 /proc/cpuinfo; then cpu=generic; fi
        cpu=${cpu:-x86-64-v3} ;;
    *) cpu=${cpu:-generic} ;;
esac
off="-DGGML_NATIVE=OFF -DGGML_LLAMAFILE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
v3="-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
v4="$v3 -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
case "$cpu" in
    x86-64-v3) flags="$off $v3" ;;
    x86-64-v4) flags="$off $v4" ;;
    generic) flags="$off" ;;
    *) echo "llama-cmake-args: SPECDEC_LLAMA_CPU must be x86-64-v3, x86-64-v4 or generic, not '$cpu'" >&2; exit 2 ;;
esac
case "$amx" in
    0|"") ;;
    1)
        [ "$cpu" = x86-64-v4 ] || { echo "llama-cmake-args: SPECDEC_LLAMA_AMX=1 needs SPECDEC_LLAMA_CPU=x86-64-v4" >&2; exit 2; }
        flags="$(echo "$flags" | sed 's/-DGGML_AMX_\([A-Z0-9]*\)=OFF/-DGGML_AMX_\1=ON/g')" ;;
    *) echo "llama-cmake-args: SPECDEC_LLAMA_AMX must be 0 or 1, not '$amx'" >&2; exit 2 ;;
esac
# Only the libraries specdec loads: no examples, tests, tools or the multimodal library (llava/mtmd,
# which llama-cpp-python imports only for image chat formats); llama-server is built apart, on demand.
flags="$flags -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF"
echo "$flags${SPECDEC_LLAMA_CMAKE_EXTRA:+ $SPECDEC_LLAMA_CMAKE_EXTRA}"
