"""A batched KV cache whose slots carry a validity mask.

One mechanism serves every kind of rollback:
- a rejected draft suffix, per row, when rows of a batch accept different numbers of tokens;
- a tree whose accepted path is scattered among the verified nodes (tree-path compaction);
- padding of prompts of different lengths.
Rejected slots are marked invalid (masked out of attention from then on); trailing columns
that no row needs are cropped at once, and holes are squeezed out physically (a gather per
layer) only when they make up a large share of the cache. Keys are stored already rotated
(RoPE), so a token's slot order does not matter, only its validity; positions are counted as
the number of valid slots before it.

Limitation: works with caches made of growing layers (transformers' DynamicCache, i.e. every
full-attention decoder); sliding-window layers are not compacted.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class KVCache:
    def __init__(self, batch_size: int, device: torch.device | str = "cpu", config=None):
        self.hf = DynamicCache(config=config) if config is not None else DynamicCache()
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [batch, slots]

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """[batch] number of valid tokens per row (= the next token's position)."""
        return self.valid.sum(1)

    def appended(self, valid_new: torch.Tensor) -> None:
        """Record that a forward just wrote one slot per new input; valid_new [batch, q]."""
        self.valid = torch.cat([self.valid, valid_new.to(self.valid.device)], dim=1)
        got = self.hf.get_seq_length()
        if got != self.num_slots:
            raise RuntimeError(f"KV cache holds {got} slots, expected {self.num_slots}")

    def keep_last(self, keep: torch.Tensor) -> None:
        """Set the validity of the last q slots (keep [batch, q]): the verdict of a step."""
        q = keep.shape[1]
        # Out of place: the mask may have been made under inference_mode.
        self.valid = torch.cat([self.valid[:, : self.num_slots - q], self.valid[:, self.num_slots - q :] & keep], 1)
        self._tidy()

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll each row back to its first lengths[b] valid tokens; lengths [batch]."""
        rank = self.valid.cumsum(1)  # [batch, slots]: 1-based rank of each valid slot
        self.valid = self.valid & (rank <= lengths.to(self.valid.device)[:, None])
        self._tidy()

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (e.g. drop finished sequences); rows [batch'] long."""
        if self.num_slots:
            self.hf.batch_select_indices(rows)
        self.valid = self.valid[rows]
        self._tidy()

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values), each [batch, kv_heads, slots, head_dim]: views of the storage
        (none while the cache is empty)."""
        return [(layer.keys, layer.values) for layer in self.hf.layers] if self.num_slots else []

    def load_layer_kv(self, keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor) -> None:
        """Give this empty cache these per-layer keys / values [batch, heads, slots, dim] and their
        validity [batch, slots] (used to stack and split sessions' caches: specdec.backends.kv_stack)."""
        layers = self.hf.layers
        if len(layers) != len(keys):  # a cache built without a config grows its layers on first use
            for idx, (k, v) in enumerate(zip(keys, values)):
                self.hf.update(k, v, idx)
        else:
            for layer, k, v in zip(layers, keys, values):
                if getattr(layer, "is_sliding", False):
                    raise NotImplementedError("loading sliding-window KV layers is not supported")
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
        self.valid = valid

    def compact(self) -> None:
        """Squeeze out every hole: each row's valid slots move to the front, in order."""
        lengths = self.lengths
        width = int(lengths.max()) if lengths.numel() else 0
        # Stable sort puts valid slots first in their original order.
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]  # [batch, width]
        for layer in self.hf.layers:
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.valid = torch.arange(width, device=self.valid.device)[None, :] < lengths[:, None]

    def _tidy(self) -> None:
        if self.num_slots == 0:
            return
        used = self.valid.any(0).nonzero()
        tail = self.num_slots - (int(used[-1]) + 1 if used.numel() else 0)
        if tail:
            self.hf.crop(-tail)
            self.valid = self.valid[:, : self.num_slots - tail]
        # Holes cost attention time and memory; squeeze them out once they are half the cache.
        if self.num_slots > 32 and int(self.lengths.max()) * 2 < self.num_slots:
            self.compact()


@torch.inference_mode()  # (a cache's tensors are inference tensors: compacting them in place needs it)
def snapshot_kv(cache: KVCache, n: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Copies of row 0's first n tokens' keys and values, per layer ([1, kv_heads, n, head_dim]
    each), and their size in bytes: what a prefix cache keeps (specdec.prefix_cache). The cache is
    compacted first (its valid slots moved to the front, in order; its contents unchanged)."""
    if n < 1 or n > int(cache.lengths[0]):
        raise ValueError(f"cannot snapshot {n} tokens of a row holding {int(cache.lengths[0])}")
    cache.compact()
    layers = [(k[:1, :, :n].clone(), v[:1, :, :n].clone()) for k, v in cache.layer_kv()]
    return layers, sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)


@torch.inference_mode()
def restore_kv(cache: KVCache, snapshot: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
    """Make an empty batch-1 cache hold the first n tokens of a snapshot_kv snapshot."""
    keys = [k[:, :, :n].clone() for k, _ in snapshot]
    values = [v[:, :, :n].clone() for _, v in snapshot]
    cache.load_layer_kv(keys, values, torch.ones(1, n, dtype=torch.bool, device=keys[0].device))

