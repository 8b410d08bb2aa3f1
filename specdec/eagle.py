"""EAGLE drafts (Li et al. 2024): a draft that predicts the target's next *feature*.

The target's features are its last-layer hidden states after the final norm (what
`CausalLM.forward(..., want_hidden=True)` returns), f_i at position i, from which the target's
output layer gives the logits of token i + 1. The draft reads the pair (f_i, t_{i+1}) at
position i, i.e. a feature and the token the target chose from it:

    x_i = fc(concat[f_i ; embed(t_{i+1})])          fc: 2H -> H (with bias, as EAGLE)
    f^_{i+1} = decoder_layer(x_i | pairs 0..i)       one Llama decoder layer, causal, RoPE at i
    logits(t_{i+2}) = head(f^_{i+1})                 the target's output rows of a token subset

The decoder layer is transformers' own `LlamaDecoderLayer` (and `LlamaRotaryEmbedding`), built
from the target's config with one layer; the draft keeps its own KV cache of pairs
(specdec.backends.kv_cache.KVCache: a validity mask, so rolling back is marking slots invalid). Drafting
k tokens after the committed t_0..t_{L-1} (features f_0..f_{L-2} known): feed the pairs up to
(f_{L-2}, t_{L-1}), which gives f^_{L-1} and the first token d_1; then feed (f^_{L-1}, d_1) ->
f^_L -> d_2, and so on: where the true feature is not known yet, the draft's own prediction
stands in for it (specdec.proposers.eagle does this bookkeeping).

The output layer is restricted to a frequent-token subset (FR-Spec, as specdec.drafts): tokens
outside it get logit -inf, so they are never drafted, which rejection sampling handles exactly.

An EAGLE directory holds:
- config.json        the draft layer's transformers config (the target's, one layer)
- eagle.safetensors  fc + the decoder layer (no embeddings, no output layer: the target's)
- eagle_vocab.json   {"target": name, "vocab_size": V, "hidden_size": H, "token_ids": [...], recipe...}

Loading attaches the target's (frozen) input embeddings and the subset's rows of its output
layer, and refuses a directory made for another target (IncompatibleModels).

Limitations: Llama-family targets only (the layer is LlamaDecoderLayer; a target whose config
is not model_type "llama" is refused); the output layer is taken without a bias.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdec.errors import IncompatibleModels, ModelLoadError
from specdec.backends.kv_cache import KVCache
from specdec.backends.hf import attention_inputs, scatter_subset_logits

SHIPPED_EAGLE = Path(__file__).parent / "assets" / "eagle"
CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE = "config.json", "eagle.safetensors", "eagle_vocab.json"


def eagle_config(target_config):
    """The draft layer's config: a copy of the target's with one decoder layer."""
    if getattr(target_config, "model_type", None) != "llama":
        raise ModelLoadError(f"EAGLE drafts are built from Llama decoder layers; the target is "
                             f"{getattr(target_config, 'model_type', None)!r}")
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    return config


class EagleDraft(torch.nn.Module):
    """fc + one decoder layer over (feature, next token) pairs, and the subset head.

    embed [vocab, H]: the target's input embeddings; head [subset, H]: the target's output rows
    of token_ids [subset]. All three are frozen buffers, never saved (they are the target's)."""

    def __init__(self, config, embed: torch.Tensor, head: torch.Tensor, token_ids: torch.Tensor):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        hidden = int(config.hidden_size)
        if embed.shape[1] != hidden or head.shape[1] != hidden:
            raise IncompatibleModels(f"the EAGLE layer is {hidden} wide, the target's embeddings "
                                     f"{embed.shape[1]}")
        self.config = config
        self.vocab_size = int(embed.shape[0])
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("embed", embed.detach(), persistent=False)  # [vocab, H]
        self.register_buffer("head", head.detach(), persistent=False)  # [subset, H]
        self.register_buffer("token_ids", token_ids.long(), persistent=False)  # [subset]

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor, cache=None) -> torch.Tensor:
        """features [B, q, H] (f_i), input_ids [B, q] (t_{i+1}), mask [B, 1, q, kv] additive (kv:
        the cache's slots + q), positions [B, q] (i); cache: a transformers Cache the layer's keys
        and values are appended to (None: q is all there is) -> predicted features [B, q, H]."""
        x = self.fc(torch.cat([features.to(self.dtype), F.embedding(input_ids, self.embed)], dim=-1))  # [B, q, H]
        cos_sin = self.rotary(x, positions)
        return self.layer(x, attention_mask=mask, position_ids=positions, cache=cache,
                          use_cache=cache is not None, position_embeddings=cos_sin)

    def subset_logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., H] -> logits over the subset [..., subset]."""
        return features @ self.head.T

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., H] -> full-vocabulary logits [..., vocab], -inf outside the subset."""
        return scatter_subset_logits(self.subset_logits(features), self.token_ids, self.vocab_size)

    # --- inference on a KV cache of pairs ---------------------------------------------------

    def new_cache(self, batch_size: int) -> KVCache:
        return KVCache(batch_size, self.device, config=self.config)

    @torch.inference_mode()
    def extend(self, cache: KVCache, features: torch.Tensor, input_ids: torch.Tensor,
               input_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append q pairs per row to the cache (causal among themselves, after each row's valid
        slots; input_valid [B, q] False for right padding, whose slots stay invalid):
        features [B, q, H], input_ids [B, q] -> predicted features [B, q, H]."""
        mask, positions = attention_inputs(cache, tuple(input_ids.shape), None, None, input_valid, self.dtype,
                                           self.device)
        out = self.forward(features.to(self.device), input_ids.to(self.device), mask, positions, cache.hf)
        cache.appended(input_valid if input_valid is not None else torch.ones_like(input_ids, dtype=torch.bool))
        return out


def build_eagle(target, token_ids: torch.Tensor) -> EagleDraft:
    """A fresh (untrained) draft for `target` (a CausalLM with a transformers config), drafting
    token_ids [subset], in the target's dtype and on its device."""
    embed, out = target.embedding_tables()
    draft = EagleDraft(eagle_config(target.config), embed, out.detach()[token_ids.to(out.device)], token_ids)
    return draft.to(device=embed.device, dtype=embed.dtype).eval()


def save_eagle(out: Path, draft: EagleDraft, meta: dict, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write an EAGLE directory (each file replaced whole). meta: {"target": name, "recipe": ...}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    draft.config.to_json_file(str(out / CONFIG_FILE))
    weights = {k: v.detach().to(dtype).contiguous() for k, v in draft.state_dict().items()}
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(weights, str(tmp))
    tmp.replace(out / WEIGHTS_FILE)
    info = dict(meta, vocab_size=draft.vocab_size, hidden_size=int(draft.config.hidden_size),
                token_ids=[int(t) for t in draft.token_ids.tolist()])
    tmp = out / (VOCAB_FILE + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(out / VOCAB_FILE)


def is_eagle_dir(path: Path) -> bool:
    return all((Path(path) / f).is_file() for f in (CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE))


def load_eagle(path: Path, target, target_name: Optional[str] = None) -> EagleDraft:
    """Load an EAGLE directory onto `target` (any backend: it needs the target's embedding
    tables only), in the target's dtype and on its device. target_name (default target.name)
    must be the one the draft was trained for."""
    from transformers import AutoConfig

    path = Path(path)
    if not is_eagle_dir(path):
        raise ModelLoadError(f"{path} is not an EAGLE draft directory ({CONFIG_FILE}, {WEIGHTS_FILE}, {VOCAB_FILE})")
    info = json.loads((path / VOCAB_FILE).read_text())
    name = target_name or target.name
    if info.get("target") != name:
        raise IncompatibleModels(f"EAGLE draft {path} was trained for target {info.get('target')!r}, not {name!r}")
    embed, out = target.embedding_tables()
    if info["vocab_size"] != embed.shape[0] or info["hidden_size"] != embed.shape[1]:
        raise IncompatibleModels(f"EAGLE draft {path} was made for a {info['vocab_size']} x {info['hidden_size']} "
                                 f"embedding table, the target's is {embed.shape[0]} x {embed.shape[1]}")
    config = AutoConfig.from_pretrained(path, attn_implementation="sdpa")
    token_ids = torch.tensor(info["token_ids"], dtype=torch.long)
    draft = EagleDraft(eagle_config(config), embed, out.detach()[token_ids.to(out.device)], token_ids)
    state = load_file(str(path / WEIGHTS_FILE))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"EAGLE draft {path}: weights do not match its config "
                             f"(missing {missing}, unexpected {unexpected})")
    return draft.to(device=embed.device, dtype=embed.dtype).eval()


def shipped_eagle_path(target_name: str) -> Optional[Path]:
    path = SHIPPED_EAGLE / target_name
    return path if is_eagle_dir(path) else None


@torch.inference_mode()
def step_cost(draft: EagleDraft, target, context_len: int = 64, repeats: int = 7) -> float:
    """c for EAGLE: the median time of one drafting step (one pair appended to a cache of
    context_len pairs, then the next token's logits) over that of a 1-token target forward
    against context_len tokens (costmodel.measure_forward_times' one-token figure)."""
    from specdec.costmodel import measure_forward_times

    gen = torch.Generator().manual_seed(0)
    cache = draft.new_cache(1)
    hidden = draft.head.shape[1]
    draft.extend(cache, torch.randn(1, context_len, hidden, generator=gen).to(draft.dtype),
                 torch.randint(0, draft.vocab_size, (1, context_len), generator=gen))
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        f = draft.extend(cache, torch.randn(1, 1, hidden, generator=gen).to(draft.dtype), torch.tensor([[7]]))
        draft.logits(f[:, 0]).argmax(-1).item()
        times.append(time.perf_counter() - t0)
        cache.truncate(torch.tensor([context_len]))
    t_draft = sorted(times[2:])[repeats // 2]
    t_target = measure_forward_times(target, ks=(1,), context_len=context_len, repeats=repeats, warmup=2)[1]
    return t_draft / t_target
