"""Stacking independent batch-1 KV caches into one batched cache and splitting it back.

A service holds one cache per session (each grows, rolls back and is evicted on its own) and
still wants one forward pass for the sessions that arrive together. `stack_caches` copies the
sessions' slots into one [batch, heads, slots, dim] cache (shorter rows padded with invalid
slots); `split_cache` copies each row's valid slots back into its own compact cache.

Limitation: both copy every cached key and value once per call, which is cheap next to a
forward pass for small models and short contexts but grows with context length; and only
full-attention layers (transformers' DynamicLayer) are supported, like KVCache itself.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.kv_cache import KVCache


def _fill(cache: KVCache, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """Give an empty cache these per-layer keys / values [batch, heads, slots, dim]."""
    layers = cache.hf.layers
    if len(layers) != len(keys):  # a cache built without a config grows its layers on first use
        for idx, (k, v) in enumerate(zip(keys, values)):
            cache.hf.update(k, v, idx)
        return
    for layer, k, v in zip(layers, keys, values):
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("stacking sliding-window KV layers is not supported")
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v


def _layer_tensors(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.hf.layers]


def stack_caches(caches: Sequence[KVCache], new_cache) -> KVCache:
    """Batch-1 caches -> one cache with a row per input (in order). new_cache(batch) makes an
    empty cache of the right kind (e.g. CausalLM.new_cache). The inputs are left unchanged."""
    if any(c.batch_size != 1 for c in caches):
        raise ValueError("stack_caches takes batch-1 caches")
    out = new_cache(len(caches))
    width = max(c.num_slots for c in caches)
    if width == 0:
        return out
    ref = _layer_tensors(next(c for c in caches if c.num_slots))
    keys, values = [], []
    for layer_idx, (k_ref, v_ref) in enumerate(ref):
        k = k_ref.new_zeros(len(caches), k_ref.shape[1], width, k_ref.shape[3])  # [batch, heads, width, dim]
        v = v_ref.new_zeros(len(caches), v_ref.shape[1], width, v_ref.shape[3])
        for row, c in enumerate(caches):
            if c.num_slots:
                layer = c.hf.layers[layer_idx]
                k[row, :, : c.num_slots] = layer.keys[0]
                v[row, :, : c.num_slots] = layer.values[0]
        keys.append(k)
        values.append(v)
    _fill(out, keys, values)
    valid = torch.zeros(len(caches), width, dtype=torch.bool, device=out.valid.device)
    for row, c in enumerate(caches):
        valid[row, : c.num_slots] = c.valid[0]
    out.valid = valid
    return out


def split_cache(cache: KVCache, new_cache) -> list[KVCache]:
    """One compact batch-1 cache per row, holding that row's valid slots in order."""
    outs = []
    layers = _layer_tensors(cache) if cache.num_slots else []
    for row in range(cache.batch_size):
        out = new_cache(1)
        slots = cache.valid[row].nonzero().squeeze(-1)  # [n_valid]
        if slots.numel():
            _fill(out, [k[row : row + 1, :, slots] for k, _ in layers], [v[row : row + 1, :, slots] for _, v in layers])
            out.valid = torch.ones(1, slots.numel(), dtype=torch.bool, device=cache.valid.device)
        outs.append(out)
    return outs
