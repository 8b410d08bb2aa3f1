"""Candidate trees as data: parent indices -> attention mask, depths, and the greedy walk.

Node numbering: index 0 is the *root*, the last committed token (fed again so the target
scores what follows it); drafted node i is index i + 1, and `parents[i]` is the parent's
node index among the drafted nodes, -1 for the root. A chain is parents = (-1, 0, 1, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def chain_parents(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def graft_chain(token_ids: Sequence[int], parents: Optional[Sequence[int]], chain: Sequence[int]
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tree with `chain` added as a path from the root: it follows the nodes already there
    with the chain's tokens (a shared prefix is not repeated) and appends the rest, each a child
    of the one before -> (token ids, parents). parents None: a chain."""
    ids = list(token_ids)
    ups = list(chain_parents(len(ids)) if parents is None else parents)
    node = -1
    for tok in chain:
        here = next((i for i, p in enumerate(ups) if p == node and ids[i] == tok), None)
        if here is None:
            ids.append(int(tok))
            ups.append(node)
            here = len(ids) - 1
        node = here
    return tuple(ids), tuple(ups)


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


# --- Medusa-style trees: a list of paths compiled once into index buffers ---------------------
#
# A path (r0, r1, ..., rd) names the node reached by taking candidate r0 (0 = best) of head 0,
# then candidate r1 of head 1, and so on: Medusa's `medusa_choices`. Every proper prefix of a
# path must be in the list too, so the paths form a tree under the root.


@dataclass(frozen=True)
class CompiledTree:
    paths: tuple[tuple[int, ...], ...]  # [n] node i's path, sorted by (depth, path)
    parents: tuple[int, ...]  # [n] parent node index, -1 for the root (the Proposal's `parents`)
    head: tuple[int, ...]  # [n] which head drafts node i (= its depth - 1)
    rank: tuple[int, ...]  # [n] which of that head's top candidates node i takes
    mask: torch.Tensor  # [n + 1, n + 1] bool block attention mask (block index 0 is the root)
    depth: torch.Tensor  # [n + 1] long position offsets from the root
    retrieve: torch.Tensor  # [leaves, max_depth + 1] long block indices root..leaf per leaf, -1 padded

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    def top_needed(self) -> int:
        """How many top candidates per head the tree reads (the largest rank + 1)."""
        return max(self.rank, default=-1) + 1

    def pruned(self, max_depth: int) -> "CompiledTree":
        """The same tree without the nodes deeper than max_depth."""
        if max_depth >= self.max_depth:
            return self
        return compile_tree([p for p in self.paths if len(p) <= max_depth])


def compile_tree(paths: Sequence[Sequence[int]]) -> CompiledTree:
    """Paths (any order) -> CompiledTree. Raises ValueError on an empty path, a negative rank,
    a duplicate, or a path whose parent path is missing."""
    norm = [tuple(int(r) for r in p) for p in paths]
    for p in norm:
        if not p or any(r < 0 for r in p):
            raise ValueError(f"tree path {list(p)} must be a non-empty list of ranks >= 0")
    if len(set(norm)) != len(norm):
        raise ValueError("tree paths contain a duplicate")
    ordered = sorted(norm, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(ordered)}
    parents = []
    for p in ordered:
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    has_child = {q for q in parents if q >= 0}
    max_d = max((len(p) for p in ordered), default=0)
    rows = []
    for i in range(len(ordered)):
        if i in has_child:
            continue
        chain, node = [], i
        while node >= 0:
            chain.append(node + 1)
            node = parents[node]
        chain = [0] + chain[::-1]
        rows.append(chain + [-1] * (max_d + 1 - len(chain)))
    retrieve = torch.tensor(rows, dtype=torch.long).reshape(len(rows), max_d + 1)
    return CompiledTree(paths=tuple(ordered), parents=tuple(parents), head=tuple(len(p) - 1 for p in ordered),
                        rank=tuple(p[-1] for p in ordered), mask=block_mask(parents), depth=depths(parents),
                        retrieve=retrieve)


def chain_tree(length: int) -> list[tuple[int, ...]]:
    """The top-1 chain: [(0,), (0, 0), ...]."""
    return [(0,) * d for d in range(1, length + 1)]


def expected_accept_length(paths: Sequence[Sequence[int]], accuracy: Sequence[Sequence[float]]) -> float:
    """Expected accepted tokens per step if head i's rank-r candidate is right with probability
    accuracy[i][r], independently (Medusa's tree-construction model): the sum, over nodes, of the
    product of the accuracies along the node's path."""
    total = 0.0
    for p in paths:
        prob = 1.0
        for depth, r in enumerate(p):
            prob *= accuracy[depth][r] if depth < len(accuracy) and r < len(accuracy[depth]) else 0.0
        total += prob
    return total


def greedy_tree(accuracy: Sequence[Sequence[float]], size: int) -> list[tuple[int, ...]]:
    """The size-node tree maximizing expected_accept_length, built greedily: add the frontier
    node whose path is most likely accepted (each node's value is at most its parent's, so
    the greedy choice is optimal for this model). accuracy[i][r]: head i, rank r."""
    import heapq

    heap = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))] if accuracy else []
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < size:
        neg, path = heapq.heappop(heap)
        out.append(path)
        d = len(path)
        if d < len(accuracy):
            for r in range(len(accuracy[d])):
                heapq.heappush(heap, (neg * accuracy[d][r], path + (r,)))
    return out


def best_tree_for_cost(accuracy: Sequence[Sequence[float]], cost, max_nodes: int = 16) -> list[tuple[int, ...]]:
    """The greedy tree whose size maximizes predicted speed-up, (1 + expected accepted tokens) /
    cost(nodes + 1): `cost(m)` is the verify cost of a forward over m tokens relative to one over
    a single token (the measured curve of the hardware the target runs on). On a GPU, where cost
    stays ~1 for dozens of tokens, this grows wide trees; on a CPU, where it does not, small ones."""
    if max_nodes < 1:
        raise ValueError("max_nodes must be >= 1")
    best, best_score = greedy_tree(accuracy, 1), -1.0
    for n in range(1, max_nodes + 1):
        paths = greedy_tree(accuracy, n)
        if len(paths) < n:
            break  # the heads offer no more candidates
        score = (1.0 + expected_accept_length(paths, accuracy)) / cost(n + 1)
        if score > best_score + 1e-9:
            best, best_score = paths, score
    return best
