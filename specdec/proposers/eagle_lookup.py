"""EAGLE with prompt lookup beside it (method "eagle-lookup"). Each greedy step, a row whose
context ends in an n-gram met earlier in it has two chains to send: the tokens that followed the
match (free to make) and EAGLE's (its depth chosen by confidence, see specdec.proposers.eagle).
The one with the higher expected tokens per time on the target's measured verify cost goes
(costmodel.block_rate), each weighed by its own measured acceptance: lookup's by how far back
its match goes and by depth, EAGLE's per confidence. Summaries, RAG answers and edits copy their
prompt, where lookup is right far more often than a small draft; elsewhere EAGLE drafts.

Both tables learn from every greedy step, whichever chain was sent: the tokens a step emits are
the target's own, so comparing the chain left unsent with them says what verifying it would have
found, up to the emitted tokens' length (`judged_by`). Lookup's acceptance is kept per request
too, starting from the shared table: how much a request copies is its own (a translation copies
names and numbers, a chat answer almost nothing), and a request that has shown it is told apart.

Where every row's lookup chain promises more than EAGLE's chain at its last step did, EAGLE's
step is skipped (its chain would most likely not be sent, and drafting it costs a draft forward
over the new positions and one token), and the target's features of that step are kept for its
next one.

Where the target verifies a tree at about a chain's cost (a GPU: EAGLE then drafts a tree, see
tree_nodes), lookup's chain is not weighed against EAGLE's but grafted onto its tree as one more
branch (`tree.graft_chain`): EAGLE's tree leaves k nodes of its budget for it (reserve_nodes),
so the tree with the branch stays within the cost margin, and the target checks both in one
forward and keeps whichever path it agrees with.

Sampling rows send EAGLE's chain alone: choosing between the two by figures of a sampled chain
would bias what it samples. Without a verify cost to weigh them by (no cost store, or
eagle_depth "k"), it drafts as EAGLE does. EAGLE's state follows whatever chain was verified
(it is handed the target's features of the accepted tokens either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

from specdec.costmodel import block_rate, tokens_worth_verifying, verify_cost_at
from specdec.proposers.base import ProposerEnv, ProposerFactory, register
from specdec.proposers.eagle import TREE_COST_MARGIN, EagleProposer, eagle_parts
from specdec.proposers.prompt_lookup import longest_match
from specdec.tree import graft_chain
from specdec.types import Proposal, ProposeContext, Verdict


def judged_by(chain: Sequence[int], emitted: Sequence[int]) -> tuple[int, int]:
    """What verifying `chain` would have judged, as far as the tokens a greedy step emitted (the
    target's own) tell: (drafted, accepted) as Verdict counts them, where a chain that agrees with
    every emitted token counts only those (whether its next token would have been accepted is
    not known)."""
    m = 0
    while m < len(chain) and m < len(emitted) and chain[m] == emitted[m]:
        m += 1
    if m < len(chain) and m < len(emitted):
        return m + 1, m  # the target emitted something else at m
    return m, m


class RowTables:
    """One table per row, made by `make`, following the rows asked for as DraftRows does: a row's
    table is kept while the row goes on; a new set of sequences starts new tables."""

    def __init__(self, make):
        self.make = make
        self.tables: dict = {}

    def follow(self, row_ids: Sequence[int]) -> list:
        """The tables of row_ids, in order."""
        if tuple(self.tables) == tuple(row_ids):  # the same rows as the last step (most steps)
            return list(self.tables.values())
        if not set(row_ids) <= set(self.tables):
            self.tables = {}
        self.tables = {r: self.tables[r] if r in self.tables else self.make() for r in row_ids}
        return [self.tables[r] for r in row_ids]


class LookupReach:
    """How often prompt lookup's drafted tokens were accepted, by the length of the match the
    continuation followed (a span being copied matches far back; a phrase met by chance, over a
    few tokens) and by depth: per depth d, the rate at which token d was accepted where every
    token before it was (a copy tends to go on, so deeper tokens are accepted more often than the
    first; a geometric rate would cut such chains short). Each rate starts from its bucket's
    `PRIOR`, or from `parent`'s rate where it has one (a request's table over the shared one; what
    it records goes to the parent too), as if `prior_weight` tokens had been judged; halved past
    `window`."""

    BUCKETS = (1, 2, 3, 4, 6, 9, 16)  # lower bounds of the match lengths of each bucket
    PRIOR = (0.15, 0.3, 0.45, 0.55, 0.65, 0.75, 0.85)  # a first guess per bucket; what is measured here takes over

    def __init__(self, depths: int = 16, prior_weight: float = 4.0, window: float = 4096.0,
                 parent: Optional["LookupReach"] = None):
        self.prior_weight, self.window, self.parent = prior_weight, window, parent
        # per bucket, per depth [accepted, judged]
        self._counts = [[[0.0, 0.0] for _ in range(depths)] for _ in self.BUCKETS]

    def bucket(self, match: int) -> int:
        return max((i for i, lo in enumerate(self.BUCKETS) if match >= lo), default=0)

    def alpha(self, match: int, depth: int = 0) -> float:
        """The rate at which a token `depth` deep after a match this long is accepted where the ones before it were."""
        b = self.bucket(match)
        rows = self._counts[b]
        accepted, judged = rows[min(depth, len(rows) - 1)]
        prior = self.PRIOR[b] if self.parent is None else self.parent.alpha(match, depth)
        return (accepted + prior * self.prior_weight) / (judged + self.prior_weight)

    def chain(self, match: int, length: int) -> list[float]:
        """The reach of each of `length` tokens following a match this long (every one before accepted too)."""
        out, reach = [], 1.0
        for d in range(length):
            reach *= self.alpha(match, d)
            out.append(reach)
        return out

    def judged(self) -> float:
        """Tokens judged so far (halvings included)."""
        return sum(c[1] for rows in self._counts for c in rows)

    def record(self, match: int, drafted: int, accepted: int) -> None:
        rows = self._counts[self.bucket(match)]
        for d in range(min(drafted, accepted + 1)):  # the accepted ones and the first rejected
            counts = rows[min(d, len(rows) - 1)]
            counts[0] += d < accepted
            counts[1] += 1
            if counts[1] > self.window:
                counts[0] /= 2
                counts[1] /= 2
        if self.parent is not None:
            self.parent.record(match, drafted, accepted)


@dataclass
class _Row:
    """What eagle-lookup keeps per row: lookup's acceptance for it, the target's features handed
    over while EAGLE's step was skipped, and the block rate of EAGLE's chain at its last step."""

    table: LookupReach
    pending: list = field(default_factory=list)
    eagle_rate: Optional[float] = None


def _lookup_block(table: LookupReach, match: int, cont: tuple[int, ...], v) -> tuple[int, float]:
    """Lookup's chain: how many of its tokens to send and the block rate of sending them (0, 0.0: none)."""
    if not cont:
        return 0, 0.0
    reach = table.chain(match, len(cont))
    keep = tokens_worth_verifying(reach, 0.0, v)
    return keep, block_rate(reach[:keep], 0.0, v) if keep else 0.0


class EagleLookupProposer(EagleProposer):
    name = "eagle-lookup"

    def __init__(self, *args, lookup: Optional[LookupReach] = None, max_ngram: int = 3, **kwargs):
        """As EagleProposer; lookup: the acceptance table of lookup's chains shared by the proposers
        of one draft, which each row's own table starts from."""
        super().__init__(*args, **kwargs)
        self.lookup = lookup if lookup is not None else LookupReach()
        self._state = RowTables(lambda: _Row(LookupReach(parent=self.lookup)))  # each row's own
        self.skipped = 0  # steps whose EAGLE step was skipped (lookup's chain sure to go)
        self.max_ngram = max_ngram
        # per row of the last proposal: lookup's (match length, chain), (0, ()) where none
        self._lookups: list[tuple[int, tuple[int, ...]]] = []
        # per row of the last proposal where lookup's chain was sent: EAGLE's (tokens, confidences)
        self._unsent: dict[int, tuple[tuple[int, ...], list[float]]] = {}
        self._rows: list[_Row] = []  # per row of the last proposal: its state

    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        self._lookups, self._unsent = [], {}
        rows = self._state.follow(ctx.row_ids)
        greedy = ctx.sampling.greedy and self.depth is not None
        if greedy:
            v = self.depth.v
            self._lookups = [longest_match(toks, k, self.max_ngram) for toks, k in zip(ctx.token_ids, ctx.k)]
            self._rows = rows
            blocks = [_lookup_block(row.table, match, cont, v) for row, (match, cont) in zip(rows, self._lookups)]
            if self._skips_eagle(ctx, rows, blocks):
                for row, features in zip(rows, ctx.target_features):
                    row.pending.append(features)  # handed to EAGLE at its next step
                self._confidences, self.skipped = [], self.skipped + 1
                return [Proposal(token_ids=cont[:keep]) for (_, cont), (keep, _) in zip(self._lookups, blocks)]
        if ctx.target_features is not None and any(row.pending for row in rows):
            ctx = replace(ctx, target_features=tuple(torch.cat([*row.pending, f]) for row, f in
                                                     zip(rows, ctx.target_features)))
            for row in rows:
                row.pending = []
        proposals = super().propose(ctx)
        if not greedy:
            return proposals
        if not self._confidences:  # trees (a target that verifies a few more tokens at about a chain's cost)
            return [self._with_branch(p, cont, k) for p, (_, cont), k in zip(proposals, self._lookups, ctx.k)]
        for b, ((_, cont), (keep, rate), row) in enumerate(zip(self._lookups, blocks, rows)):
            eagle = self.depth.reach.chain(self._confidences[b])  # (its drafting is spent: no c)
            row.eagle_rate = block_rate(eagle, 0.0, v)
            if keep and rate > row.eagle_rate:
                self._unsent[b] = (proposals[b].token_ids, self._confidences[b])
                proposals[b] = Proposal(token_ids=cont[:keep])
                self._confidences[b] = []  # (EAGLE's table learns from its unsent chain in observe)
        return proposals

    def _skips_eagle(self, ctx: ProposeContext, rows: Sequence[_Row], blocks: Sequence[tuple[int, float]]) -> bool:
        """Whether every row's lookup chain promises more than EAGLE's chain at its last step did
        (chains, not trees): then EAGLE's step, whose chain would most likely not be
        sent, is skipped, and the target's features of this step wait for its next one."""
        if ctx.target_features is None or any(n > k for n, k in zip(self.tree_budgets(ctx), ctx.k)):
            return False
        return all(keep and row.eagle_rate is not None and rate > row.eagle_rate
                   for row, (keep, rate) in zip(rows, blocks))

    def reserve_nodes(self, k: int) -> int:
        """EAGLE's tree leaves room for lookup's chain (at most k tokens)."""
        return k

    def _with_branch(self, tree: Proposal, cont: tuple[int, ...], k: int) -> Proposal:
        """EAGLE's tree with lookup's chain grafted on as one more branch from the root, where the
        grafted tree costs at most TREE_COST_MARGIN times a k-token chain to verify (the rule
        EAGLE's tree follows): the target then checks both in its one forward."""
        if not cont:
            return tree
        ids, parents = graft_chain(tree.token_ids, tree.parents, cont)
        if len(ids) == len(tree.token_ids):
            return tree  # EAGLE's tree holds it already
        if verify_cost_at(self.depth.v, len(ids) + 1) > TREE_COST_MARGIN * verify_cost_at(self.depth.v, k + 1):
            return tree
        return Proposal(token_ids=ids, parents=parents)

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        """Greedy rows: each table learns what verifying its chain found, or would have found (judged_by)."""
        for b, ((match, cont), v) in enumerate(zip(self._lookups, verdicts)):
            if cont:
                self._rows[b].table.record(match, *judged_by(cont, v.emitted))
            if b in self._unsent:
                tokens, confidences = self._unsent[b]
                drafted, accepted = judged_by(tokens, v.emitted)
                self.depth.reach.record(confidences[:drafted], accepted)
        self._lookups, self._unsent = [], {}
        super().observe(verdicts)


@register("eagle-lookup")
def _load(env: ProposerEnv) -> ProposerFactory:
    """EAGLE's draft, verify cost and depth choice (eagle_parts), one lookup table for every proposer."""
    draft, v, depth = eagle_parts(env)
    lookup = LookupReach()
    return lambda: EagleLookupProposer(draft, verify_cost=v, runs_trees=env.target.runs_trees, depth=depth,
                                       lookup=lookup)
