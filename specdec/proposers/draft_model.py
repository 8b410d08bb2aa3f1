"""Draft-model proposer: a small causal LM sharing the target's vocabulary drafts k tokens
autoregressively (greedy, or sampled with its own seeded generator when the request samples).

The draft keeps its own validity-masked KV cache, one row per sequence. Before each step it
rolls every row back to the longest prefix its cache shares with the committed tokens and
feeds the rest, so it never needs to be told what was accepted (the same rule rebuilds a
cache that went missing or stale in a service).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specdec.lm import CausalLM
from specdec.proposers.base import register
from specdec.sampling import logits_to_probs, make_generator, sample, sample_rows
from specdec.types import Proposal, ProposeContext, Verdict


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@register("draft_model")
class DraftModelProposer:
    name = "draft_model"

    def __init__(self, draft: CausalLM):
        self.draft = draft
        self.cache = None
        self.row_ids: tuple[int, ...] = ()
        self.cached_tokens: list[list[int]] = []  # per cache row: the tokens whose KV is valid, in order
        self.generator: Optional[torch.Generator] = None

    def _sync_rows(self, ctx: ProposeContext) -> None:
        if ctx.row_ids == self.row_ids:
            return
        if self.cache is not None and set(ctx.row_ids) <= set(self.row_ids):
            where = [self.row_ids.index(r) for r in ctx.row_ids]
            self.cache.select_rows(torch.tensor(where, dtype=torch.long))
            self.cached_tokens = [self.cached_tokens[i] for i in where]
        else:
            self.cache = self.draft.new_cache(len(ctx.row_ids))
            self.cached_tokens = [[] for _ in ctx.row_ids]
        self.row_ids = ctx.row_ids

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        k_max = max(ctx.k, default=0)
        if k_max == 0:
            return [Proposal() for _ in ctx.row_ids]
        if self.generator is None:
            seed = None if ctx.sampling.seed is None else ctx.sampling.seed + 0x5EED
            self.generator = make_generator(seed)
        self._sync_rows(ctx)
        # 1. Roll each row back to what it shares with the committed tokens; feed the rest
        #    (at least the last committed token, whose logits give the first draft).
        keep = [min(common_prefix_len(c, t), len(t) - 1) for c, t in zip(self.cached_tokens, ctx.token_ids)]
        self.cache.truncate(torch.tensor(keep))
        feeds = [t[n:] for t, n in zip(ctx.token_ids, keep)]
        logits = self.draft.prefill(self.cache, feeds).logits  # [batch, vocab]
        self.cached_tokens = [list(t) for t in ctx.token_ids]
        # 2. Draft k_max tokens for every row; rows that asked for fewer get a prefix.
        drafted, probs = [], []
        for step in range(k_max):
            if ctx.sampling.greedy:
                tok = logits.argmax(-1)  # [batch]
            else:
                p = logits_to_probs(logits, ctx.sampling)  # [batch, vocab]
                tok = sample(p, self.generator) if ctx.generators is None else sample_rows(p, ctx.generators)  # [batch]
                probs.append(p)
            drafted.append(tok)
            if step + 1 < k_max:
                logits = self.draft.forward(self.cache, tok[:, None]).logits[:, -1]
                for row, t in zip(self.cached_tokens, tok.tolist()):
                    row.append(t)
        tokens = torch.stack(drafted, 1)  # [batch, k_max]
        draft_probs = torch.stack(probs, 1) if probs else None  # [batch, k_max, vocab]
        return [
            Proposal(token_ids=tuple(tokens[b, :k].tolist()),
                     draft_probs=None if draft_probs is None else draft_probs[b, :k])
            for b, k in enumerate(ctx.k)
        ]

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        pass  # the next propose() realigns the cache with the committed tokens
