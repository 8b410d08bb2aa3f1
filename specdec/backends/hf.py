"""The one adapter through which the engine runs a causal LM:
forward(cache, ids, block mask, depths) -> logits (and the last hidden state on request).

Any transformers causal LM goes through this general path: a custom 4D additive attention
mask and explicit position ids, with our validity-masked KV cache. No model code is patched
or copied.
"""

from __future__ import annotations

import hashlib

from dataclasses import dataclass
from typing import Optional

import torch

from specdec.backends.kv_cache import KVCache, restore_kv, snapshot_kv


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [batch, q or len(logits_at), vocab]
    hidden: Optional[torch.Tensor] = None  # [batch, q, hidden] last layer, after the final norm
    # [batch, q, n * hidden]: the residual stream after the n decoder layers asked for (tap_layers;
    # backends with returns_taps), in that order, un-normed
    taps: Optional[torch.Tensor] = None


def feature_rows(out: ForwardOutput) -> torch.Tensor:
    """The target's states an EAGLE proposer reads per position: its features (hidden), followed
    by its residuals after the draft's tap layers where they were asked for (taps)."""
    return out.hidden if out.taps is None else torch.cat([out.hidden, out.taps], dim=-1)


def tap_request(tap_layers) -> dict:
    """forward/prefill keyword arguments asking for the residuals after tap_layers: none where
    there are none (so a backend without returns_taps is asked the same as before)."""
    return {"tap_layers": tuple(tap_layers)} if tap_layers else {}


def scatter_subset_logits(sub: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a vocabulary subset [..., subset] -> full-vocabulary logits [..., vocab] with -inf
    (probability 0) for every token outside the subset."""
    full = torch.full((*sub.shape[:-1], vocab_size), float("-inf"), dtype=sub.dtype, device=sub.device)
    full[..., token_ids] = sub
    return full


def attention_inputs(cache: KVCache, shape: tuple[int, int], block_mask: Optional[torch.Tensor],
                     depth: Optional[torch.Tensor], input_valid: Optional[torch.Tensor], dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention inputs of q new inputs per row against a validity-masked cache: shape
    (batch, q); block_mask [batch, q, q] bool (None: causal); depth [batch, q] (None: 0..q-1);
    input_valid [batch, q] (None: all) -> (additive mask [batch, 1, q, slots + q] in `dtype`,
    position ids [batch, q]). Padding attends to itself only; nothing attends to padding."""
    batch, q = shape
    dev = device
    if q == 1:  # one input (a chain's drafting step): it sees the valid slots and itself, whatever else is given
        allowed = torch.cat([cache.valid, torch.ones(batch, 1, dtype=torch.bool, device=dev)], dim=1)[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)
        positions = cache.lengths[:, None].to(dev) + (0 if depth is None else depth.to(dev))
        return mask[:, None], positions
    if block_mask is None:
        block_mask = torch.ones(q, q, dtype=torch.bool, device=dev).tril().expand(batch, q, q)
    if depth is None:
        depth = torch.arange(q, device=dev).expand(batch, q)
    if input_valid is None:
        input_valid = torch.ones(batch, q, dtype=torch.bool, device=dev)
    eye = torch.eye(q, dtype=torch.bool, device=dev)
    new = (block_mask.to(dev) & input_valid.to(dev)[:, None, :]) | eye  # [batch, q, q]; padding sees itself only
    past = cache.valid[:, None, :].expand(batch, q, cache.num_slots)  # [batch, q, slots]
    allowed = torch.cat([past, new], dim=2)  # [batch, q, slots + q]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=dev)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    positions = cache.lengths[:, None].to(dev) + depth.to(dev)  # [batch, q]
    return mask[:, None], positions


class CausalLM:
    """A transformers causal LM in eval mode, plus what the engine needs to know about it."""

    # what it declares (specdec.backends.base.ModelBackend)
    backend = "hf"
    head_rows = None  # the whole vocabulary is scored
    returns_hidden = True
    returns_taps = False  # forward/prefill(tap_layers=...): see specdec.backends.fast.FastLlamaLM
    runs_trees = True
    stacks_caches = True
    greedy_steps = False
    prefill_block = 1  # a forward's width moves a token's logits by float rounding only (~1e-6: test_prefix_cache.py)

    def __init__(self, model: torch.nn.Module, name: str = "model"):
        self.model = model.eval()
        self.name = name
        self.config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
        eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def embedding_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input embeddings, output layer), each [vocab, hidden]: what a draft built on this
        target shares with it (specdec.drafts)."""
        return self.model.get_input_embeddings().weight, self.model.get_output_embeddings().weight

    def output_bias(self) -> Optional[torch.Tensor]:
        """The output layer's bias [vocab], None where it has none (Llama's has none)."""
        return getattr(self.model.get_output_embeddings(), "bias", None)

    def cost_identity(self) -> dict:
        """What a forward's cost depends on, as JSON-ready values (the key under which measured
        costs are kept, specdec.costmodel.CostStore): the implementation, dtype, device and a
        fingerprint of the weights (names, shapes and a few values of every tensor)."""
        digest = hashlib.sha256()
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                digest.update(f"{name}:{tuple(param.shape)}:".encode())
                digest.update(param.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
        return {"impl": type(self).__qualname__, "name": self.name, "dtype": str(self.dtype),
                "device": str(self.device), "weights": digest.hexdigest()[:16]}

    def new_cache(self, batch_size: int) -> KVCache:
        return KVCache(batch_size, self.device, config=self.config)

    def snapshot_prefix(self, cache: KVCache, n: int) -> tuple[object, int]:
        """(a copy of row 0's first n tokens' KV, its bytes): for specdec.prefix_cache."""
        return snapshot_kv(cache, n)

    def restore_prefix(self, cache: KVCache, snapshot: object, n: int) -> None:
        """Make an empty batch-1 cache hold the first n tokens of a snapshot_prefix snapshot."""
        restore_kv(cache, snapshot, n)

    def _attention_inputs(self, cache: KVCache, input_ids: torch.Tensor, block_mask: Optional[torch.Tensor],
                          depth: Optional[torch.Tensor], input_valid: Optional[torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (additive mask [batch, 1, q, slots + q], position ids [batch, q]) for `forward`."""
        return attention_inputs(cache, input_ids.shape, block_mask, depth, input_valid, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,
        block_mask: Optional[torch.Tensor] = None,
        depth: Optional[torch.Tensor] = None,
        input_valid: Optional[torch.Tensor] = None,
        logits_at: Optional[torch.Tensor] = None,
        want_hidden: bool = False,
    ) -> ForwardOutput:
        """Run q new inputs per row against the cache and append their KV slots.

        input_ids [batch, q]; block_mask [batch, q, q] bool (None: causal), who may attend to
        whom among the new inputs; depth [batch, q] position offsets from each row's length
        (None: 0..q-1); input_valid [batch, q] bool (None: all), False for padding, which
        nothing attends to and whose slots are written invalid; logits_at [m] long, the only
        block columns whose logits are computed (None: all).
        The new slots stay valid (where input_valid) until the caller's `cache.keep_last`.
        """
        mask, positions = self._attention_inputs(cache, input_ids, block_mask, depth, input_valid)
        dev = self.device
        kwargs = {}
        if logits_at is not None:
            kwargs["logits_to_keep"] = logits_at.to(dev)
        out = self.model(
            input_ids=input_ids.to(dev),
            attention_mask=mask,
            position_ids=positions,
            cache=cache.hf,
            use_cache=True,
            output_hidden_states=want_hidden,
            **kwargs,
        )
        cache.appended(input_valid if input_valid is not None else torch.ones_like(input_ids, dtype=torch.bool))
        hidden = out.hidden_states[-1] if want_hidden else None
        return ForwardOutput(logits=out.logits, hidden=hidden)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, prompts: list[list[int]] | list[tuple[int, ...]],
                want_hidden: bool = False, all_hidden: bool = False, **taps) -> ForwardOutput:
        """Feed prompts of different lengths (right-padded) into an empty or partly filled cache.

        Returns logits [batch, vocab] (and hidden [batch, hidden]) at each row's last prompt token;
        all_hidden: hidden [batch, width, hidden] at every fed position instead, row b's in its
        first len(prompts[b]) columns (the features an EAGLE draft reads: specdec.eagle), and
        with tap_layers (a backend with returns_taps) taps there too.
        """
        lens = torch.tensor([len(p) for p in prompts])
        width = int(lens.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        valid = torch.arange(width)[None, :] < lens[:, None]  # [batch, width]
        rows = torch.arange(len(prompts))
        last = lens - 1  # [batch]
        cols, inverse = torch.unique(last, return_inverse=True)
        out = self.forward(cache, ids, input_valid=valid, logits_at=cols, want_hidden=want_hidden or all_hidden, **taps)
        cache.keep_last(valid)
        hidden = out.hidden if all_hidden else out.hidden[rows, last] if want_hidden else None
        return ForwardOutput(logits=out.logits[rows, inverse], hidden=hidden,  # logits [batch, vocab]
                             taps=out.taps if all_hidden else None)
