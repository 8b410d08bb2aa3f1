"""The n-gram pool of Lookahead decoding: continuations keyed by their first token.

One data structure, one insertion rule:
- `insert(ngram)` files ngram[1:] (the *continuation*) under ngram[0] (the *key*). A key holds at
  most `per_key` continuations, most recently inserted last; inserting one that is already there
  moves it to the back, and inserting into a full key evicts that key's oldest continuation
  (LRU within a key, as in the LookaheadDecoding reference). At most `max_keys` keys are kept;
  touching a key makes it the most recent and a new key beyond the bound evicts the least
  recent one, so memory stays bounded over long generations.
- `lookup(key, limit)` returns up to `limit` continuations of that key, newest first: the
  Jacobi window produces better n-grams as its trajectory settles, so recent ones are preferred.

All continuations in a pool have the same length (n - 1); a pool is per sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class NgramPool:
    def __init__(self, n: int, per_key: int, max_keys: int = 4096):
        if n < 2:
            raise ValueError(f"n-gram size must be >= 2, got {n}")
        if per_key < 1 or max_keys < 1:
            raise ValueError("per_key and max_keys must be >= 1")
        self.n = n
        self.per_key = per_key
        self.max_keys = max_keys
        self._table: OrderedDict[int, list[tuple[int, ...]]] = OrderedDict()

    def __len__(self) -> int:
        """Number of stored continuations (over all keys)."""
        return sum(len(v) for v in self._table.values())

    def __contains__(self, ngram: Sequence[int]) -> bool:
        ngram = tuple(int(t) for t in ngram)
        return ngram[1:] in self._table.get(ngram[0], ())

    def insert(self, ngram: Sequence[int]) -> None:
        ngram = tuple(int(t) for t in ngram)
        if len(ngram) != self.n:
            raise ValueError(f"expected a {self.n}-gram, got {len(ngram)} tokens")
        key, cont = ngram[0], ngram[1:]
        conts = self._table.get(key)
        if conts is None:
            conts = self._table[key] = []
            if len(self._table) > self.max_keys:
                self._table.popitem(last=False)
        else:
            self._table.move_to_end(key)
        if cont in conts:
            conts.remove(cont)
        elif len(conts) >= self.per_key:
            del conts[0]
        conts.append(cont)

    def insert_all(self, ngrams: Iterable[Sequence[int]]) -> None:
        for g in ngrams:
            self.insert(g)

    def insert_from_text(self, tokens: Sequence[int]) -> None:
        """Every n-gram of a token sequence, oldest first (so the latest occurrences win)."""
        for start in range(len(tokens) - self.n + 1):
            self.insert(tokens[start : start + self.n])

    def lookup(self, key: int, limit: int) -> list[tuple[int, ...]]:
        """Up to limit continuations (each n - 1 tokens) filed under key, newest first."""
        conts = self._table.get(int(key), ())
        return list(reversed(conts))[:limit] if limit > 0 else []
