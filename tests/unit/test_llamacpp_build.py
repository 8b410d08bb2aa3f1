"""llama.cpp is built to run where it is reused, not only where it was compiled: one definition of
its CMake flags (scripts/llama-cmake-args.sh) for the set-up and the image, never -march=native,
AMX only on request; and the installed library holds no AMX tile instruction unless the user
asked for it (a VM that advertises AMX but cannot run it dies at `ldtilecfg`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.backends.llamacpp.build import library_files

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ROOT / "scripts" / "llama-cmake-args.sh"
TILE = re.compile(r"\s(ldtilecfg|sttilecfg|tileloadd\w*|tilestored|tilerelease|tilezero|tdpb[a-z0-9]+|tdpfp16ps)\b")


def _flags(**env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_LLAMA_")}
    return subprocess.run(["sh", str(FLAGS)], env={**clean, **env}, capture_output=True, text=True)


def _installed_flags() -> str:
    """The flags scripts/bootstrap.sh recorded for the installed build ("" if installed otherwise)."""
    record = Path(sys.prefix) / "llama-cpp-build"
    lines = record.read_text().splitlines() if record.is_file() else []
    return lines[1] if len(lines) > 1 else ""


def test_the_default_flags_are_portable_and_leave_amx_out():
    out = _flags()
    assert out.returncode == 0, out.stderr
    flags = out.stdout.split()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_NATIVE=ON" not in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert not any(f.startswith("-DGGML_AVX512") for f in flags)  # AVX-512 only when asked (x86-64-v4)
    assert "-DGGML_LLAMAFILE=OFF" in flags  # its kernels round by a forward's width (docs/backends.md)


def test_amx_is_compiled_only_on_request_and_only_with_avx512():
    asked = _flags(SPECDEC_LLAMA_CPU="x86-64-v4", SPECDEC_LLAMA_AMX="1").stdout.split()
    assert {"-DGGML_AMX_TILE=ON", "-DGGML_AMX_INT8=ON", "-DGGML_AVX512=ON"} <= set(asked)
    refused = _flags(SPECDEC_LLAMA_AMX="1")
    assert refused.returncode == 2 and "x86-64-v4" in refused.stderr
    bad = _flags(SPECDEC_LLAMA_CPU="native")
    assert bad.returncode == 2 and "SPECDEC_LLAMA_CPU" in bad.stderr


def test_the_setup_and_the_image_take_their_flags_from_the_one_definition():
    def code(path: Path) -> str:  # without comment lines (which may say what is never done)
        return "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))

    bootstrap, dockerfile = code(ROOT / "scripts" / "bootstrap.sh"), code(ROOT / "Dockerfile")
    assert "scripts/llama-cmake-args.sh" in bootstrap and "scripts/llama-cmake-args.sh" in dockerfile
    for text in (bootstrap, dockerfile):
        assert "GGML_NATIVE=ON" not in text and "-march=native" not in text
        assert not re.search(r"CMAKE_ARGS=[\"']?-D", text)  # no second list of flags


def test_the_installed_llamacpp_holds_no_amx_tile_instruction_unless_asked_for():
    libs = library_files()
    assert libs, "llama-cpp-python is not installed: run scripts/bootstrap.sh"
    objdump = shutil.which("objdump")
    assert objdump, "binutils' objdump is missing (the compiler that built llama.cpp needs binutils too)"
    found = {}
    for path in libs:
        text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                              check=True).stdout
        hits = sorted({m.group(1) for m in TILE.finditer(text)})
        if hits:
            found[path.name] = hits
    if "-DGGML_AMX_TILE=ON" in _installed_flags().split():
        assert found, "built with AMX on request, yet no tile instruction was found"
    else:
        assert not found, f"AMX tile instructions in a build that did not ask for them: {found}"


@pytest.mark.parametrize("text,hits", [
    ("  4a: \tldtilecfg (%rax)\n", {"ldtilecfg"}),
    ("  4a: \ttdpbssd %tmm2,%tmm1,%tmm0\n  50: \ttileloadd (%rsi,%rdx,1),%tmm1\n", {"tdpbssd", "tileloadd"}),
    ("  4a: \tvpdpbusd %zmm1,%zmm2,%zmm3\n  50: \tcall <tile_size>\n", set()),  # VNNI and a symbol, not AMX
])
def test_the_tile_pattern_finds_amx_instructions_and_nothing_else(text, hits):
    assert {m.group(1) for m in TILE.finditer(text)} == hits
