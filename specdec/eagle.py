"""EAGLE drafts (Li et al. 2024): a draft that predicts the target's next *feature*.

The target's features are its last-layer hidden states after the final norm (what
`CausalLM.forward(..., want_hidden=True)` returns), f_i at position i, from which the target's
output layer gives the logits of token i + 1. The draft reads the pair (f_i, t_{i+1}) at
position i, i.e. a feature and the token the target chose from it:

    x_i = fc(concat[f_i ; embed(t_{i+1})])          fc: 2H -> H (with bias, as EAGLE)
    f^_{i+1} = decoder_layer(x_i | pairs 0..i)       one Llama decoder layer, causal, RoPE at i
    logits(t_{i+2}) = head(f^_{i+1})                 the target's output rows of a token subset

A draft made with `previous_token` reads the token before each pair's too: x_i = fc(concat[f_i ;
embed(t_{i+1}) ; embed(t_i)]) (fc: 3H -> H). One attention layer can then copy from the context:
the last pair holds t_{L-1} as its previous token, an earlier pair j holds t_j beside t_{j+1}, so
one head matching the two reads the continuation that followed t_{L-1} before (an induction
head needs two layers where the pair holds one token). Measured first on the shipped draft,
which lacks it: on a summarization prompt whose answer copies phrases of the article, it
predicted 8% of the answer's tokens (teacher-forced, depth 1), prompt lookup's chains took
2 tokens a step. A draft without it widens to one with it unchanged (`widen_fc`: the new
columns start at zero), so training goes on from its weights.

A draft made with `tap_layers` (EAGLE-3's fusion of low, middle and high layers) reads the
target's residual stream after those decoder layers too, each RMS-normalized without weights
(their scales differ by orders of magnitude): x_i = fc(concat[f_i ; embed(t_{i+1}) (; embed(t_i))
; r_i^(a) ; r_i^(b) ...]). The last layer's feature says what comes next; the earlier layers keep
more of the context it was computed from, which the feature after the final norm is tuned away
from. A drafted pair has no residuals (the target has not run there): it reads zeros, as
training's unrolled steps do. Only a target that returns them (`returns_taps`: the fast backend;
not llama.cpp) can run such a draft. `widen_fc` adds their columns at zero to a draft without
them, so training starts from what that draft computes.

A draft made with `copy_token` reads each pair's copy candidate too (specdec.copy_tokens: the
token that followed the latest earlier occurrence of the context's last n-gram, n <= 3, what
prompt lookup would draft; zeros where there is none): x_i = fc(concat[... ; embed(c_i)]), its
columns last. Prompt lookup is right where this one layer is weakest (copying names, phrases
and German words from a prompt), and the target's feature says when the answer copies: the
draft learns when to follow the candidate. Measured before building it (4 dev prompts per
category, the target's greedy answers, depth 1): the draft of runs/s7 right on 0.33 of the
tokens, the candidate on 0.31, one of the two on 0.50 (of the subset's tokens). Drafting
computes each drafted pair's candidate over the committed tokens and the path drafted before
it (a chain's or a tree node's), as training computes it over the true tokens. `widen_fc` adds
its columns at zero to a draft without them.

The decoder layer is transformers' own `LlamaDecoderLayer` (and `LlamaRotaryEmbedding`), built
from the target's config with one layer: training runs it. Drafting (`extend`, `logits`) runs the
same weights through the fast backend's compact layer (specdec.backends.fast.decoder_layer: fused
q/k/v and gate/up, the row-count matmul choice) on a pre-allocated cache of pairs
(FastKVCache: a validity mask, so rolling back is marking slots invalid), in float16 weights
for a float32 draft (DRAFTING_DTYPE; float32 drafting agrees with the transformers layer to float
rounding). Measured (1 thread, quiet, the shipped draft, a cache of 64 pairs, `step_cost` against
the llama.cpp target, three runs each): one drafting step 3.1 + 2.1 ms (layer + head; c
0.33-0.41) through transformers' layer, 2.2-2.8 + 1.5-1.9 (c 0.18-0.35) through the compact one,
1.2-1.6 + 0.75-1.1 (c 0.14-0.18) with float16 weights. A greedy chain's step then scores
the draftable tokens only (`scores`: no scatter over the vocabulary, no softmax over it), and a
one-input mask skips the general path: step_cost 0.167 / 0.211 / 0.258 -> 0.154 / 0.156 / 0.168
(1 thread; at 2 threads 0.170 / 0.170 / 0.186 -> 0.163 / 0.186 / 0.206, within the noise). What
is left is matmuls (64% of a step, profiled: ~20 MB of float16 weights read, half of it the head;
int8 weights through torch's int8pack kernel ran 8x slower here). Drafting
k tokens after the committed t_0..t_{L-1} (features f_0..f_{L-2} known): feed the pairs up to
(f_{L-2}, t_{L-1}), which gives f^_{L-1} and the first token d_1; then feed (f^_{L-1}, d_1) ->
f^_L -> d_2, and so on: where the true feature is not known yet, the draft's own prediction
stands in for it (specdec.proposers.eagle does this bookkeeping).

The output layer is restricted to a frequent-token subset (FR-Spec, as specdec.drafts): tokens
outside it get logit -inf, so they are never drafted, which rejection sampling handles exactly.
That subset misses what answers copy from their prompts: on the dev prompts (4 per category,
the target's greedy answers) 13-15% of the answer tokens in chat, qa, rag, summarization and
translation are outside the 8,192-token subset (names, rare words), and 7.4% of all (14% in
summarization, 13% in translation) are outside it but already in the context. A draft trained
with `context_vocab` drafts those too: per row, the tokens of its committed context outside the
subset join the subset, scored by the target's own output rows (ContextTokens); training counts
a label outside the subset where its row's context holds it (specdec.training.eagle). A draft
trained without it gains nothing from them (its features never favour such a token: alpha
0.324 -> 0.325 with them), so it drafts its subset only.

An EAGLE directory holds:
- config.json        the draft layer's transformers config (the target's, one layer)
- eagle.safetensors  fc + the decoder layer (no embeddings, no output layer: the target's)
- eagle_vocab.json   {"target": name, "vocab_size": V, "hidden_size": H, "token_ids": [...], "previous_token",
                     "context_vocab", "tap_layers", "copy_token", recipe...}

Loading attaches the target's (frozen) input embeddings and the subset's rows of its output
layer, and refuses a directory made for another target (IncompatibleModels).

Limitations: Llama-family targets only (the layer is LlamaDecoderLayer; a target whose config
is not model_type "llama" is refused); the output layer is taken without a bias.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdec.errors import IncompatibleModels, ModelLoadError
from specdec.backends.fast import FastKVCache, LayerShape, RopeTable, copy_layer, decoder_layer, linear_rows
from specdec.backends.hf import attention_inputs

SHIPPED_EAGLE = Path(__file__).parent / "assets" / "eagle"
CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE = "config.json", "eagle.safetensors", "eagle_vocab.json"
TAP_NORM_EPS = 1e-6


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


@dataclass(frozen=True)
class ContextTokens:
    """A context_vocab draft's draftable tokens beyond its subset, per row: those of the row's
    context outside the subset (EagleDraft.context_tokens)."""

    ids: torch.Tensor  # [B, C] long; -1 pads a row with fewer
    rows: torch.Tensor  # [B, C, H] the target's output rows of ids (zeros at pads)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, ..., H] -> their logits [B, ..., C] (-inf at pads)."""
        batch, hidden = features.shape[0], features.shape[-1]
        flat = features.reshape(batch, -1, hidden).to(self.rows.dtype) @ self.rows.transpose(1, 2)  # [B, n, C]
        flat = flat.to(features.dtype).masked_fill(self.ids[:, None, :] < 0, float("-inf"))
        return flat.view(*features.shape[:-1], self.ids.shape[1])


@dataclass(frozen=True)
class _DraftingWeights:
    key: tuple  # the parameters' identities and versions these were made from
    layer: object  # specdec.backends.fast._Layer
    fc_weight: torch.Tensor
    fc_bias: torch.Tensor
    head: torch.Tensor
    rope: RopeTable


class EagleDraft(torch.nn.Module):
    """fc + one decoder layer over (feature, next token[, previous token]) pairs, and the subset head.

    embed [vocab, H]: the target's input embeddings; head [subset, H]: the target's output rows
    of token_ids [subset]. All three are frozen buffers, never saved (they are the target's)."""

    def __init__(self, config, embed: torch.Tensor, head: torch.Tensor, token_ids: torch.Tensor,
                 drafting_dtype: Optional[torch.dtype] = None, previous_token: bool = False,
                 output: Optional[torch.Tensor] = None, context_vocab: bool = False,
                 tap_layers: Sequence[int] = (), copy_token: bool = False):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        hidden = int(config.hidden_size)
        if embed.shape[1] != hidden or head.shape[1] != hidden:
            raise IncompatibleModels(f"the EAGLE layer is {hidden} wide, the target's embeddings "
                                     f"{embed.shape[1]}")
        self.config = config
        self.vocab_size = int(embed.shape[0])
        self.previous_token = previous_token  # pairs read the token before theirs too
        self.tap_layers = tuple(int(i) for i in tap_layers)  # pairs read these target layers' residuals too
        self.copy_token = copy_token  # pairs read their copy candidate too (specdec.copy_tokens)
        self.fc = torch.nn.Linear(fc_inputs(previous_token, len(self.tap_layers), copy_token) * hidden, hidden,
                                  bias=True)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("embed", embed.detach(), persistent=False)  # [vocab, H]
        self.register_buffer("head", head.detach(), persistent=False)  # [subset, H]
        self.register_buffer("token_ids", token_ids.long(), persistent=False)  # [subset]
        # The target's whole output layer [vocab, H], held by a context_vocab or copy_token draft
        # only (what it scores the context's tokens, or the copy candidate, outside the subset
        # with; another holds the subset's rows).
        self.register_buffer("output", None if output is None else output.detach(), persistent=False)
        self.context_vocab = context_vocab
        in_subset = torch.zeros(self.vocab_size, dtype=torch.bool, device=token_ids.device)
        in_subset[token_ids] = True
        self.register_buffer("in_subset", in_subset, persistent=False)  # [vocab]
        if (context_vocab or copy_token) and output is None:
            raise ValueError("a context_vocab or copy_token draft needs the target's output layer (output=)")
        self.shape = LayerShape(config)
        self.drafting_dtype = drafting_dtype
        self._drafting: Optional[_DraftingWeights] = None  # made from the parameters on demand (drafting())
        # The Parameter objects stay for the module's life (loading, optimizer steps and .to() change
        # their data, not the objects), so drafting() checks this list rather than walk the modules.
        self._params = list(self.parameters())

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def token_inputs(self, input_ids: torch.Tensor, previous_ids: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """The embeddings a pair reads beside its feature: t_{i+1}'s, and t_i's for a previous_token draft."""
        parts = [F.embedding(input_ids.to(self.embed.device), self.embed)]
        if self.previous_token:
            if previous_ids is None:
                raise ValueError("this EAGLE draft reads the token before each pair's too: give previous_ids")
            parts.append(F.embedding(previous_ids.to(self.embed.device), self.embed))
        return parts

    def tap_inputs(self, features: torch.Tensor, taps: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """What a tap_layers draft reads of the target's residuals at each pair: each layer's
        [B, q, H] chunk of taps [B, q, n * H] RMS-normalized (no weights: the layers' scales
        differ by orders of magnitude); zeros where taps is None (drafted pairs, whose residuals
        the target has not computed)."""
        if not self.tap_layers:
            return []
        hidden = features.shape[-1]
        if taps is None:
            return [features.new_zeros(*features.shape[:-1], hidden * len(self.tap_layers)).to(self.dtype)]
        chunks = taps.to(self.device, self.dtype).split(hidden, dim=-1)
        return [F.rms_norm(c, (hidden,), eps=TAP_NORM_EPS) for c in chunks]

    def copy_inputs(self, copy_ids: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """What a copy_token draft reads of each pair's copy candidate (copy_ids [B, q], the token
        after the latest earlier occurrence of the context's last n-gram; -1: none): its
        embedding, zeros where there is none."""
        if not self.copy_token:
            return []
        if copy_ids is None:
            raise ValueError("this EAGLE draft reads each pair's copy candidate too: give copy_ids "
                             "(specdec.copy_tokens)")
        copy_ids = copy_ids.to(self.embed.device)
        return [F.embedding(copy_ids.clamp_min(0), self.embed) * (copy_ids >= 0)[..., None].to(self.embed.dtype)]

    def pair_inputs(self, features: torch.Tensor, input_ids: torch.Tensor, previous_ids: Optional[torch.Tensor],
                    taps: Optional[torch.Tensor], copy_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fc's input at each pair: [f_i ; embed(t_{i+1}) (; embed(t_i)) (; taps) (; embed(copy_i))]."""
        return torch.cat([features.to(self.device, self.dtype), *self.token_inputs(input_ids, previous_ids),
                          *self.tap_inputs(features, taps), *self.copy_inputs(copy_ids)], dim=-1)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor, cache=None, previous_ids: Optional[torch.Tensor] = None,
                taps: Optional[torch.Tensor] = None, copy_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """features [B, q, H] (f_i), input_ids [B, q] (t_{i+1}), mask [B, 1, q, kv] additive (kv:
        the cache's slots + q), positions [B, q] (i); cache: a transformers Cache the layer's keys
        and values are appended to (None: q is all there is); previous_ids [B, q] (t_i; a
        previous_token draft's); taps [B, q, n * H] (a tap_layers draft's; None: unknown);
        copy_ids [B, q] (a copy_token draft's: each pair's copy candidate, -1 none)
        -> predicted features [B, q, H]."""
        x = self.fc(self.pair_inputs(features, input_ids, previous_ids, taps, copy_ids))
        cos_sin = self.rotary(x, positions)
        return self.layer(x, attention_mask=mask, position_ids=positions, cache=cache,
                          use_cache=cache is not None, position_embeddings=cos_sin)

    def subset_logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., H] -> logits over the subset [..., subset]."""
        return features @ self.head.T

    def copy_logits(self, features: torch.Tensor, copies: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy_token draft's copy candidates as drafted tokens beside its subset: features
        [..., H], copies [...] (the candidate for the token each feature predicts, NONE where
        none) -> (ids [..., 1], -1 where none or inside the subset (it has its logit there);
        logits [..., 1] by the target's output row, -inf at -1)."""
        copies = copies.to(self.in_subset.device).long()
        ids = copies.masked_fill((copies < 0) | self.in_subset[copies.clamp_min(0)], -1)
        rows = self.output[ids.clamp_min(0)]  # [..., H]
        score = (features.float() * rows.to(features.device).float()).sum(-1, keepdim=True)
        return ids[..., None], score.masked_fill(ids[..., None] < 0, float("-inf"))

    @torch.inference_mode()
    def scores(self, features: torch.Tensor, extra: Optional[ContextTokens] = None,
               copies: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafting: features [..., H] -> (ids [..., m], logits [..., m] float32): the tokens the
        draft can draft there and their logits, every other token's probability being 0. They are
        the subset's, then extra's tokens (for features [B, ..., H]) or else the copy candidates
        `copies` [...] of a copy_token draft (its context's tokens hold them); an id -1 (a pad, no
        candidate) has logit -inf. A chain's greedy step needs no more than these (an argmax over
        m = 8,193 rather than the vocabulary's 49,152); `logits` spreads them over the vocabulary."""
        sub = linear_rows(features, self.drafting().head).float()
        ids = self.token_ids.expand(*sub.shape[:-1], -1)
        if copies is not None and extra is None:
            copy_ids, copy_score = self.copy_logits(features, copies)
            return torch.cat([ids, copy_ids], dim=-1), torch.cat([sub, copy_score], dim=-1)
        if extra is None or extra.ids.shape[1] == 0:
            return ids, sub
        shape = (extra.ids.shape[0], *([1] * (features.dim() - 2)), extra.ids.shape[1])
        extra_ids = extra.ids.view(shape).expand(*features.shape[:-1], -1)
        return torch.cat([ids, extra_ids], dim=-1), torch.cat([sub, extra.logits(features).float()], dim=-1)

    @torch.inference_mode()
    def logits(self, features: torch.Tensor, extra: Optional[ContextTokens] = None,
               copies: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Drafting: features [..., H] -> full-vocabulary logits [..., vocab] (float32), -inf outside
        what `scores` drafts."""
        ids, scores = self.scores(features, extra, copies)
        full = scores.new_full((*scores.shape[:-1], self.vocab_size + 1), float("-inf"))
        # the last column takes the -1 ids' scores, then goes
        return full.scatter_(-1, ids.masked_fill(ids < 0, self.vocab_size), scores)[..., : self.vocab_size]

    def context_tokens(self, contexts) -> Optional[ContextTokens]:
        """The tokens a context_vocab draft drafts beside its subset: per row, its context's
        (contexts: B token sequences) outside the subset, in token order; None for a draft
        trained without them (measured: such a draft's features do not pick them, alpha on the
        dev prompts 0.324 -> 0.325, so it drafts its subset only)."""
        if not self.context_vocab:
            return None
        found = []
        for ctx in contexts:
            ids = torch.unique(torch.as_tensor(list(ctx), dtype=torch.long, device=self.token_ids.device))
            found.append(ids[~self.in_subset[ids]])
        width = max((len(f) for f in found), default=0)
        ids = torch.full((len(found), width), -1, dtype=torch.long, device=self.token_ids.device)
        for b, f in enumerate(found):
            ids[b, : len(f)] = f
        rows = self.output[ids.clamp_min(0)].to(self.dtype) * (ids >= 0)[..., None]
        return ContextTokens(ids, rows)

    # --- drafting on a KV cache of pairs ----------------------------------------------------

    def cost_identity(self) -> dict:
        """What a drafting step's cost depends on besides the machine and the target (the key of
        its measured c in the cost store): how drafting runs, in which dtype, and the shapes a
        step's cost grows with (the fc's inputs, the subset head's rows), so that another draft
        in the same directory (a newer shipped one, one widened by --init) is measured anew."""
        return {"impl": "fast.decoder_layer", "dtype": str(self.drafting_dtype or self.dtype),
                "fc_inputs": int(self.fc.in_features), "head_rows": int(self.token_ids.numel())}

    def new_cache(self, batch_size: int) -> FastKVCache:
        return FastKVCache(batch_size, 1, self.shape.kv_heads, self.shape.head_dim, self.dtype, self.device)

    def drafting(self) -> "_DraftingWeights":
        """The weights drafting runs on: copies in drafting_dtype (None: the parameters' own),
        made again whenever a parameter or buffer was replaced or changed in place since
        (training, loading, a move to another device)."""
        key = tuple((t.data_ptr(), t._version, t.dtype) for t in (*self._params, self.head))
        if self._drafting is None or self._drafting.key != key:
            dtype = self.drafting_dtype or self.dtype
            self._drafting = _DraftingWeights(
                key=key, layer=copy_layer(self.layer, dtype), fc_weight=self.fc.weight.detach().to(dtype),
                fc_bias=self.fc.bias.detach(), head=self.head.to(dtype),
                rope=RopeTable(self.rotary, self.shape.head_dim,
                               int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30),
                               self.dtype, self.device))
        return self._drafting

    @torch.inference_mode()
    def top_tokens(self, features: torch.Tensor, k: int, extra: Optional[ContextTokens] = None,
                   copies: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafting: features [..., H] -> the k likeliest tokens (ids [..., k], best first) and their
        log-probabilities [..., k] (float32), of those `scores` drafts; the others have none."""
        ids, scores = self.scores(features, extra, copies)
        top = scores.topk(k, dim=-1)
        return ids.gather(-1, top.indices), top.values - torch.logsumexp(scores, dim=-1, keepdim=True)

    @torch.inference_mode()
    def extend(self, cache: FastKVCache, features: torch.Tensor, input_ids: torch.Tensor,
               input_valid: Optional[torch.Tensor] = None, previous_ids: Optional[torch.Tensor] = None,
               sees: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
               block_mask: Optional[torch.Tensor] = None, taps: Optional[torch.Tensor] = None,
               copy_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append q pairs per row to the cache (causal among themselves, after each row's valid
        slots; input_valid [B, q] False for right padding, whose slots stay invalid):
        features [B, q, H], input_ids [B, q] (previous_ids [B, q] too for a previous_token
        draft, copy_ids [B, q] for a copy_token one) -> predicted features [B, q, H] (what `forward`
        computes, through the compact layer).
        A tree's nodes (specdec.eagle_tree) narrow that: sees [B, q, slots] the cache's slots
        each input may attend to (besides their validity), positions [B, q] their positions,
        block_mask [B, q, q] which of the new inputs each attends to (None: causal)."""
        w = self.drafting()
        batch, q = input_ids.shape
        mask, default_positions = attention_inputs(cache, (batch, q), block_mask, None, input_valid, self.dtype,
                                                   self.device)
        if sees is not None:
            mask[:, 0, :, : cache.num_slots].masked_fill_(~sees.to(self.device), torch.finfo(self.dtype).min)
        positions = default_positions if positions is None else positions.to(self.device)
        mask = mask.repeat(1, 1, self.shape.num_heads // self.shape.kv_heads, 1)  # query heads folded per K/V head
        cos, sin = w.rope(positions)
        x = linear_rows(self.pair_inputs(features, input_ids, previous_ids, taps, copy_ids), w.fc_weight)
        x = x + w.fc_bias  # [B, q, H]
        store = cache.hf
        store.reserve(q)
        out = decoder_layer(x, w.layer, self.shape, store, 0, cos[:, None], sin[:, None], mask)
        store.length += q
        cache.appended(input_valid if input_valid is not None else torch.ones_like(input_ids, dtype=torch.bool))
        return out


def build_eagle(target, token_ids: torch.Tensor, previous_token: bool = False,
                context_vocab: bool = False, tap_layers: Sequence[int] = (), copy_token: bool = False) -> EagleDraft:
    """A fresh (untrained) draft for `target` (a CausalLM with a transformers config), drafting
    token_ids [subset], in the target's dtype and on its device."""
    embed, out = target.embedding_tables()
    draft = EagleDraft(eagle_config(target.config), embed, out.detach()[token_ids.to(out.device)], token_ids,
                       previous_token=previous_token, output=out if context_vocab or copy_token else None,
                       context_vocab=context_vocab, tap_layers=tap_layers, copy_token=copy_token)
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
                previous_token=draft.previous_token, context_vocab=draft.context_vocab,
                tap_layers=list(draft.tap_layers), copy_token=draft.copy_token,
                token_ids=[int(t) for t in draft.token_ids.tolist()])
    tmp = out / (VOCAB_FILE + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(out / VOCAB_FILE)


def fc_inputs(previous_token: bool, taps: int, copy_token: bool = False) -> int:
    """How many H-wide inputs fc reads: the feature, the next token, the previous one, the taps,
    the copy candidate (in that order)."""
    return 2 + int(previous_token) + taps + int(copy_token)


def widen_fc(weights: dict[str, torch.Tensor], hidden: int, inputs: int = 2, to: int = 3) -> dict[str, torch.Tensor]:
    """The weights of a draft whose fc reads `inputs` H-wide inputs -> those of one reading `to`
    (fc_inputs) that computes the same: the new inputs' columns, last, are zero. The default
    widens a draft without previous_token to one with it."""
    fc = weights["fc.weight"]
    if fc.shape[1] != inputs * hidden or to < inputs:
        raise ValueError(f"fc.weight is {tuple(fc.shape)}, not a [{hidden}, {inputs * hidden}] draft to widen to "
                         f"{to} inputs")
    return {**weights, "fc.weight": torch.cat([fc, fc.new_zeros(hidden, (to - inputs) * hidden)], dim=1)}


def is_eagle_dir(path: Path) -> bool:
    return all((Path(path) / f).is_file() for f in (CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE))


# Drafting weights of a float32 draft: half the bytes. A drafting step reads every weight of the
# layer and the head once (16.7 + 18.9 MB in float32 for SmolLM2's 8,192-row head), more than
# this machine's 32 MB L3 beside the target's stream (the module docstring has the timings:
# c 0.14-0.18 against the llama.cpp target in float16, 0.18-0.35 in float32). Lossless all the
# same: the target verifies, and a sampled draft's probabilities are the ones it drew from;
# alpha on the dev prompts was the same (k = 1, every category).
DRAFTING_DTYPE = {torch.float32: torch.float16}


def load_eagle(path: Path, target, target_name: Optional[str] = None,
               drafting_dtype: Optional[torch.dtype] = None) -> EagleDraft:
    """Load an EAGLE directory onto `target` (any backend: it needs the target's embedding
    tables only), in the target's dtype and on its device. target_name (default target.name)
    must be the one the draft was trained for. drafting_dtype: the weights' dtype when drafting
    (None: DRAFTING_DTYPE's for the target's dtype, else the target's)."""
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
    context_vocab = bool(info.get("context_vocab", False))
    copy_token = bool(info.get("copy_token", False))
    draft = EagleDraft(eagle_config(config), embed, out.detach()[token_ids.to(out.device)], token_ids,
                       drafting_dtype=drafting_dtype or DRAFTING_DTYPE.get(embed.dtype),
                       previous_token=bool(info.get("previous_token", False)),
                       output=out if context_vocab or copy_token else None, context_vocab=context_vocab,
                       tap_layers=info.get("tap_layers", ()), copy_token=copy_token)
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
    context_len pairs, then a greedy chain's next token and its probability) over that of a
    1-token target forward against context_len tokens (costmodel.measure_forward_times' one-token
    figure)."""
    from specdec.costmodel import measure_forward_times

    gen = torch.Generator().manual_seed(0)
    cache = draft.new_cache(1)
    hidden = draft.head.shape[1]
    ids = torch.randint(0, draft.vocab_size, (1, context_len + 1), generator=gen)
    copies = torch.randint(0, draft.vocab_size, ids.shape, generator=gen) if draft.copy_token else None
    draft.extend(cache, torch.randn(1, context_len, hidden, generator=gen).to(draft.dtype), ids[:, 1:],
                 previous_ids=ids[:, :-1], copy_ids=None if copies is None else copies[:, 1:])
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        f = draft.extend(cache, torch.randn(1, 1, hidden, generator=gen).to(draft.dtype), torch.tensor([[7]]),
                         previous_ids=ids[:, -1:], copy_ids=None if copies is None else copies[:, -1:])
        drafted, scores = draft.scores(f[:, 0], copies=None if copies is None else copies[:, -1])
        best = scores.argmax(-1, keepdim=True)
        drafted.gather(-1, best).item(), torch.softmax(scores, -1).gather(-1, best).item()
        times.append(time.perf_counter() - t0)
        cache.truncate(torch.tensor([context_len]))
    t_draft = sorted(times[2:])[repeats // 2]
    t_target = measure_forward_times(target, ks=(1,), context_len=context_len, repeats=repeats, warmup=2)[1]
    return t_draft / t_target
