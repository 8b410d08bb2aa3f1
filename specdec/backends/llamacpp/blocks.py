"""Block masks as llama.cpp can run them (pure functions, for specdec.backends.llamacpp.model).

llama.cpp takes no attention mask: an input sees the cached entries of its sequence id at
positions up to its own. A causal chain needs nothing more. A tree could be expressed by giving
each leaf a sequence id and each input the ids of the leaves below it (llama.cpp's
`examples/speculative` does), which `block_parents` recognises; the backend refuses trees for now
(see specdec.backends.llamacpp.model). `kept_path_end` checks what a rollback keeps.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class NotATree(ValueError):
    """A block mask that sequence ids cannot express (some input sees a non-ancestor)."""


def block_parents(mask: Optional[torch.Tensor], n: int) -> list[int]:
    """The parent of each of n inputs (-1 for the first) from a block mask [n, n] bool (who may
    see whom, each input itself included); None means a chain. Raises NotATree when an input's
    visible set is not its parent's plus itself, or the first input is not the only root."""
    if mask is None:
        return list(range(-1, n - 1))
    seen = [frozenset(int(j) for j in torch.nonzero(mask[i, : i + 1]).flatten().tolist()) | {i} for i in range(n)]
    parents = []
    for i in range(n):
        before = seen[i] - {i}
        if any(j > i for j in torch.nonzero(mask[i]).flatten().tolist()):
            raise NotATree(f"input {i} sees a later input")
        if i == 0:
            if before:
                raise NotATree("the first input must see only itself")
            parents.append(-1)
            continue
        if not before:
            raise NotATree(f"input {i} sees no earlier input: a block has one root")
        parent = max(before, key=lambda j: len(seen[j]))
        if seen[parent] != before:
            raise NotATree(f"input {i} sees {sorted(before)}, not exactly the ancestors of input {parent}")
        parents.append(parent)
    return parents


def depths_of(parents: Sequence[int]) -> list[int]:
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def kept_path_end(parents: Sequence[int], keep: Sequence[bool]) -> int:
    """The deepest kept input when the kept inputs are a path from the first one (-1 when none
    is kept); ValueError for any other set (llama.cpp keeps a branch, not scattered entries)."""
    kept = [i for i, k in enumerate(keep) if k]
    if not kept:
        return -1
    depth = depths_of(parents)
    end = max(kept, key=lambda i: depth[i])
    path = []
    node = end
    while node >= 0:
        path.append(node)
        node = parents[node]
    if path[::-1] != kept:
        raise ValueError(f"kept inputs {kept} are not one path from the block's first input")
    return end
