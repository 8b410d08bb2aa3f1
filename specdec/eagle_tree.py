"""Dynamic draft trees for EAGLE drafts (EAGLE-2, Li et al. 2024): where the target verifies a
tree of n tokens at about the cost of a chain (a GPU at small batch), the draft spends its
guesses where it is confident instead of on a fixed shape.

Every drafted node has a score, the draft's log-probability of the path from the root to it
(the sum of its tokens' log-probabilities). Drafting goes depth by depth:

1. Depth 1: the root's `topk` likeliest tokens.
2. Each further depth: the `topk` best-scored nodes of the depth just drafted are *expanded*
   in one forward of the draft (each node reads its parent's predicted feature and its own
   token, and attends to the committed pairs and its own ancestors only: a tree mask), and each
   gets its `topk` likeliest children.
3. Of every node drafted, the `nodes` best-scored (up to `depth`) form the tree sent to the
   target. A node scores at most its parent (log-probabilities are <= 0; ties go to the
   shallower node), so the tree holds every chosen node's ancestors.

The greedy chain (each depth's top-1 token after the chain before it) is always expanded and
always in the tree: the tree's accepted path is never shorter than the chain's would have been.
Drafting reads nothing of the target's choice, so greedy verification of the tree (the longest
path whose tokens are the target's argmax) gives exactly the target's greedy output.
Greedy only: a sampled step drafts a chain (specdec.proposers.eagle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specdec.copy_tokens import CopyIndex
from specdec.eagle import ContextTokens, EagleDraft
from specdec.backends.fast import FastKVCache


@dataclass(frozen=True)
class DraftTree:
    """One row's tree: node tokens and parents (-1: the root, the last committed token) in an
    order where each parent comes before its children, and each node's depth (1 = a child of
    the root)."""

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]


def choose_nodes(scores: Sequence[float], parents: Sequence[int], depths: Sequence[int], chain: Sequence[int],
                 nodes: int, depth: int) -> list[int]:
    """Candidates (scores, parents: candidate index or -1, depths) -> the indices of the tree:
    the chain's candidates up to `depth`, then the best-scored others up to `depth` (ties: the
    shallower first) until `nodes` are chosen, ordered by depth (parents before children)."""
    chosen = [c for c in chain if depths[c] <= depth][:nodes]
    taken = set(chosen)
    order = sorted(range(len(scores)), key=lambda c: (-scores[c], depths[c], c))
    for c in order:
        if len(chosen) >= nodes:
            break
        if c not in taken and depths[c] <= depth and (parents[c] == -1 or parents[c] in taken):
            chosen.append(c)
            taken.add(c)
    return sorted(chosen, key=lambda c: (depths[c], c))


@torch.inference_mode()
def draft_trees(draft: EagleDraft, cache: FastKVCache, root_features: torch.Tensor, last_tokens: torch.Tensor,
                depths: Sequence[int], nodes: Sequence[int], topk: int,
                extra: Optional[ContextTokens] = None,
                copies: Optional[Sequence[CopyIndex]] = None) -> list[DraftTree]:
    """Dynamic trees for B rows (see the module's docstring): cache holds each row's committed
    pairs (the tree's nodes are appended and dropped again before returning), root_features
    [B, H] the draft's predicted feature at each row's last committed position, last_tokens [B]
    the last committed tokens; per row its tree's depth (>= 0) and node budget (>= depth);
    extra: a context_vocab draft's context tokens (EagleDraft.context_tokens); copies: a
    copy_token draft's per-row index of the committed tokens (each node's pair reads the copy
    candidate after its path, and that candidate is draftable among its children)."""
    batch = root_features.shape[0]
    max_depth = max(depths, default=0)
    if max_depth == 0:
        return [DraftTree((), (), ()) for _ in range(batch)]
    topk = min(topk, len(draft.token_ids))
    committed = cache.lengths.clone()  # [B] pairs before the tree
    first_tree_slot = cache.num_slots
    sees_committed = cache.valid.clone()  # [B, slots]
    # a copy_token draft also drafts each node's copy candidate (the one its children's pairs read)
    root_copies = None if copies is None else torch.tensor([index.candidate(()) for index in copies])
    ids, logp = draft.top_tokens(root_features, topk, extra, root_copies)  # [B, K]
    # Candidates per row, as lists: token, score, parent (candidate index, -1: root), depth.
    tok = [r.tolist() for r in ids.cpu()]
    score = [r.tolist() for r in logp.cpu()]
    parent = [[-1] * topk for _ in range(batch)]
    depth_of = [[1] * topk for _ in range(batch)]
    chain = [[0] for _ in range(batch)]  # the greedy chain's candidates
    slot_of: list[dict[int, int]] = [{} for _ in range(batch)]  # expanded candidate -> its cache slot
    feature_of: list[dict[int, torch.Tensor]] = [{} for _ in range(batch)]  # expanded candidate -> predicted f
    level = [list(range(topk)) for _ in range(batch)]  # candidates of the depth just drafted
    for d in range(1, max_depth):
        # The topk best of depth d's candidates (the chain's always among them) are expanded.
        frontier = []
        for b in range(batch):
            best = sorted(level[b], key=lambda c: (-score[b][c], c))
            pick = [chain[b][-1]] + [c for c in best if c != chain[b][-1]]
            frontier.append(pick[:topk])
        slots = cache.num_slots
        width = slots + topk
        sees = torch.zeros(batch, topk, slots, dtype=torch.bool)
        sees[:, :, : sees_committed.shape[1]] = sees_committed[:, None, :].cpu()
        feats = root_features.new_empty(batch, topk, root_features.shape[-1])
        in_ids = torch.empty(batch, topk, dtype=torch.long)
        prev_ids = torch.empty(batch, topk, dtype=torch.long)
        copy_ids = None if copies is None else torch.empty(batch, topk, dtype=torch.long)
        for b in range(batch):
            for j, c in enumerate(frontier[b]):
                p = parent[b][c]
                a = p
                while a != -1:  # the node's ancestors' slots
                    sees[b, j, slot_of[b][a]] = True
                    a = parent[b][a]
                feats[b, j] = root_features[b] if p == -1 else feature_of[b][p]
                in_ids[b, j] = tok[b][c]
                prev_ids[b, j] = int(last_tokens[b]) if p == -1 else tok[b][p]
                if copy_ids is not None:
                    path, a = [tok[b][c]], p
                    while a != -1:
                        path.append(tok[b][a])
                        a = parent[b][a]
                    copy_ids[b, j] = copies[b].candidate(path[::-1])
                slot_of[b][c] = slots + j
        positions = (committed[:, None].cpu() + d - 1).expand(batch, topk)
        out = draft.extend(cache, feats, in_ids, previous_ids=prev_ids, copy_ids=copy_ids, sees=sees,
                           positions=positions, block_mask=torch.eye(topk, dtype=torch.bool).expand(batch, topk, topk))
        assert cache.num_slots == width
        child_ids, child_logp = draft.top_tokens(out, topk, extra, copy_ids)  # [B, K, K]
        child_ids, child_logp = child_ids.cpu(), child_logp.cpu()
        for b in range(batch):
            level[b] = []
            for j, c in enumerate(frontier[b]):
                feature_of[b][c] = out[b, j]
                for i in range(topk):
                    level[b].append(len(tok[b]))
                    tok[b].append(int(child_ids[b, j, i]))
                    score[b].append(score[b][c] + float(child_logp[b, j, i]))
                    parent[b].append(c)
                    depth_of[b].append(d + 1)
                    if c == chain[b][-1] and i == 0:
                        chain[b].append(len(tok[b]) - 1)
    cache.valid = cache.valid[:, :first_tree_slot]  # drop the tree's slots
    cache.hf.crop(first_tree_slot)
    trees = []
    for b in range(batch):
        chosen = choose_nodes(score[b], parent[b], depth_of[b], chain[b], nodes[b], depths[b])
        index = {c: i for i, c in enumerate(chosen)}
        trees.append(DraftTree(tuple(tok[b][c] for c in chosen),
                               tuple(index[parent[b][c]] if parent[b][c] != -1 else -1 for c in chosen),
                               tuple(depth_of[b][c] for c in chosen)))
    return trees
