"""Prompt lookup: draft the tokens that followed the most recent earlier occurrence of the
context's last n-gram (Saxena 2023). No model; deterministic, so draft_probs is None and
rejection sampling treats the draft as one-hot."""

from __future__ import annotations

from typing import Sequence

from specdec.proposers.base import Proposer, ProposerEnv, ProposerFactory, register
from specdec.types import Proposal, ProposeContext


def find_continuation(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, ...]:
    """Up to k tokens that followed the latest earlier match of the longest matching suffix n-gram
    (n from max_ngram down to min_ngram). Empty when nothing matches."""
    return longest_match(tokens, k, max_ngram, min_ngram)[1]


def longest_match(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1,
                  max_length: int = 64) -> tuple[int, tuple[int, ...]]:
    """find_continuation's continuation with the length of the match it followed: the n-gram,
    extended back as far as the tokens before it still agree (up to max_length; a span being
    copied matches far back, a phrase met by chance for a few tokens) -> (length, tokens); (0, ())
    when nothing matches."""
    tokens = tuple(tokens)
    n_tokens = len(tokens)
    if k <= 0:
        return 0, ()
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        pattern = tokens[n_tokens - n :]
        # Latest start first; a match must end before the suffix itself starts.
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start] == pattern[0] and tokens[start : start + n] == pattern:
                cont = tuple(tokens[start + n : start + n + k])
                if cont:
                    m = n
                    while m < max_length and start - (m - n) > 0 and tokens[start - (m - n) - 1] == tokens[-m - 1]:
                        m += 1
                    return m, cont
    return 0, ()


class PromptLookupProposer(Proposer):
    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        return [Proposal(token_ids=find_continuation(toks, k, self.max_ngram, self.min_ngram))
                for toks, k in zip(ctx.token_ids, ctx.k)]


@register("prompt-lookup")
def _load(env: ProposerEnv) -> ProposerFactory:
    return PromptLookupProposer
