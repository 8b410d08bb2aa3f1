"""A compact Llama forward (gpt-fast style) for CPU decoding, behind the CausalLM interface.

It loads nothing of its own: it takes a loaded transformers Llama, fuses q/k/v and gate/up
into single weight matrices (the transformers modules keep working: their weights become views
into the fused ones, so no memory is doubled), and runs the decoder with
- a pre-allocated KV cache indexed by slot (FastKVCache: the same validity-masked API as
  specdec.backends.kv_cache.KVCache, so decode.py and every proposer work unchanged; rolling back is
  moving a length, growth doubles the buffer instead of a torch.cat per layer per step);
- 4 matmuls per layer instead of 7, one attention mask per forward, no per-layer cache
  bookkeeping;
- grouped-query attention without repeating K/V: the query heads that share a K/V head are
  folded into that head's query rows;
- the matmul call chosen by row count and weight, timed on the host it runs on (see
  `linear_rows`): about 1.9x faster at 1-2 rows than F.linear on the EPYC it was first measured
  on, 2.5-3x slower on an Intel Xeon (AVX-512, AMX), where F.linear wins.

Numerics follow transformers' Llama op for op (RMSNorm in float32, RoPE tables computed the same
way, SDPA with an additive mask), so logits agree to float rounding; greedy outputs agree except
where the top two logits tie (tests/unit/test_fast_llama.py, tests/integration).

What was tried and measured (SmolLM2-135M, fp32, 1 thread, thread CPU time on the shared
2-core EPYC): the row-count kernel choice took a 1-token forward from
73.6 ms (transformers) to 44 ms and plain decoding from 78.7 to 48.6 ms per token (outputs
identical); oneDNN prepacked weights and MKL packed GEMM (`_mkl_linear`) were no faster than
W @ x.T; torch.compile of the decoder (dynamic shapes) took 8 minutes to compile and ran slower;
bfloat16 weights (`weight_dtype`, lossy) made multi-row forwards much cheaper (v(8) 1.13) but a
1-token forward slower than float32 with the kernel choice.

Limitations: Llama-family decoders only (no attention/MLP biases, SiLU MLP, static RoPE
types); `supports_fast(config)` says why a model is refused. Not for sliding-window models.
FastKVCache has no transformers cache layers; it stacks and splits (specdec/backends/kv_stack.py, the
services' batching) through the same `layer_kv` / `load_layer_kv` as KVCache. The kernel
choice is timed on the host when a model loads, for each of its product shapes and 1-8 rows
(0.7 s for SmolLM2-135M, mostly the output layer; any other product at its first use); on a GPU every
matmul is F.linear.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from specdec.errors import ModelLoadError
from specdec.backends.kv_cache import KVCache
from specdec.backends.hf import CausalLM, ForwardOutput, scatter_subset_logits


def supports_fast(config) -> Optional[str]:
    """None if the fast forward can run this model, else the reason it cannot."""
    if getattr(config, "model_type", None) != "llama":
        return f"model type {getattr(config, 'model_type', None)!r} is not 'llama'"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "attention or MLP biases are not supported"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 is not supported"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) in ("dynamic", "longrope"):
        return f"RoPE type {rope.get('rope_type')!r} changes with the sequence length"
    return None


class _SlotStore:
    """K/V storage for all layers: [layers, batch, kv_heads, capacity, head_dim] each, the first
    `length` slots in use. Offers the few methods KVCache calls on its storage (crop,
    batch_select_indices, get_seq_length), so FastKVCache inherits all of KVCache's validity logic."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more slots (doubling, so growth costs amortised O(1) per slot)."""
        need = self.length + extra
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.empty((*old.shape[:3], cap, old.shape[4]), dtype=old.dtype, device=old.device)
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, n: int) -> None:
        """Keep the first n slots (n < 0: drop the last -n), like DynamicCache.crop."""
        self.length = self.length + n if n < 0 else min(n, self.length)

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        self.keys = self.keys[:, rows.to(self.keys.device)]
        self.values = self.values[:, rows.to(self.keys.device)]


class FastKVCache(KVCache):
    """KVCache over a pre-allocated slot store instead of a transformers DynamicCache."""

    def __init__(self, batch_size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", capacity: int = 256):
        self.hf = _SlotStore(num_layers, batch_size, kv_heads, head_dim, capacity, dtype, torch.device(device))
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [batch, slots]

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        store, n = self.hf, self.hf.length
        return [(store.keys[i, :, :, :n], store.values[i, :, :, :n]) for i in range(store.keys.shape[0])] if n else []

    def load_layer_kv(self, keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor) -> None:
        store, width = self.hf, valid.shape[1]
        if store.length or len(keys) != store.keys.shape[0]:
            raise ValueError(f"load_layer_kv needs an empty cache with {store.keys.shape[0]} layers")
        store.reserve(width)
        for i, (k, v) in enumerate(zip(keys, values)):
            store.keys[i, :, :, :width] = k
            store.values[i, :, :, :width] = v
        store.length = width
        self.valid = valid

    @torch.inference_mode()  # the store may be inference tensors (grown inside a forward): moved in place
    def compact(self) -> None:
        """Squeeze out every hole: each row's valid slots move to the front, in order."""
        store = self.hf
        lengths = self.lengths
        width = int(lengths.max()) if lengths.numel() else 0
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]  # [batch, width]
        L, B, H, _, D = store.keys.shape
        idx = order[None, :, None, :, None].expand(L, B, H, width, D).to(store.keys.device)
        n = store.length
        store.keys[:, :, :, :width] = store.keys[:, :, :, :n].gather(3, idx)
        store.values[:, :, :, :width] = store.values[:, :, :, :n].gather(3, idx)
        store.length = width
        self.valid = torch.arange(width, device=self.valid.device)[None, :] < lengths[:, None]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One fused op; bitwise equal to the unfused float32 formula below on the inputs checked
        # (tests/unit/test_fast_llama.py), and a third faster at one row.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # transformers' LlamaRMSNorm: statistics in float32, scale in the model dtype.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# `W @ x.T` (MKL gemm with the weight as the left, untransposed operand) or F.linear's `x @ W.T`:
# which is faster depends on the host. On this project's 2-core AMD EPYC (torch 2.13, MKL, 1
# thread, microseconds per call, SmolLM2-135M shapes, W @ x.T vs F.linear):
#   gate/up 576->3072: rows 1: 375 (padded to 2 rows) vs 693, 2: 364 vs 1229, 4: 492 vs 926, 8: 892 vs 1116
#   output 576->49152: rows 1: 5.6 ms vs 11.1, 2: 5.6 vs 24.1, 4: 8.2 vs 18.3, 8: 14.2 vs 22.0
# On an Intel Xeon with AVX-512 and AMX (2 threads), the other way round:
#   gate/up 576->3072: rows 1: 335 vs 131, 2: 329 vs 131, 4: 328 vs 253, 8: 342 vs 375
#   output 576->49152: rows 1: 17.5 ms vs 5.3, 2: 15.5 vs 6.0, 4: 11.7 vs 11.4, 8: 12.0 vs 18.1
# So the choice is timed where it runs: once per (rows, weight shape, dtype), when a model loads
# (KernelChoice.prepare) or at first use.
_NT_MAX_ROWS = 8  # more rows: always F.linear
_TIMING_REPEATS = 3


def _nt_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [m, in] @ weight.T as W @ x.T; a 1-row input is padded to 2 rows (MKL's 1-row gemv path
    reads the weights about half as fast on the EPYC)."""
    m = x.shape[0]
    rows = torch.cat((x, x)) if m == 1 else x  # a real copy: a stride-0 operand would leave BLAS
    return torch.mm(weight, rows.t())[:, :m].t().contiguous()


def _seconds(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class KernelChoice:
    """Per (rows, weight shape, dtype): whether W @ x.T beats F.linear on this host, timed once
    (best of a few calls each) the first time that product is asked for."""

    def __init__(self, repeats: int = _TIMING_REPEATS,
                 seconds: Callable[[Callable[[], torch.Tensor], int], float] = _seconds):
        self.repeats = repeats
        self.seconds = seconds  # (call, repeats) -> its time
        self._nt: dict[tuple, bool] = {}

    def use_nt(self, m: int, weight: torch.Tensor) -> bool:
        key = (m, tuple(weight.shape), weight.dtype)
        if key not in self._nt:
            with torch.inference_mode():
                x = torch.ones(m, weight.shape[1], dtype=weight.dtype)  # (the global RNG left alone)
                self._nt[key] = (self.seconds(lambda: _nt_product(x, weight), self.repeats)
                                 < self.seconds(lambda: F.linear(x, weight), self.repeats))
        return self._nt[key]

    def prepare(self, weights: Iterable[torch.Tensor], max_rows: int = _NT_MAX_ROWS) -> None:
        """Time every row count up to max_rows for each distinct (shape, dtype) of these CPU weights
        now (a model does it at load: ~0.7 s for SmolLM2-135M, mostly its output layer), so that no
        request pays for it."""
        for weight in {(tuple(w.shape), w.dtype): w for w in weights if w.device.type == "cpu"}.values():
            for m in range(1, max_rows + 1):
                self.use_nt(m, weight)


_KERNELS = KernelChoice()  # the host's timings, shared by every model in the process


def linear_rows(x: torch.Tensor, weight: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """x [..., in] @ weight[out, in].T -> [..., out], with the MKL call this host runs fastest for
    the row count and weight (kernel: "auto"; "nt" or "linear" force one path, for tests)."""
    if x.dtype != weight.dtype:  # reduced-precision weights (fast-bf16, lossy and opt-in; EAGLE drafting): oneDNN
        return F.linear(x.to(weight.dtype), weight).to(x.dtype)
    m = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or kernel == "linear" or (kernel == "auto" and (
            m > _NT_MAX_ROWS or not _KERNELS.use_nt(m, weight))):
        return F.linear(x, weight)
    return _nt_product(x.reshape(m, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    __slots__ = ("in_norm", "wqkv", "wo", "post_norm", "w_gate_up", "w_down")

    def __init__(self, in_norm, wqkv, wo, post_norm, w_gate_up, w_down):
        self.in_norm, self.wqkv, self.wo = in_norm, wqkv, wo
        self.post_norm, self.w_gate_up, self.w_down = post_norm, w_gate_up, w_down


def _fuse_rows(*linears: torch.nn.Linear) -> torch.Tensor:
    """One [sum(out), in] weight; each module's weight becomes a view into it (no extra memory).
    A single module's weight is returned as it is."""
    if len(linears) == 1:
        return linears[0].weight.detach()
    fused = torch.cat([m.weight.detach() for m in linears], dim=0).contiguous()
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = fused[start : start + n]
        start += n
    return fused


def _layer_from(layer: torch.nn.Module, weight: Callable[..., torch.Tensor]) -> _Layer:
    """A transformers LlamaDecoderLayer as a _Layer: weight(*linears) makes each matrix (q/k/v and
    gate/up fused into one each); the norms' weights are the module's own."""
    att, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        return _Layer(layer.input_layernorm.weight.detach(), weight(att.q_proj, att.k_proj, att.v_proj),
                      weight(att.o_proj), layer.post_attention_layernorm.weight.detach(),
                      weight(mlp.gate_proj, mlp.up_proj), weight(mlp.down_proj))


def fuse_layer(layer: torch.nn.Module) -> _Layer:
    """The layer's weights fused; the module's own weights become views into the fused ones, so it
    keeps working and nothing is doubled."""
    return _layer_from(layer, _fuse_rows)


def copy_layer(layer: torch.nn.Module, dtype: torch.dtype) -> _Layer:
    """The layer's weights fused as copies in `dtype` (the norms stay the module's), the module untouched."""
    return _layer_from(layer, lambda *linears: torch.cat([m.weight.detach() for m in linears]).to(dtype).contiguous())


class LayerShape:
    """The head counts and sizes a decoder layer runs with, from a transformers Llama config."""

    __slots__ = ("num_heads", "kv_heads", "head_dim", "intermediate", "eps")

    def __init__(self, config):
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.intermediate = config.intermediate_size
        self.eps = float(config.rms_norm_eps)


class RopeTable:
    """cos, sin at given positions, from a transformers LlamaRotaryEmbedding's inverse
    frequencies (a table grown on demand, computed as that module computes it)."""

    def __init__(self, rotary: torch.nn.Module, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device):
        self.inv_freq = rotary.inv_freq.detach().float()
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.max_positions, self.dtype, self.device = max_positions, dtype, device
        self.cos = torch.empty(0, head_dim)
        self.sin = torch.empty(0, head_dim)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [batch, q] -> cos, sin [batch, q, head_dim]."""
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            n = min(max(need, 2 * self.cos.shape[0], 1024), max(self.max_positions, need))
            freqs = torch.arange(n, device=self.inv_freq.device)[:, None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
            self.cos = (emb.cos() * self.scaling).to(self.dtype).to(self.device)
            self.sin = (emb.sin() * self.scaling).to(self.dtype).to(self.device)
        return self.cos[positions], self.sin[positions]


def decoder_layer(x: torch.Tensor, layer: _Layer, shape: LayerShape, store: "_SlotStore", index: int,
                  cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One Llama decoder layer over x [batch, q, hidden], writing its keys and values to slots
    store.length .. + q of layer `index` (the caller has reserved them and moves the length after
    the last layer); cos, sin [batch, 1, q, head_dim]; mask: the additive mask with the query heads
    sharing a K/V head folded into its rows, [batch, 1, n_rep * q, slots + q]."""
    batch, q = x.shape[:2]
    H, KVH, D, I = shape.num_heads, shape.kv_heads, shape.head_dim, shape.intermediate
    n_rep = H // KVH
    start, end = store.length, store.length + q
    h = _rms_norm(x, layer.in_norm, shape.eps)
    qkv = linear_rows(h, layer.wqkv)  # [batch, q, (H + 2 KVH) * D]
    qk = qkv[..., : (H + KVH) * D].view(batch, q, H + KVH, D).transpose(1, 2)  # [batch, H + KVH, q, D]
    qk = qk * cos + _rotate_half(qk) * sin  # RoPE on queries and keys at once
    qs, ks = qk[:, :H], qk[:, H:]  # [batch, H, q, D], [batch, KVH, q, D]
    vs = qkv[..., (H + KVH) * D :].view(batch, q, KVH, D).transpose(1, 2)
    store.keys[index, :, :, start:end] = ks
    store.values[index, :, :, start:end] = vs
    keys = store.keys[index, :, :, :end]  # [batch, KVH, slots + q, D]
    values = store.values[index, :, :, :end]
    qf = qs.reshape(batch, KVH, n_rep * q, D)  # head h = kv_head * n_rep + r
    att = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask, scale=D ** -0.5)
    att = att.view(batch, H, q, D).transpose(1, 2).reshape(batch, q, H * D)
    x = x + linear_rows(att, layer.wo)
    h = _rms_norm(x, layer.post_norm, shape.eps)
    gate_up = linear_rows(h, layer.w_gate_up)  # [batch, q, 2 I]
    return x + linear_rows(F.silu(gate_up[..., :I]) * gate_up[..., I:], layer.w_down)


class FastLlamaLM(CausalLM):
    """CausalLM whose forward runs our own Llama decoder over the model's (fused) weights.

    `model` stays the transformers module (drafts built from the target, e.g. early_exit_copy,
    read its config and state dict); only `forward` and `new_cache` differ.
    `head_rows`: score only these rows of the output layer (a draft's frequent-token subset, see
    specdec.drafts); every other token gets logit -inf.
    """

    returns_taps = True  # forward/prefill(tap_layers=...) give the residuals after those layers (ForwardOutput.taps)

    def __init__(self, model: torch.nn.Module, name: str = "model", weight_dtype: Optional[torch.dtype] = None,
                 head_rows: Optional[torch.Tensor] = None):
        why = supports_fast(model.config)
        if why is not None:
            raise ModelLoadError(f"the fast backend cannot run {name}: {why}; use backend='hf'")
        super().__init__(model, name=name)
        self.shape = LayerShape(model.config)
        self.num_heads, self.kv_heads, self.head_dim = self.shape.num_heads, self.shape.kv_heads, self.shape.head_dim
        self.eps = self.shape.eps
        decoder = model.get_decoder()
        with torch.no_grad():
            self.embed = decoder.embed_tokens.weight.detach()  # [vocab, hidden]
            self.layers = [fuse_layer(layer) for layer in decoder.layers]
            self.norm = decoder.norm.weight.detach()
            self.lm_head = model.get_output_embeddings().weight.detach()  # [vocab, hidden]
            self.head_rows = None if head_rows is None else head_rows.long().to(self.lm_head.device)
            if self.head_rows is not None:
                self.lm_head = self.lm_head[self.head_rows].clone()  # [subset, hidden]
        self.weight_dtype = weight_dtype or self.dtype
        self.backend = "fast" if self.weight_dtype == self.dtype else "fast-bf16"
        if self.weight_dtype != self.dtype:
            # LOSSY relative to the loaded model: matmul weights (and inputs) rounded to
            # weight_dtype; the transformers module keeps the original weights.
            for layer in self.layers:
                for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                    setattr(layer, name, getattr(layer, name).to(self.weight_dtype))
            self.lm_head = self.lm_head.to(self.weight_dtype)
        self.rope = RopeTable(decoder.rotary_emb, self.head_dim, self.max_positions, self.dtype, self.device)
        if self.weight_dtype == self.dtype:  # (other weight dtypes always take F.linear)
            _KERNELS.prepare([w for layer in self.layers[:1] for w in (layer.wqkv, layer.wo, layer.w_gate_up,
                                                                       layer.w_down)] + [self.lm_head])

    def cost_identity(self) -> dict:
        # "kernels": figures measured before the row-count kernel choice was timed on the host
        # (a choice fixed from one host's timings) carry no such entry, so they are measured again.
        return {**super().cost_identity(), "weight_dtype": str(self.weight_dtype),
                "head_rows": int(self.lm_head.shape[0]), "kernels": "host-timed"}

    def new_cache(self, batch_size: int) -> FastKVCache:
        return FastKVCache(batch_size, len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        cache: FastKVCache,
        input_ids: torch.Tensor,
        block_mask: Optional[torch.Tensor] = None,
        depth: Optional[torch.Tensor] = None,
        input_valid: Optional[torch.Tensor] = None,
        logits_at: Optional[torch.Tensor] = None,
        want_hidden: bool = False,
        tap_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """Same contract as CausalLM.forward (see there); tap_layers: also the residual stream after
        these decoder layers (0-based) at every input, ForwardOutput.taps (returns_taps)."""
        if not isinstance(cache, FastKVCache):
            raise TypeError("the fast backend needs a cache from its own new_cache()")
        batch, q = input_ids.shape
        dev = self.device
        mask, positions = self._attention_inputs(cache, input_ids, block_mask, depth, input_valid)
        if input_valid is None:
            input_valid = torch.ones(batch, q, dtype=torch.bool, device=dev)
        # Query heads sharing a K/V head are folded into its rows: [batch, 1, n_rep * q, slots + q].
        n_rep = self.num_heads // self.kv_heads
        mask = mask.repeat(1, 1, n_rep, 1)
        cos, sin = self.rope(positions)  # [batch, q, head_dim]
        cos, sin = cos[:, None], sin[:, None]  # [batch, 1, q, head_dim]

        store = cache.hf
        store.reserve(q)
        x = F.embedding(input_ids.to(dev), self.embed)  # [batch, q, hidden]
        tapped = {}
        for i, layer in enumerate(self.layers):
            x = decoder_layer(x, layer, self.shape, store, i, cos, sin, mask)
            if i in tap_layers:
                tapped[i] = x
        store.length += q
        hidden = _rms_norm(x, self.norm, self.eps)  # [batch, q, hidden]
        sel = hidden if logits_at is None else hidden[:, logits_at.to(dev)]
        logits = linear_rows(sel, self.lm_head)  # [batch, q', vocab or subset]
        if self.head_rows is not None:
            logits = scatter_subset_logits(logits, self.head_rows, self.vocab_size)
        cache.appended(input_valid)
        taps = torch.cat([tapped[i] for i in tap_layers], dim=-1) if tap_layers else None
        return ForwardOutput(logits=logits, hidden=hidden if want_hidden else None, taps=taps)

    @torch.inference_mode()
    def layer_states(self, input_ids: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """The residual stream after each of `layers` (0-based decoder layers, un-normed) over
        input_ids [batch, q] from position 0, on a cache of its own: [batch, q, len(layers) * hidden],
        in that order. Runs the decoder only as far as the deepest of them."""
        if not layers or min(layers) < 0 or max(layers) >= len(self.layers):
            raise ValueError(f"layers {list(layers)}: want 0-based decoder layers below {len(self.layers)}")
        cache = self.new_cache(input_ids.shape[0])
        mask, positions = self._attention_inputs(cache, input_ids, None, None, None)
        mask = mask.repeat(1, 1, self.num_heads // self.kv_heads, 1)
        cos, sin = self.rope(positions)
        store = cache.hf
        store.reserve(input_ids.shape[1])
        x = F.embedding(input_ids.to(self.device), self.embed)
        states = {}
        for i, layer in enumerate(self.layers[: max(layers) + 1]):
            x = decoder_layer(x, layer, self.shape, store, i, cos[:, None], sin[:, None], mask)
            states[i] = x
        return torch.cat([states[i] for i in layers], dim=-1)
