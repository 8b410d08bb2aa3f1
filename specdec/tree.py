"""Candidate trees as data: parent indices -> attention mask, depths, and the greedy walk.

Node numbering: index 0 is the *root*, the last committed token (fed again so the target
scores what follows it); drafted node i is index i + 1, and `parents[i]` is the parent's
node index among the drafted nodes, -1 for the root. A chain is parents = (-1, 0, 1, ...).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def chain_parents(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def block_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n + 1, n + 1] bool: entry [i, j] is True when block index i may attend to index j
    (j is i itself or one of its ancestors, the root included)."""
    n = len(parents)
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return mask


def depths(parents: Sequence[int]) -> torch.Tensor:
    """[n + 1] long: the position offset of each block index from the root (root = 0)."""
    out = [0]
    for p in parents:
        out.append(out[p + 1] + 1)
    return torch.tensor(out, dtype=torch.long)


def greedy_walk(
    token_ids: Sequence[int], parents: Optional[Sequence[int]], target_argmax: Sequence[int]
) -> tuple[list[int], int]:
    """Follow the target's argmax down the tree.

    token_ids [n] drafted nodes, parents [n] (None: a chain), target_argmax [n + 1] (block index
    order: 0 is the root). Returns (accepted drafted-node indices along the path, next token).
    """
    if parents is None:
        parents = chain_parents(len(token_ids))
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    path: list[int] = []
    node = -1
    while True:
        want = int(target_argmax[node + 1])
        nxt = next((c for c in children.get(node, ()) if token_ids[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt
