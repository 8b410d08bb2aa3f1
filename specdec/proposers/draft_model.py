"""Draft-model proposer: a small causal LM sharing the target's vocabulary drafts k tokens
autoregressively (greedy, or sampled from each row's generator in ctx.generators).

The draft works on `DraftRows`: its validity-masked KV cache, one row per sequence, and the
tokens each row holds. Before each step it rolls every row back to the longest prefix its cache
shares with the committed tokens and feeds the rest, so it never needs to be told what was
accepted (observe does nothing), and the same rule rebuilds a cache that went missing or stale
in a service. The draft service keeps one batch-1 DraftRows per session and hands the
proposer the stacked rows of the sessions it drafts together.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from specdec.backends.kv_cache import KVCache
from specdec.backends.kv_stack import split_cache, stack_caches
from specdec.backends.hf import CausalLM
from specdec.proposers.base import Proposer, ProposerEnv, ProposerFactory, register
from specdec.sampling import logits_to_probs, sample_rows
from specdec.types import Proposal, ProposeContext, SamplingParams
from specdec.verify import common_prefix_len, load_committed


class DraftRows:
    """The draft's KV cache and, per cache row, the tokens whose KV it holds (in order)."""

    def __init__(self, cache: KVCache, tokens: list[list[int]], row_ids: tuple[int, ...]):
        self.cache = cache
        self.tokens = tokens
        self.row_ids = row_ids  # ProposeContext.row_ids these rows stand for

    @classmethod
    def empty(cls, draft: CausalLM, row_ids: Sequence[int] = (0,)) -> "DraftRows":
        return cls(draft.new_cache(len(row_ids)), [[] for _ in row_ids], tuple(row_ids))

    @classmethod
    def stack(cls, parts: Sequence["DraftRows"], new_cache: Callable[[int], KVCache]) -> "DraftRows":
        """Batch-1 rows (sessions) -> one DraftRows with row ids 0..n-1; the parts are left unchanged."""
        return cls(stack_caches([p.cache for p in parts], new_cache), [list(p.tokens[0]) for p in parts],
                   tuple(range(len(parts))))

    def split(self, new_cache: Callable[[int], KVCache]) -> list["DraftRows"]:
        """One batch-1 DraftRows per row (row id 0), in order."""
        return [DraftRows(cache, [toks], (0,)) for cache, toks in zip(split_cache(self.cache, new_cache), self.tokens)]

    def follow(self, draft: CausalLM, row_ids: tuple[int, ...]) -> None:
        """Match the rows asked for: keep those still asked for (rows leave as they finish), or
        start empty for a new set of sequences."""
        if row_ids == self.row_ids:
            return
        if set(row_ids) <= set(self.row_ids):
            where = [self.row_ids.index(r) for r in row_ids]
            self.cache.select_rows(torch.tensor(where, dtype=torch.long))
            self.tokens = [self.tokens[i] for i in where]
            self.row_ids = row_ids
        else:
            fresh = DraftRows.empty(draft, row_ids)
            self.cache, self.tokens, self.row_ids = fresh.cache, fresh.tokens, fresh.row_ids

    def load(self, draft: CausalLM, committed: Sequence[int]) -> None:
        """Batch 1: compute the KV of committed[:-1] now, keeping what the cache shares with it."""
        load_committed(draft, self.cache, committed, cached=self.tokens[0])
        self.tokens = [list(committed[:-1])]

    def catch_up(self, draft: CausalLM, committed: Sequence[Sequence[int]]) -> torch.Tensor:
        """Roll each row back to what it shares with its committed tokens and feed the rest (at
        least the last committed token) -> logits [rows, vocab] for the first drafted token."""
        keep = [min(common_prefix_len(c, t), len(t) - 1) for c, t in zip(self.tokens, committed)]
        self.cache.truncate(torch.tensor(keep))
        logits = draft.prefill(self.cache, [list(t[n:]) for t, n in zip(committed, keep)]).logits
        self.tokens = [list(t) for t in committed]
        return logits

    def append(self, tokens: Sequence[int]) -> None:
        """One token fed per row."""
        for row, t in zip(self.tokens, tokens):
            row.append(int(t))


def draft_chain(logits: torch.Tensor, feed: Callable[[torch.Tensor], torch.Tensor], k_max: int,
                sampling: SamplingParams, generators: Optional[Sequence[torch.Generator]],
                enough: Optional[Callable[[torch.Tensor, torch.Tensor], bool]] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Up to k_max >= 1 tokens per row, one at a time: from logits [rows, vocab] a token per row
    (argmax, or sampled from each row's generator), then feed(tokens [rows]) -> the next logits.
    enough(logits, tokens [rows]), called after each token: True stops the chain there (the draft's
    own figures only, so a sampled chain stays exact). -> (tokens [rows, n], the distributions
    they were sampled from [rows, n, vocab], None when greedy), n <= k_max."""
    drafted, probs = [], []
    for step in range(k_max):
        if sampling.greedy:
            tok = logits.argmax(-1)  # [rows]
        else:
            p = logits_to_probs(logits, sampling)  # [rows, vocab]
            tok = sample_rows(p, generators)  # [rows]
            probs.append(p)
        drafted.append(tok)
        if (enough is not None and enough(logits, tok)) or step + 1 == k_max:
            break
        logits = feed(tok)
    return torch.stack(drafted, 1), torch.stack(probs, 1) if probs else None


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, draft: CausalLM, rows: Optional[DraftRows] = None):
        """rows: the state to draft on (the draft service passes its sessions'); None: the
        proposer's own, following the rows of each context."""
        self.draft = draft
        self.rows = rows if rows is not None else DraftRows.empty(draft, ())

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        k_max = max(ctx.k, default=0)
        if k_max == 0:
            return [Proposal() for _ in ctx.row_ids]
        if not ctx.sampling.greedy and ctx.generators is None:
            raise ValueError("a sampling draft needs ctx.generators (one per row)")
        self.rows.follow(self.draft, ctx.row_ids)
        # 1. Roll each row back to what it shares with the committed tokens; feed the rest.
        logits = self.rows.catch_up(self.draft, ctx.token_ids)  # [batch, vocab]
        # 2. Draft k_max tokens for every row; rows that asked for fewer get a prefix.
        def feed(tok: torch.Tensor) -> torch.Tensor:
            self.rows.append(tok.tolist())
            return self.draft.forward(self.rows.cache, tok[:, None]).logits[:, -1]

        tokens, draft_probs = draft_chain(logits, feed, k_max, ctx.sampling, ctx.generators)
        return [
            Proposal(token_ids=tuple(tokens[b, :k].tolist()),
                     draft_probs=None if draft_probs is None else draft_probs[b, :k])
            for b, k in enumerate(ctx.k)
        ]


@register("draft")
def _load(env: ProposerEnv) -> ProposerFactory:
    draft = env.load_draft()
    return lambda: DraftModelProposer(draft)
