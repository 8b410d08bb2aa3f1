"""Which draft model the service runs.

`default_draft` is the one place that decides what runs without --draft: the draft shipped in
the package for the embedded target (specdec/assets/drafts/<target>, made by `specdec train
draft`); should the package lack it (a build without package data), an untrained early-exit
copy of the embedded target (its first 4 decoder layers plus its embeddings, final norm and
output layer), which agrees with the target on roughly 4-30% of tokens, with a warning.

--draft DIR takes a transformers model directory sharing the target's vocabulary, or a specdec
draft directory (draft.safetensors + draft_vocab.json), which borrows the embeddings of the
embedded default target.
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
               backend: str = "auto") -> CausalLM:
    """The draft on `device` at `dtype` and `backend` (specdec.models.BACKENDS; a specdec draft
    directory borrows the embedded target's embeddings, loaded there too)."""
    if backend == "llamacpp":
        raise ModelLoadError("the draft service runs its draft on torch (--backend auto, fast or hf): a target on "
                             "llama.cpp takes the same torch draft (drafts only change speed, never the output)")
    if path is None:
        return default_draft(device, dtype, backend)
    from specdec.drafts import is_draft_dir
    from specdec.drafts import load_draft as load_specdec_draft
    from specdec.models import load_model

    if is_draft_dir(Path(path)):
        target = load_model(device=device, dtype=dtype)
        return load_specdec_draft(Path(path), target.lm, target.lm.name, backend=backend)
    return load_model(path, device=device, dtype=dtype, backend=backend).lm
