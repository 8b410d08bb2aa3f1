"""Copy candidates: for each position of a token sequence, the token that followed the latest
earlier occurrence of the longest n-gram (n <= max_ngram) ending there, as prompt lookup
drafts it (specdec.proposers.prompt_lookup), one token deep. An EAGLE draft made with
`copy_token` reads this candidate's embedding beside each pair (specdec.eagle), so it can learn
when the answer copies its context, which one attention layer does poorly.

Measured before building it (the target's greedy answers to 4 dev prompts per category, the
EAGLE draft of runs/s7, depth 1): the draft predicts 0.33 of the answer's next tokens; this
candidate (n <= 3) 0.31, and one of the two 0.50 among the subset's tokens (translation 0.18 ->
0.61, summarization 0.27 -> 0.45, rag 0.30 -> 0.50, chat 0.33 -> 0.38).

`copy_candidates` is the whole-sequence form training uses; `CopyIndex` the incremental one
drafting uses (committed tokens pushed once; a drafted chain or tree path looked up on top of
them, as if it were committed). Both give the same candidate for the same tokens. NONE (-1):
nothing matches.
"""

from __future__ import annotations

from typing import Sequence

NONE = -1
MAX_NGRAM = 3


def copy_candidates(ids: Sequence[int], max_ngram: int = MAX_NGRAM) -> list[int]:
    """-> c with c[i] the candidate for ids[i + 1] from ids[: i + 1] (NONE where no n-gram ending
    at i occurred before with a token after it), len(ids) entries."""
    index = CopyIndex(max_ngram)
    return [index.push(t) for t in ids]


class CopyIndex:
    """The n-grams of committed tokens, each with the position it last ended at."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.ids: list[int] = []
        self.candidates: list[int] = []  # candidates[i]: the candidate for ids[i + 1] (copy_candidates)
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> the last position it ended at, before the newest

    def push(self, token: int) -> int:
        """Commit one token -> the candidate for the token after it."""
        ids = self.ids
        end = len(ids) - 1  # the n-grams ending at the token before this one now have a continuation
        for n in range(1, self.max_ngram + 1):
            if end - n + 1 < 0:
                break
            self._last[tuple(ids[end - n + 1 : end + 1])] = end
        ids.append(int(token))
        cand = self._lookup(len(ids) - 1, ())
        self.candidates.append(cand)
        return cand

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.push(t)

    def candidate(self, path: Sequence[int]) -> int:
        """The candidate for the token after ids + path (path: drafted tokens, not committed),
        what copy_candidates(ids + path)[-1] gives."""
        if not path:
            return self.candidates[-1] if self.candidates else NONE
        return self._lookup(len(self.ids) + len(path) - 1, tuple(int(t) for t in path))

    def _lookup(self, end: int, path: tuple[int, ...]) -> int:
        """Over the tokens ids + path (end: the last one's position): the token after the latest
        earlier occurrence of the longest n-gram ending at end. Occurrences ending at the last
        committed token or inside path are scanned; those ending before are in _last."""
        ids, start = self.ids, len(self.ids)

        def at(i: int) -> int:
            return ids[i] if i < start else path[i - start]

        for n in range(min(self.max_ngram, end), 0, -1):
            gram = tuple(at(i) for i in range(end - n + 1, end + 1))
            for p in range(end - 1, max(start - 1, n - 1) - 1, -1):
                if all(at(p - n + 1 + i) == gram[i] for i in range(n)):
                    return at(p + 1)
            p = self._last.get(gram)  # ends at <= start - 2 < end
            if p is not None:
                return ids[p + 1]
        return NONE
