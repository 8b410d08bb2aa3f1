"""Which draft model the service runs.

`default_draft` is the one place that decides what runs without --draft: the draft shipped in
the package for the embedded target (specdec/assets/drafts/<target>, made by `specdec train
draft`); should the package lack it (a build without package data), an untrained early-exit
copy of the embedded target (its first 4 decoder layers plus its embeddings, final norm and
output layer), which agrees with the target on roughly 4-30% of tokens, with a warning.

--draft DIR takes a transformers model directory sharing the target's vocabulary, or a specdec
draft directory (draft.safetensors + draft_vocab.json), which borrows the embeddings of the
embedded default target; --draft FILE.gguf a GGUF draft for llama.cpp.

Where it runs (--backend): on a CPU, `auto` measures the draft's step on torch and on llama.cpp
(the torch draft written as a GGUF file once, in the user's cache folder) and serves the cheaper
(faster_of); `llamacpp` or `fast`/`hf` choose. A draft changes speed only, never the output.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from specdec.errors import ModelLoadError
from specdec.backends.hf import CausalLM

log = logging.getLogger("draft_service")
FALLBACK_EARLY_EXIT_LAYERS = 4


def default_draft(device: str = "cpu", dtype: torch.dtype = torch.float32, backend: str = "auto") -> CausalLM:
    from specdec.drafts import load_draft as load_specdec_draft
    from specdec.drafts import shipped_draft_path
    from specdec.models import early_exit_copy, load_model

    target = load_model(device=device, dtype=dtype)
    shipped = shipped_draft_path(target.lm.name)
    if shipped is not None:
        log.info("no --draft given: using the draft shipped for %s (%s)", target.lm.name, shipped)
        return load_specdec_draft(shipped, target.lm, target.lm.name, backend=backend)
    log.warning("no --draft given and no shipped draft found: using the UNTRAINED draft early_exit_copy(%s, %d)",
                target.lm.name, FALLBACK_EARLY_EXIT_LAYERS)
    return early_exit_copy(target.lm, FALLBACK_EARLY_EXIT_LAYERS)


def load_draft(path: Optional[str], device: str = "cpu", dtype: torch.dtype = torch.float32,
               backend: str = "auto", costs=None):
    """The draft on `device` at `dtype` and `backend` (specdec.models.BACKENDS; a specdec draft
    directory borrows the embedded target's embeddings, loaded there too). backend "llamacpp": a
    .gguf file as it is, any other draft converted to GGUF once (on_llamacpp). "auto" on a CPU:
    torch or llama.cpp, whichever measured the cheaper draft step here (faster_of; `costs`, the
    CostStore that keeps the verdict, default the user's cache folder)."""
    gguf = path is not None and path.endswith(".gguf")
    if backend == "llamacpp" or (gguf and backend == "auto"):
        if device != "cpu":
            raise ModelLoadError("a draft on llama.cpp runs on the CPU here (--device cpu)")
        if gguf:
            from specdec.models import load_gguf_model

            return load_gguf_model(path).lm
        return on_llamacpp(_load_torch_draft(path, "cpu", torch.float32, "hf"))
    if gguf:
        raise ModelLoadError(f"{path} is a GGUF file: serve it with --backend llamacpp")
    draft = _load_torch_draft(path, device, dtype, backend)
    if backend == "auto" and device == "cpu" and dtype == torch.float32:
        return faster_of(draft, costs)
    return draft


def _load_torch_draft(path: Optional[str], device: str, dtype: torch.dtype, backend: str) -> CausalLM:
    if path is None:
        return default_draft(device, dtype, backend)
    from specdec.drafts import is_draft_dir
    from specdec.drafts import load_draft as load_specdec_draft
    from specdec.models import load_model

    if is_draft_dir(Path(path)):
        target = load_model(device=device, dtype=dtype)
        return load_specdec_draft(Path(path), target.lm, target.lm.name, backend=backend)
    return load_model(path, device=device, dtype=dtype, backend=backend).lm


def on_llamacpp(draft: CausalLM):
    """A torch draft moved onto llama.cpp: written as a GGUF file once (specdec.drafts.draft_gguf,
    in the user's cache folder) and loaded after llama.cpp's probe on this machine (a build that
    crashes or computes other tokens than the torch draft is refused, not run)."""
    from specdec.backends.hf import CausalLM as PlainLM
    from specdec.backends.llamacpp import LlamaCppLM
    from specdec.backends.llamacpp.probe import require_usable, torch_reference
    from specdec.drafts import draft_gguf
    from specdec.models import user_cache_dir, user_cost_store

    path = draft_gguf(draft, user_cache_dir() / "drafts-gguf")
    # the probe's reference: the same weights scoring the whole vocabulary, as the file does
    require_usable(path, user_cost_store(), torch_reference(PlainLM(draft.model, name=draft.name)))
    log.info("draft %s on llama.cpp from %s", draft.name, path)
    return LlamaCppLM(path, name=f"{draft.name}-gguf")


def faster_of(draft: CausalLM, costs=None):
    """The draft on torch or on llama.cpp, whichever takes the shorter 1-token step on this
    machine (measured once per machine, draft and thread count, kept in `costs`; a llama.cpp
    that cannot run here, its probe says so, leaves it on torch). Measured on the 2-core x86
    hosts, 2 threads: the shipped draft's step took 3.3 ms on torch (specdec's fast path, an
    8,192-row head) and 2.7 ms on llama.cpp (f16, the whole vocabulary), against 8.6-9.6 ms for
    the Q4_1 target's."""
    from specdec.costmodel import machine_identity, measure_forward_times
    from specdec.models import user_cost_store

    costs = costs if costs is not None else user_cost_store()

    def step_s(lm) -> float:
        return measure_forward_times(lm, ks=(1,), context_len=64, repeats=15, warmup=3)[1]

    moved: dict[str, object] = {}

    def measure() -> str:
        try:
            moved["lm"] = on_llamacpp(draft)
        except ModelLoadError as exc:
            log.warning("the draft stays on torch: llama.cpp cannot run it here (%s)", exc)
            return "torch"
        torch_s, llamacpp_s = step_s(draft), step_s(moved["lm"])
        log.info("draft step: %.2f ms on torch, %.2f ms on llama.cpp", torch_s * 1000, llamacpp_s * 1000)
        return "llamacpp" if llamacpp_s < torch_s else "torch"

    key = {"figure": "draft_backend", "machine": machine_identity(draft.device), "draft": draft.cost_identity(),
           "threads": torch.get_num_threads()}
    chosen = costs.figure(key, f"the draft {draft.name}'s step on torch and on llama.cpp", measure)
    if chosen != "llamacpp":
        return draft
    try:
        return moved.get("lm") or on_llamacpp(draft)
    except ModelLoadError as exc:  # (a verdict kept from a llama.cpp build that has changed since)
        log.warning("the draft stays on torch: llama.cpp cannot run it here (%s)", exc)
        return draft
