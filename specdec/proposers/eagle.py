"""EAGLE proposer: a one-layer draft over the target's features drafts a chain of k tokens
(greedy, or sampled from each row's generator in ctx.generators with its draft_probs), see
specdec.eagle for the draft itself. Greedy, on a target that verifies trees at about the cost of
the chain (tree_nodes: a GPU), it drafts a dynamic tree instead (EAGLE-2, specdec.eagle_tree):
the draft's likeliest paths up to depth k, as many nodes as verifying costs at most
TREE_COST_MARGIN times the chain, the greedy chain always among them. Measured on the dev
prompts (`python -m specdec.training.eagle_eval --per-category 4 -k 4 --tree 4,64,8`, the shipped
draft): tau 1.50 for a 4-token chain, 1.92 for a 16-node tree, 2.11 for 32, 2.19 for 64.

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

How deep (the draft's confidence; `DepthChoice`): depth d of a chain has as its confidence the
draft's probability of the chain's tokens before d times its top probability at d. A table
(`ReachByConfidence`) keeps, per confidence bucket, how often drafted tokens of that confidence
were accepted, starting from the confidence itself. A token joins the block where, judged from
the chain up to it, a block holding it maximizes expected tokens per time on the target's
measured verify cost (costmodel.worth_including); the chain stops where no row's next token
could. So a CPU target verifies the likely tokens only, and a GPU one, whose forward over a few
tokens costs about one, the whole chain; k bounds the depth. Nothing about a token's own
choice decides whether it is sent, so a sampled chain stays exact.

Loading: env.config.eagle_dir, else the draft shipped for the target in
specdec/assets/eagle/<target name>/ (made by `specdec train eagle`). The method needs a loop that
hands proposers the target's features (env.gives_features, else FailedPrecondition): the
in-process one and the target service's Decode do (the draft reads the target's states, so it
runs beside the target, as Medusa's heads do, not in the draft service).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from specdec.copy_tokens import CopyIndex
from specdec.costmodel import VerifyCost, machine_identity, verify_cost_at, worth_including
from specdec.eagle import EagleDraft, load_eagle, shipped_eagle_path, step_cost
from specdec.eagle_tree import draft_trees
from specdec.errors import FailedPrecondition, ModelLoadError
from specdec.proposers.base import Proposer, ProposerEnv, ProposerFactory, register
from specdec.proposers.draft_model import DraftRows, draft_chain
from specdec.types import Proposal, ProposeContext, Verdict
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


# A tree replaces the chain only where a verification forward over the whole tree (nodes + 1
# tokens) costs at most this much more than over the chain (k + 1): a GPU, where a forward over
# 8-64 tokens costs about one; not a CPU, where it costs ~k single steps.
TREE_COST_MARGIN = 1.1
MAX_TREE_NODES = 64  # EAGLE-2's default tree is 60 nodes (for 7B-70B targets on A100s)
TREE_TOPK = 8  # candidates per expanded node, and nodes expanded per depth (EAGLE-2: 10)


def tree_nodes(v: Optional[VerifyCost], k: int, runs_trees: bool, reserve: int = 0,
               max_nodes: int = MAX_TREE_NODES) -> int:
    """The nodes of a k-deep tree: the most (up to max_nodes) whose verification, with `reserve`
    more nodes beside them (another proposer's branch), costs at most TREE_COST_MARGIN times
    the k-token chain's; k (the chain) where the target runs chains only (llama.cpp), its
    verify cost is unknown, or no tree fits."""
    if not runs_trees or v is None or k < 1:
        return k
    chain = verify_cost_at(v, k + 1)
    fits = [n for n in range(k + 1, max_nodes + 1) if verify_cost_at(v, n + reserve + 1) <= TREE_COST_MARGIN * chain]
    return max(fits, default=k)


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


class ReachByConfidence:
    """How often drafted tokens were accepted (with every token before them in their block), by
    the draft's confidence at their depth (see the module's docstring), in buckets: the chance
    the depth choice weighs. Each bucket starts from the middle
    of its confidence range as if `prior_weight` tokens had been judged (a calibrated draft's
    figure; the shipped one's measured 0.13 at confidence 0.1-0.2, 0.32 at 0.3-0.4, 0.42 at
    0.5-0.6 on the dev prompts), and halves its counts past `window`, so it follows what users
    send now. Shared by the proposers of one loaded draft."""

    EDGES = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

    def __init__(self, prior_weight: float = 8.0, window: float = 8192.0):
        self.prior_weight, self.window = prior_weight, window
        self._counts = [[0.0, 0.0] for _ in self.EDGES[:-1]]  # [accepted, judged]

    def bucket(self, confidence: float) -> int:
        return min(max(bisect.bisect_right(self.EDGES, confidence) - 1, 0), len(self._counts) - 1)

    def reach(self, confidence: float) -> float:
        b = self.bucket(confidence)
        accepted, judged = self._counts[b]
        prior = (self.EDGES[b] + self.EDGES[b + 1]) / 2
        return (accepted + prior * self.prior_weight) / (judged + self.prior_weight)

    def chain(self, confidences: Sequence[float]) -> list[float]:
        """The reach of each token of a chain (non-increasing: a token is accepted only after the ones before)."""
        out: list[float] = []
        for conf in confidences:
            out.append(min(self.reach(conf), out[-1] if out else 1.0))
        return out

    def record(self, confidences: Sequence[float], accepted: int) -> None:
        """A verified chain: its tokens' confidences and how many of them the target accepted."""
        for d, conf in enumerate(confidences):
            counts = self._counts[self.bucket(conf)]
            counts[0] += d < accepted
            counts[1] += 1
            if counts[1] > self.window:
                counts[0] /= 2
                counts[1] /= 2


@dataclass
class DepthChoice:
    """How deep a chain goes (see the module's docstring): c, the draft's cost per drafted token
    and v, the target's verify cost, both relative to one target step. Each token is judged
    from the chain up to it (costmodel.worth_including), never from the tokens after it, so a
    sampled chain stays exact. A first token found not worth verifying is still sent every
    `probe_every`-th time, so a draft less sure of itself than it is right can show it (the
    table learns only from what is verified)."""

    c: float
    v: VerifyCost
    reach: ReachByConfidence = field(default_factory=ReachByConfidence)
    probe_every: int = 8
    _passes: int = 0

    def include(self, confidences: Sequence[float], k: int) -> bool:
        """Whether the chain's last token so far (confidences: up to it) belongs in its block of at most k."""
        if worth_including(self.reach.chain(confidences), k, self.c, self.v):
            return True
        if len(confidences) == 1 and k > 0:
            self._passes += 1
            return self._passes % self.probe_every == 0
        return False

    def further(self, confidences: Sequence[float], k: int) -> bool:
        """Whether a next token could belong in the block (were it as likely as the last)."""
        return worth_including(self.reach.chain([*confidences, confidences[-1]]), k, self.c, self.v)


def greedy_chain(first: tuple[torch.Tensor, torch.Tensor],
                 feed: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], k_max: int,
                 enough: Optional[Callable[[torch.Tensor, torch.Tensor], bool]] = None) -> torch.Tensor:
    """draft_chain's greedy case over the tokens a draft can draft (EagleDraft.scores) rather than
    the vocabulary: from (ids [rows, m], logits [rows, m]) each row's likeliest token, then
    feed(tokens [rows]) -> the next (ids, logits), up to k_max >= 1 tokens. enough(logits,
    indexes [rows] into them), called after each token: True stops the chain there.
    -> tokens [rows, n], n <= k_max."""
    ids, logits = first
    drafted = []
    for step in range(k_max):
        best = logits.argmax(-1)  # [rows]
        drafted.append(ids.gather(-1, best[:, None])[:, 0])
        if (enough is not None and enough(logits, best)) or step + 1 == k_max:
            break
        ids, logits = feed(drafted[-1])
    return torch.stack(drafted, 1)


class EagleProposer(Proposer):
    name = "eagle"
    needs_features = True

    def __init__(self, draft: EagleDraft, rows: Optional[DraftRows] = None, verify_cost: Optional[VerifyCost] = None,
                 runs_trees: bool = False, depth: Optional[DepthChoice] = None):
        """rows: the state to draft on; None: the proposer's own, following each context's rows.
        verify_cost, runs_trees: the target's measured v(k) and whether it verifies trees; where
        a tree costs about what the chain does (tree_nodes), greedy steps draft a tree.
        depth: how deep each chain goes by the draft's confidence; None: k tokens."""
        self.draft = draft
        self.rows = rows if rows is not None else DraftRows.empty(draft, ())
        self.verify_cost, self.runs_trees, self.depth = verify_cost, runs_trees, depth
        self._confidences: list[list[float]] = []  # per row of the last chain: its kept tokens' confidences
        self._copies: dict[int, CopyIndex] = {}  # per row id: its committed tokens' n-grams (a copy_token draft's)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The target layers whose residuals the loop hands over beside the features (the draft's)."""
        return self.draft.tap_layers

    def copy_indexes(self, ctx: ProposeContext) -> Optional[list[CopyIndex]]:
        """A copy_token draft's: per row, the n-grams of its committed tokens (kept across steps,
        made again where a row's tokens are not those indexed and more); None for another draft."""
        if not self.draft.copy_token:
            return None
        kept = {}
        for row, toks in zip(ctx.row_ids, ctx.token_ids):
            index = self._copies.get(row)
            if index is None or len(index.ids) > len(toks) or index.ids != list(toks[: len(index.ids)]):
                index = CopyIndex()
            index.extend(toks[len(index.ids):])
            kept[row] = index
        self._copies = kept
        return [kept[row] for row in ctx.row_ids]

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
        # pair p = (f_p, t_{p+1}) for p = start..L-2 (and t_p, for a draft that reads it)
        feats, ids, valid = pad_pairs(ctx.target_features, [toks[s + 1 :] for toks, s in zip(ctx.token_ids, starts)])
        previous = copies = None
        if self.draft.previous_token:
            previous = pad_pairs(ctx.target_features, [toks[s:-1] for toks, s in zip(ctx.token_ids, starts)])[1]
        indexes = self.copy_indexes(ctx)
        if indexes is not None:  # pair p's candidate: for t_{p+2}, from t_0..t_{p+1}
            copies = pad_pairs(ctx.target_features, [index.candidates[s + 1 :] for index, s in zip(indexes, starts)])[1]
        hidden = self.draft.head.shape[1]  # a feature row: [f (H) ; the residuals after the draft's tap layers]
        predicted = self.draft.extend(rows.cache, feats[..., :hidden], ids, valid, previous_ids=previous,
                                      taps=feats[..., hidden:] if self.draft.tap_layers else None,
                                      copy_ids=copies)  # [rows, n, H]
        rows.tokens = [list(toks) for toks in ctx.token_ids]
        last = valid.sum(1) - 1  # [rows]
        return predicted[torch.arange(len(starts)), last.to(predicted.device)]

    def tree_budgets(self, ctx: ProposeContext) -> list[int]:
        """Per row, the nodes its step drafts (tree_nodes; k: a chain, always when sampling)."""
        return [tree_nodes(self.verify_cost, k, self.runs_trees, self.reserve_nodes(k)) if ctx.sampling.greedy else k
                for k in ctx.k]

    def reserve_nodes(self, k: int) -> int:
        """Nodes a k-deep tree leaves for branches added after drafting (none here)."""
        return 0

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
        extra = self.draft.context_tokens(ctx.token_ids)  # a context_vocab draft's context tokens
        predicted = [feature]
        before_tok = [torch.tensor([toks[-1] for toks in ctx.token_ids])]  # the token before the next pair's
        indexes = [self._copies[r] for r in ctx.row_ids] if self.draft.copy_token else None  # (catch_up's)
        paths: list[list[int]] = [[] for _ in ctx.k]  # per row: the tokens drafted so far
        # greedy: over the tokens the draft can draft only; sampling: the vocabulary's distributions
        score = self.draft.scores if ctx.sampling.greedy else self.draft.logits

        def feed(tok: torch.Tensor) -> torch.Tensor:
            copies = None
            if indexes is not None:
                for path, t in zip(paths, tok.tolist()):
                    path.append(int(t))
                copies = torch.tensor([[index.candidate(path)] for index, path in zip(indexes, paths)])
            predicted[0] = self.draft.extend(self.rows.cache, predicted[0][:, None], tok[:, None],
                                             previous_ids=before_tok[0][:, None], copy_ids=copies)[:, 0]
            before_tok[0] = tok
            return score(predicted[0], extra, None if copies is None else copies[:, 0])

        budgets = self.tree_budgets(ctx)
        if any(n > k for n, k in zip(budgets, ctx.k)):
            self._confidences = []
            last = torch.tensor([toks[-1] for toks in ctx.token_ids])
            trees = draft_trees(self.draft, self.rows.cache, feature, last, ctx.k, budgets, TREE_TOPK, extra,
                                indexes)
            return [Proposal(token_ids=t.token_ids, parents=t.parents if n > k else None)
                    for t, n, k in zip(trees, budgets, ctx.k)]
        # Depth d's confidence: the draft's probability of the chain's tokens before d times its
        # top probability at d, known before d's token is chosen (so judging d by it reads nothing of d).
        before = torch.ones(len(ctx.k))  # [rows]
        confidences: list[list[float]] = [[] for _ in ctx.k]  # per row: per depth drafted
        kept = [0] * len(ctx.k)  # per row: tokens that belong in its block so far

        def enough(logits: torch.Tensor, chosen: torch.Tensor) -> bool:  # chosen [rows]: indexes into logits
            nonlocal before
            probs = torch.softmax(logits.float(), -1)
            for conf, c in zip(confidences, (before * probs.max(-1).values.cpu()).tolist()):
                conf.append(c)
            before = before * probs.gather(-1, chosen[:, None].to(probs.device))[:, 0].cpu()
            for b, (conf, k) in enumerate(zip(confidences, ctx.k)):
                if kept[b] == len(conf) - 1 and (self.depth is None or self.depth.include(conf, k)):
                    kept[b] = min(len(conf), k)
            return self.depth is not None and not any(kept[b] == len(conf) and self.depth.further(conf, k)
                                                      for b, (conf, k) in enumerate(zip(confidences, ctx.k)))

        # a copy_token draft drafts its copy candidate too, where it is outside the subset
        first_copies = None if indexes is None else torch.tensor([index.candidate(()) for index in indexes])
        if ctx.sampling.greedy:
            tokens, draft_probs = greedy_chain(score(feature, extra, first_copies), feed, k_max, enough), None
        else:
            tokens, draft_probs = draft_chain(score(feature, extra, first_copies), feed, k_max, ctx.sampling,
                                              ctx.generators, enough)
        tokens = tokens.cpu()  # [rows, n]
        self._confidences = [conf[:n] for conf, n in zip(confidences, kept)]
        return [Proposal(token_ids=tuple(tokens[b, :n].tolist()),
                         draft_probs=None if draft_probs is None or n == 0 else draft_probs[b, :n])
                for b, n in enumerate(kept)]

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        """Chains only: how many tokens of each confidence the target accepted (the depth choice's table)."""
        if self.depth is not None and self._confidences:
            for conf, v in zip(self._confidences, verdicts):
                self.depth.reach.record(conf, v.num_accepted)
        self._confidences = []  # (a step the loop runs without asking for a proposal has none)


def eagle_for_target(target, eagle_dir: Optional[str]) -> EagleDraft:
    """The EAGLE draft in eagle_dir, else the one shipped for the target; a mismatch is refused."""
    path = Path(eagle_dir) if eagle_dir else shipped_eagle_path(target.name)
    if path is None:
        raise ModelLoadError(f"no EAGLE draft ships for target {target.name!r}: train one with "
                             "`specdec train eagle --out DIR` and pass it with --eagle DIR")
    draft = load_eagle(path, target)
    if draft.tap_layers and not getattr(target, "returns_taps", False):
        raise FailedPrecondition(f"EAGLE draft {path} reads the target's residuals after layers "
                                 f"{list(draft.tap_layers)}; the {target.backend} backend does not return them: "
                                 "run the target on the fast backend (--backend fast)")
    return draft


def eagle_parts(env: ProposerEnv) -> tuple[EagleDraft, Optional[VerifyCost], Optional[DepthChoice]]:
    """What EAGLE's proposers share, loaded once: the draft, the target's verify cost (measured,
    or read, once here; none without a cost store) and the depth choice (none without a verify
    cost, or where env.config.eagle_depth is "k": k tokens)."""
    if not env.gives_features:
        raise FailedPrecondition("method eagle reads the target's features at every committed position, which "
                                 "this decoding loop does not hand to proposers (specdec's in-process loop does)")
    draft = eagle_for_target(env.target, env.config.eagle_dir)
    v = env.costs.verify_cost(env.target) if env.costs is not None else None
    depth = None
    if v is not None and env.config.eagle_depth == "auto":
        depth = DepthChoice(eagle_cost(env.costs, draft, env.target, env.config.eagle_dir), v)
    return draft, v, depth


@register("eagle")
def _load(env: ProposerEnv) -> ProposerFactory:
    """The draft is loaded once; each request or session gets a proposer with its own rows."""
    draft, v, depth = eagle_parts(env)
    return lambda: EagleProposer(draft, verify_cost=v, runs_trees=env.target.runs_trees, depth=depth)


def eagle_cost(costs, draft: EagleDraft, target, eagle_dir: Optional[str]) -> float:
    """c of the EAGLE draft against the target on this machine (specdec.eagle.step_cost), kept
    in the cost store under the draft and how it drafts."""
    key = {"figure": "eagle_cost", "machine": machine_identity(target.device), "model": target.cost_identity(),
           "eagle": eagle_dir or "shipped", "drafting": draft.cost_identity()}
    return float(costs.figure(key, "the EAGLE draft's cost against the target", lambda: step_cost(draft, target)))
