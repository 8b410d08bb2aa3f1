"""Stacking independent batch-1 KV caches into one batched cache and splitting it back.

A service holds one cache per session (each grows, rolls back and is evicted on its own) and
still wants one forward pass for the sessions that arrive together. `stack_caches` copies the
sessions' slots into one [batch, heads, slots, dim] cache (shorter rows padded with invalid
slots); `split_cache` copies each row's valid slots back into its own compact cache.

Works on any KVCache through its `layer_kv` / `load_layer_kv` (transformers' DynamicCache
layers, and the fast forward's slot store). Limitation: both copy every cached key and value
once per call, which is cheap next to a forward pass for small models and short contexts but
grows with context length; and only full-attention layers are supported, like KVCache itself.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.backends.kv_cache import KVCache


def stack_caches(caches: Sequence[KVCache], new_cache) -> KVCache:
    """Batch-1 caches -> one cache with a row per input (in order). new_cache(batch) makes an
    empty cache of the right kind (e.g. CausalLM.new_cache). The inputs are left unchanged."""
    if any(c.batch_size != 1 for c in caches):
        raise ValueError("stack_caches takes batch-1 caches")
    out = new_cache(len(caches))
    width = max(c.num_slots for c in caches)
    if width == 0:
        return out
    rows = [c.layer_kv() for c in caches]
    ref = next(r for r in rows if r)
    keys, values = [], []
    for layer_idx, (k_ref, v_ref) in enumerate(ref):
        k = k_ref.new_zeros(len(caches), k_ref.shape[1], width, k_ref.shape[3])  # [batch, heads, width, dim]
        v = v_ref.new_zeros(len(caches), v_ref.shape[1], width, v_ref.shape[3])
        for row, (c, kv) in enumerate(zip(caches, rows)):
            if kv:
                k[row, :, : c.num_slots] = kv[layer_idx][0][0]
                v[row, :, : c.num_slots] = kv[layer_idx][1][0]
        keys.append(k)
        values.append(v)
    valid = torch.zeros(len(caches), width, dtype=torch.bool, device=out.valid.device)
    for row, c in enumerate(caches):
        valid[row, : c.num_slots] = c.valid[0]
    out.load_layer_kv(keys, values, valid)
    return out


def split_cache(cache: KVCache, new_cache) -> list[KVCache]:
    """One compact batch-1 cache per row, holding that row's valid slots in order."""
    outs = []
    layers = cache.layer_kv()
    for row in range(cache.batch_size):
        out = new_cache(1)
        slots = cache.valid[row].nonzero().squeeze(-1)  # [n_valid]
        if slots.numel():
            out.load_layer_kv([k[row : row + 1, :, slots] for k, _ in layers],
                              [v[row : row + 1, :, slots] for _, v in layers],
                              torch.ones(1, slots.numel(), dtype=torch.bool, device=cache.valid.device))
        outs.append(out)
    return outs
