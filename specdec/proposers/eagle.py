"""EAGLE proposer: a one-layer draft over the target's features drafts a chain of k tokens
(greedy, or sampled from each row's generator in ctx.generators with its draft_probs), see
specdec.eagle for the draft itself. Greedy, on a target that verifies trees at about the cost of
the chain (tree_width: a GPU), each depth's next-best tokens join the chain as siblings (leaves),
so a depth the chain gets wrong can still be accepted from its second or third choice.

State per row (a `DraftRows`, so rows leave as they finish, as the draft model's do): the
draft's KV cache of (feature, token) pairs and the committed tokens its *true* pairs stand for
(pairs 0..len - 2: the feature f_p is the target's, the token t_{p+1} committed). Each step:

1. The context brings the target's features of the committed positions not given before
   (ctx.target_features; needs_features): positions start..L-2 for L committed tokens. The row
   is rolled back to its first `start` pairs (the pairs drafted last step used the draft's own
   predicted features and are dropped; so are true pairs from `start` on, if the features of
   a position come again), and the pairs start..L-2 are fed in one forward: its last output is
   the predicted f^_{L-1}, whose logits give the first drafted token.
2. Each further token: the pair (f^, d) of the draft's own prediction and the token just
   drafted, one forward per step (EAGLE: the predicted feature stands in for the true one).

The rows must have been given every feature before `start` (they are, in speculative_generate):
a context whose features leave a gap, or whose tokens before `start` differ from the row's, is
refused (ValueError), since the draft cannot compute the target's features itself.

Loading: env.config.eagle_dir, else the draft shipped for the target in
specdec/assets/eagle/<target name>/ (made by `specdec train eagle`). The method needs a loop that
hands proposers the target's features (env.gives_features, else FailedPrecondition): the
in-process one and the target service's Decode do (the draft reads the target's states, so it
runs beside the target, as Medusa's heads do, not in the draft service).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from specdec.costmodel import VerifyCost, verify_cost_at
from specdec.eagle import EagleDraft, load_eagle, shipped_eagle_path
from specdec.errors import FailedPrecondition, ModelLoadError
from specdec.proposers.base import Proposer, ProposerEnv, ProposerFactory, register
from specdec.proposers.draft_model import DraftRows, draft_chain
from specdec.types import Proposal, ProposeContext
from specdec.verify import common_prefix_len


def feature_start(row_tokens: Sequence[int], committed: Sequence[int], n_features: int) -> int:
    """The first position of the n_features features given for `committed` (they end at
    len(committed) - 2), checked against the tokens a row holds true pairs for (row_tokens:
    pairs 0..len - 2, or none). Raises ValueError where the features leave a gap or the tokens
    before them differ."""
    start = len(committed) - 1 - n_features
    held = max(len(row_tokens) - 1, 0)  # true pairs the row holds
    if n_features < 1 or start < 0:
        raise ValueError(f"eagle: {n_features} features for {len(committed)} committed tokens "
                         f"(need 1..{len(committed) - 1})")
    if start > 0 and (start > held or common_prefix_len(row_tokens, committed) < start + 1):
        raise ValueError(f"eagle: features from position {start} do not continue the {held} positions this "
                         "proposer holds (every committed position's feature must be handed over once)")
    return start


# Siblings join the chain only where a verification forward over the whole tree (k * width + 1
# tokens) costs at most this much more than over the chain (k + 1): a GPU, where a forward over
# 8-64 tokens costs about one; not a CPU, where it costs ~k single steps.
TREE_COST_MARGIN = 1.1
MAX_WIDTH = 3


def tree_width(v: Optional[VerifyCost], k: int, runs_trees: bool, max_width: int = MAX_WIDTH) -> int:
    """Candidates per drafted depth (the top-1 the chain goes on from, and width - 1 siblings):
    the widest whose tree costs at most TREE_COST_MARGIN times the chain to verify; 1 (a chain)
    where the target runs chains only (llama.cpp) or its verify cost is unknown."""
    if not runs_trees or v is None or k < 1:
        return 1
    chain = verify_cost_at(v, k + 1)
    return max(w for w in range(1, max_width + 1) if w == 1 or verify_cost_at(v, k * w + 1) <= TREE_COST_MARGIN * chain)


def side_branches(chain: Sequence[int], siblings: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The chain [k] and, per depth d, the alternatives to chain[d] -> (token ids, parents) of the
    tree, depth by depth: the chain token, then its siblings, all children of the chain token
    one depth up (-1: the root). Siblings are leaves: the draft only goes on from the chain."""
    ids: list[int] = []
    parents: list[int] = []
    up = -1
    for tok, alternatives in zip(chain, siblings):
        here = len(ids)
        for t in (tok, *alternatives):
            ids.append(int(t))
            parents.append(up)
        up = here
    return tuple(ids), tuple(parents)


def pad_pairs(features: Sequence[torch.Tensor], tokens: Sequence[Sequence[int]]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of pairs of different lengths (features[b] [n_b, H], tokens[b] [n_b]) -> right-padded
    (features [B, n, H], token ids [B, n], valid [B, n])."""
    n = max(len(t) for t in tokens)
    feats = features[0].new_zeros(len(tokens), n, features[0].shape[-1])
    ids = torch.zeros(len(tokens), n, dtype=torch.long)
    valid = torch.zeros(len(tokens), n, dtype=torch.bool)
    for b, (f, t) in enumerate(zip(features, tokens)):
        feats[b, : len(t)] = f
        ids[b, : len(t)] = torch.tensor(list(t), dtype=torch.long)
        valid[b, : len(t)] = True
    return feats, ids, valid


class EagleProposer(Proposer):
    name = "eagle"
    needs_features = True

    def __init__(self, draft: EagleDraft, rows: Optional[DraftRows] = None, verify_cost: Optional[VerifyCost] = None,
                 runs_trees: bool = False):
        """rows: the state to draft on; None: the proposer's own, following each context's rows.
        verify_cost, runs_trees: the target's measured v(k) and whether it verifies trees; where
        a tree costs about what the chain does (tree_width), greedy steps add siblings."""
        self.draft = draft
        self.rows = rows if rows is not None else DraftRows.empty(draft, ())
        self.verify_cost, self.runs_trees = verify_cost, runs_trees

    @torch.inference_mode()
    def catch_up(self, ctx: ProposeContext) -> torch.Tensor:
        """Roll each row back to its true pairs before the new features and feed the new pairs
        -> the predicted feature at each row's last committed position [rows, H]."""
        if ctx.target_features is None:
            raise ValueError("the eagle proposer needs the target's features (needs_features)")
        rows = self.rows
        rows.follow(self.draft, ctx.row_ids)
        starts = [feature_start(held, toks, len(f))
                  for held, toks, f in zip(rows.tokens, ctx.token_ids, ctx.target_features)]
        rows.cache.truncate(torch.tensor(starts))
        # pair p = (f_p, t_{p+1}) for p = start..L-2
        feats, ids, valid = pad_pairs(ctx.target_features, [toks[s + 1 :] for toks, s in zip(ctx.token_ids, starts)])
        predicted = self.draft.extend(rows.cache, feats, ids, valid)  # [rows, n, H]
        rows.tokens = [list(toks) for toks in ctx.token_ids]
        last = valid.sum(1) - 1  # [rows]
        return predicted[torch.arange(len(starts)), last.to(predicted.device)]

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        if not ctx.sampling.greedy and ctx.generators is None:
            raise ValueError("a sampling draft needs ctx.generators (one per row)")
        # 1. Roll back to the true pairs; feed the new ones (every row, even one drafting nothing now).
        feature = self.catch_up(ctx)  # [rows, H]
        k_max = max(ctx.k, default=0)
        if k_max == 0:
            return [Proposal() for _ in ctx.row_ids]
        # 2. Draft k_max tokens for every row, each from the draft's own predicted feature.
        predicted = [feature]

        def feed(tok: torch.Tensor) -> torch.Tensor:
            predicted[0] = self.draft.extend(self.rows.cache, predicted[0][:, None], tok[:, None])[:, 0]
            return self.draft.logits(predicted[0])

        widths = [tree_width(self.verify_cost, k, self.runs_trees) if ctx.sampling.greedy else 1 for k in ctx.k]
        if max(widths) > 1:
            return self._tree(self.draft.logits(feature), feed, ctx.k, widths)
        tokens, draft_probs = draft_chain(self.draft.logits(feature), feed, k_max, ctx.sampling, ctx.generators)
        tokens = tokens.cpu()  # [rows, k_max]
        return [Proposal(token_ids=tuple(tokens[b, :k].tolist()),
                         draft_probs=None if draft_probs is None or k == 0 else draft_probs[b, :k])
                for b, k in enumerate(ctx.k)]

    @staticmethod
    def _tree(logits: torch.Tensor, feed, ks: Sequence[int], widths: Sequence[int]) -> list[Proposal]:
        """Greedy: the argmax chain, each depth's next-best tokens beside it (side_branches)."""
        chain, alternatives, depth_max, width_max = [], [], max(ks), max(widths)
        for depth in range(depth_max):
            top = logits.topk(width_max, dim=-1).indices.cpu()  # [rows, width], best first
            chain.append(top[:, 0])
            alternatives.append(top[:, 1:])
            if depth + 1 < depth_max:
                logits = feed(top[:, 0].to(logits.device))
        out = []
        for b, (k, w) in enumerate(zip(ks, widths)):
            ids, parents = side_branches([int(chain[d][b]) for d in range(k)],
                                         [alternatives[d][b, : w - 1].tolist() for d in range(k)])
            out.append(Proposal(token_ids=ids, parents=parents if w > 1 else None))
        return out


def eagle_for_target(target, eagle_dir: Optional[str]) -> EagleDraft:
    """The EAGLE draft in eagle_dir, else the one shipped for the target; a mismatch is refused."""
    path = Path(eagle_dir) if eagle_dir else shipped_eagle_path(target.name)
    if path is None:
        raise ModelLoadError(f"no EAGLE draft ships for target {target.name!r}: train one with "
                             "`specdec train eagle --out DIR` and pass it with --eagle DIR")
    return load_eagle(path, target)


@register("eagle")
def _load(env: ProposerEnv) -> ProposerFactory:
    """The draft is loaded once; each request or session gets a proposer with its own rows."""
    if not env.gives_features:
        raise FailedPrecondition("method eagle reads the target's features at every committed position, which "
                                 "this decoding loop does not hand to proposers (specdec's in-process loop does)")
    draft = eagle_for_target(env.target, env.config.eagle_dir)
    # (the verify cost only matters where the target verifies trees: measured, or read, once here)
    v = env.costs.verify_cost(env.target) if env.target.runs_trees and env.costs is not None else None
    return lambda: EagleProposer(draft, verify_cost=v, runs_trees=env.target.runs_trees)
