"""Which llama.cpp build is installed, and on which CPU features it runs: what a figure measured
on llama.cpp (its probe verdict, its costs) depends on besides the model. Read without loading
llama.cpp (the package is located, never imported)."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import platform
from pathlib import Path
from typing import Optional


def lib_dir() -> Optional[Path]:
    spec = importlib.util.find_spec("llama_cpp")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


@functools.lru_cache(maxsize=8)
def _digest_libs(files: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, _, _ in files:
        h.update(Path(name).name.encode())
        h.update(Path(name).read_bytes())
    return h.hexdigest()[:16]


def library_files() -> list[Path]:
    """The installed llama.cpp shared libraries (the files, not their version symlinks)."""
    lib = lib_dir()
    if lib is None or not lib.is_dir():
        return []
    return sorted(p for p in lib.glob("*.so*") if p.is_file() and not p.is_symlink())


def build_identity() -> str:
    """A digest of the installed llama.cpp shared libraries ("none" without llama-cpp-python):
    another build (other flags, another compiler, another machine's wheel) has another one."""
    files = library_files()
    if not files:
        return "none"
    return _digest_libs(tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def cpu_features() -> str:
    """A digest of the CPU's feature flags (/proc/cpuinfo): two VMs of one processor model can
    expose different features."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return hashlib.sha256(" ".join(sorted(line.split(":", 1)[1].split())).encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.machine()
