"""Drafts made by specdec for a target: a few decoder layers that share the target's embeddings,
with an output layer restricted to a frequent-token subset of the vocabulary (FR-Spec style).

A draft directory holds:
- config.json            the draft's decoder config (a transformers config, few layers)
- draft.safetensors      decoder layers + final norm (no embeddings: they are the target's)
- draft_vocab.json       {"target": name, "vocab_size": V, "token_ids": [...subset...], ...recipe}

Loading attaches the target's (frozen) embedding matrix, so the draft costs a few MB on disk.
The subset head scores only |subset| rows of the target's output layer; tokens outside the
subset get logit -inf (probability 0), which rejection sampling handles exactly: the draft
simply never proposes them.

Limitation: decoders whose base model exposes `layers` and `norm` (Llama family); the
layers are transformers' own, built from the config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from specdec.backends.hf import CausalLM
from specdec.backends.subset_head import SubsetHeadLM
from specdec.errors import IncompatibleModels, ModelLoadError

SHIPPED_DRAFTS = Path(__file__).parent / "assets" / "drafts"


def build_from_target(target: CausalLM, layer_ids: list[int]) -> torch.nn.Module:
    """A fresh transformers causal LM with the target's embeddings and final norm, and copies of
    the chosen target decoder layers (in order)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layer_ids)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layer_ids]
    model = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    src = target.model.get_decoder()
    dst = model.get_decoder()
    with torch.no_grad():
        dst.norm.load_state_dict(src.norm.state_dict())
        for new, old in enumerate(layer_ids):
            dst.layers[new].load_state_dict(src.layers[old].state_dict())
    attach_target_embeddings(model, target)
    return model.eval()


def attach_target_embeddings(model: torch.nn.Module, target: CausalLM) -> None:
    """Copy the target's input embeddings and output layer into the draft (both stay frozen)."""
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(target.model.get_input_embeddings().weight)
        if not getattr(model.config, "tie_word_embeddings", False):
            model.get_output_embeddings().weight.copy_(target.model.get_output_embeddings().weight)
    model.tie_weights()


def share_target_embeddings(model: torch.nn.Module, target: CausalLM) -> None:
    """Make the draft use the target's input embeddings and output layer themselves (frozen at
    inference; no copy of the 28M-parameter table)."""
    inputs, outputs = target.embedding_tables()
    model.get_input_embeddings().weight = _frozen(inputs)
    if not getattr(model.config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = _frozen(outputs)
    model.tie_weights()


def _frozen(table: torch.Tensor) -> torch.nn.Parameter:
    """The table itself when it is a module's parameter already (shared), else wrapped once."""
    return table if isinstance(table, torch.nn.Parameter) else torch.nn.Parameter(table, requires_grad=False)


def _own_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Everything but the embeddings / tied output layer (those are the target's)."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()
            if "embed_tokens" not in k and not k.startswith("lm_head")}


def save_draft(out: Path, model: torch.nn.Module, token_ids: torch.Tensor, meta: dict,
               dtype: torch.dtype = torch.bfloat16) -> None:
    """Write a draft directory atomically-enough (each file replaced whole)."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(out / "config.json"))
    save_file({k: v.to(dtype) for k, v in _own_state(model).items()}, str(out / "draft.safetensors"))
    info = dict(meta, vocab_size=int(model.get_output_embeddings().weight.shape[0]),
                token_ids=[int(t) for t in token_ids.tolist()])
    (out / "draft_vocab.json").write_text(json.dumps(info))


def is_draft_dir(path: Path) -> bool:
    return (Path(path) / "draft_vocab.json").is_file() and (Path(path) / "draft.safetensors").is_file()


def load_draft(path: Path, target: CausalLM, target_name: Optional[str] = None, backend: str = "auto") -> CausalLM:
    """Load a specdec draft directory onto `target`'s embeddings. backend (specdec.models.BACKENDS):
    "auto" runs it on specdec's fast Llama forward where that applies (float32 on CPU), else through
    transformers (SubsetHeadLM); both score only the draft's token subset."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    path = Path(path)
    if not is_draft_dir(path):
        raise ModelLoadError(f"{path} is not a specdec draft directory (draft_vocab.json + draft.safetensors)")
    info = json.loads((path / "draft_vocab.json").read_text())
    if info["vocab_size"] != target.vocab_size:
        raise IncompatibleModels(f"draft {path} was made for a {info['vocab_size']}-token vocabulary, "
                                 f"the target has {target.vocab_size}")
    if target_name and info.get("target") and info["target"] != target_name:
        raise IncompatibleModels(f"draft {path} was trained for target {info['target']!r}, not {target_name!r}")
    config = AutoConfig.from_pretrained(path)
    with no_init_weights():  # every weight is loaded or shared below: random initialisation is wasted time
        model = AutoModelForCausalLM.from_config(config, dtype=target.dtype).to(target.device)
    state = {k: v.to(target.dtype) for k, v in load_file(str(path / "draft.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("embed_tokens" not in k and not k.startswith("lm_head") for k in missing):
        raise ModelLoadError(f"draft {path}: weights do not match its config (missing {missing}, unexpected {unexpected})")
    share_target_embeddings(model, target)
    token_ids = torch.tensor(info["token_ids"])
    from specdec.models import resolve_backend

    chosen = resolve_backend(model, backend)
    if chosen == "hf":
        return SubsetHeadLM(model.eval(), token_ids, name=path.name)
    from specdec.backends.fast import FastLlamaLM

    return FastLlamaLM(model.eval(), name=path.name, head_rows=token_ids,
                       weight_dtype=torch.bfloat16 if chosen == "fast-bf16" else None)


def draft_gguf(draft: CausalLM, cache_dir: Path, dtype: str = "f16") -> Path:
    """The torch draft (a transformers Llama-family model under specdec's interface) written as a
    GGUF file llama.cpp runs, once: kept in cache_dir under a digest of its weights. The file
    scores the whole vocabulary with the target's output layer (a subset head is torch's alone),
    so on llama.cpp the draft may also propose the rare tokens its torch form never does (a draft
    changes speed only). float16 weights: measured on 2-core x86 hosts, a step of the shipped
    3-layer draft took 2.7 ms at f16, 2.9 at Q8_0, 3.3 at Q4_1 (2 threads)."""
    import hashlib

    from specdec.backends.llamacpp.convert import write_llama_gguf

    digest = hashlib.sha256(f"{dtype}|{GGUF_FORMAT}".encode())
    for key, tensor in sorted(draft.model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    path = Path(cache_dir) / f"{draft.name}-{digest.hexdigest()[:16]}-{dtype}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # (two services converting at once: each its own)
        write_llama_gguf(draft.model, tmp, dtype=dtype, name=draft.name)
        tmp.replace(path)
    return path


GGUF_FORMAT = 1  # bumped when draft_gguf writes a draft differently (a new file then)


def shipped_draft_path(target_name: str) -> Optional[Path]:
    path = SHIPPED_DRAFTS / target_name
    return path if is_draft_dir(path) else None
