"""A prefix cache: the KV of token prefixes read before (shared system prompts, earlier turns of a
conversation, documents that come again), so a new sequence prefills only what follows the
longest cached prefix of its tokens.

- Entries are snapshots of a model's KV (`lm.snapshot_prefix(cache, n)`: torch tensors, or
  llama.cpp's sequence state) of exactly `tokens`. Each entry is reachable from every block-aligned
  prefix of its tokens (BLOCK tokens a block) through the chain digest of that prefix
  (specdec.sessions.extend_digest, as session positions are checked), so a lookup walks the new
  tokens' block digests from the longest down: a handful of dict lookups, whatever the number of
  entries. A found entry's tokens are compared with the request's (a digest collision can never
  hand out the wrong KV).
- Bounded by `budget_bytes` (the snapshots' own sizes), least recently used evicted first; an
  entry larger than the whole budget is not kept.
- Found by blocks, reused to the token: an entry that holds a block-aligned prefix also gives the
  tokens after it that it shares with the request (a conversation's next turn differs from the
  last one's tokens a few tokens into its answer, where the chat template closes it); a request
  that shares less than one block with every entry is prefilled whole.

Exactness: a restored prefix holds the very keys and values an earlier forward computed, so the
logits after it equal those after a fresh prefill wherever the backend's arithmetic does not
depend on how many tokens one forward holds. torch: a forward's width moves logits by float
rounding only (~1e-6, tests/unit/test_prefix_cache.py); llama.cpp, as specdec builds and runs it,
not at all (specdec.backends.llamacpp.model.WIDTH_INVARIANT_ENV): so any prefix is reused, a
conversation's decoded answer too. A backend whose kernels change with the forward's token count
(llama.cpp with flash attention: tiled from 64 queries up, which moved the Q4_1 target's logits by
up to 0.8 and changed 4 of 6 served dev answers) sets `lm.prefill_block` to its batch; then only
what a fresh prefill computes the same way is reused: whole blocks of it that were prefilled in
such blocks from position 0 (`remember(..., prefilled=)`), restored at a multiple of the block
(`restore_longest`), the rest then prefilled in blocks from there as a fresh prefill would.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from specdec.sessions import extend_digest, token_digest
from specdec.verify import common_prefix_len

BLOCK = 16


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    snapshot: object
    nbytes: int


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up (vLLM's prefix_cache_queries)
    hits: int = 0  # tokens found (vLLM's prefix_cache_hits): prefill saved
    inserts: int = 0
    evictions: int = 0


def block_digests(tokens: Sequence[int], block: int = BLOCK) -> list[tuple[int, int]]:
    """(length, digest of tokens[:length]) for every block-aligned length, shortest first."""
    out, digest = [], token_digest(())
    for end in range(block, len(tokens) + 1, block):
        digest = extend_digest(digest, tokens[end - block:end])
        out.append((end, digest))
    return out


class PrefixCache:
    def __init__(self, budget_bytes: int, block: int = BLOCK,
                 on_change: Optional[Callable[["PrefixCache", int], None]] = None):
        if budget_bytes < 0 or block < 1:
            raise ValueError("budget_bytes must be >= 0 and block >= 1")
        self.budget_bytes, self.block = budget_bytes, block
        self.on_change = on_change  # told after every insert, with the entries it evicted (metrics)
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # id -> entry, least recently used first
        self._index: dict[int, list[int]] = {}  # digest of a block-aligned prefix -> ids of entries holding it
        self._next_id = 0
        self.bytes_held = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int], at_most: Optional[int] = None,
               whole: int = 1) -> tuple[int, Optional[object]]:
        """(n, snapshot): the longest cached block-aligned prefix of tokens (at most `at_most`
        tokens; a multiple of `whole`) and the snapshot that holds it (it may hold more than n
        tokens: restore n of them), or (0, None)."""
        limit = len(tokens) if at_most is None else min(at_most, len(tokens))
        self.stats.queries += limit
        for n, digest in reversed(block_digests(tokens[:limit], self.block)):
            found = self._longest_holder(digest, tokens[:n], tokens[:limit])
            if found is not None:  # (the longest holder: no other shares more)
                eid, n = found[0], found[1] - found[1] % whole
                if not n:
                    break
                self._entries.move_to_end(eid)
                self.stats.hits += n
                return n, self._entries[eid].snapshot
        return 0, None

    def _holders(self, digest: int, prefix: Sequence[int]) -> list[int]:
        """The entries whose tokens start with `prefix` (whose chain digest is `digest`), newest first."""
        return [eid for eid in reversed(self._index.get(digest, ()))
                if self._entries[eid].tokens[:len(prefix)] == tuple(prefix)]

    def _holder(self, digest: int, prefix: Sequence[int]) -> Optional[int]:
        """The newest entry holding `prefix`."""
        return next(iter(self._holders(digest, prefix)), None)

    def _longest_holder(self, digest: int, prefix: Sequence[int], tokens: Sequence[int]) -> Optional[tuple[int, int]]:
        """Of the entries holding the block-aligned `prefix`, the one sharing the most of `tokens`
        (the newest of equals) -> (its id, how many tokens it shares: the block-aligned prefix and
        as many of the tokens after it as it holds too, so reuse is exact to the token)."""
        best = None
        for eid in self._holders(digest, prefix):
            shared = common_prefix_len(self._entries[eid].tokens, tokens)
            if best is None or shared > best[1]:
                best = (eid, shared)
        return best

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether every block-aligned prefix of tokens is found already (nothing to insert)."""
        return self._covered(tokens, block_digests(tokens, self.block))

    def _covered(self, tokens: Sequence[int], digests: list[tuple[int, int]]) -> bool:
        return not digests or self._holder(digests[-1][1], tokens[:digests[-1][0]]) is not None

    def insert(self, tokens: Sequence[int], snapshot: object, nbytes: int) -> bool:
        """Keep `snapshot`, the KV of exactly `tokens`; -> whether it was kept (too short, already
        covered, or larger than the budget: not)."""
        digests = block_digests(tokens, self.block)
        if not digests or nbytes > self.budget_bytes or self._covered(tokens, digests):
            return False
        eid, self._next_id = self._next_id, self._next_id + 1
        self._entries[eid] = _Entry(tuple(tokens), snapshot, nbytes)
        for _, digest in digests:
            self._index.setdefault(digest, []).append(eid)
        self.bytes_held += nbytes
        self.stats.inserts += 1
        evicted = 0
        while self.bytes_held > self.budget_bytes:
            self._evict_oldest()
            evicted += 1
        if self.on_change is not None:
            self.on_change(self, evicted)
        return True

    def _evict_oldest(self) -> None:
        eid, entry = self._entries.popitem(last=False)
        self.bytes_held -= entry.nbytes
        self.stats.evictions += 1
        for _, digest in block_digests(entry.tokens, self.block):
            holders = self._index[digest]
            holders.remove(eid)
            if not holders:
                del self._index[digest]


def restore_longest(cache: PrefixCache, lm, tokens: Sequence[int], at_most: int, more_than: int = 0, into=None,
                    block: Optional[int] = None):
    """A batch-1 KV cache of `lm` holding the longest cached prefix of tokens (at most `at_most`
    tokens, whole blocks of `block`, default lm.prefill_block: see the module docstring; only if
    longer than `more_than`, what the caller holds already) -> (its length n, the cache), or
    (0, None). into: an empty batch-1 cache to restore into (else a new one: on llama.cpp a new
    context, ~50 ms when none is idle)."""
    block = lm.prefill_block if block is None else block
    at_most -= at_most % block
    if at_most - more_than < cache.block:
        return 0, None
    n, snapshot = cache.lookup(tokens, at_most=at_most, whole=block)
    if n <= more_than:
        return 0, None
    kv = into if into is not None and into.batch_size == 1 and int(into.lengths[0]) == 0 else lm.new_cache(1)
    lm.restore_prefix(kv, snapshot, n)
    return n, kv


def remember(cache: PrefixCache, lm, kv, tokens: Sequence[int], prefilled: Optional[int] = None,
             block: Optional[int] = None) -> bool:
    """Keep the KV of `tokens`, the first len(tokens) entries of the batch-1 cache `kv` (with a
    `block` > 1, default lm.prefill_block, only the whole blocks of the first `prefilled`, the rows
    a prefill computed from a restored or empty start, default all: see the module docstring),
    unless they are too short or covered already -> whether a snapshot was taken."""
    block = lm.prefill_block if block is None else block
    if block > 1:
        n = len(tokens) if prefilled is None else min(prefilled, len(tokens))
        tokens = tokens[:n - n % block]
    if len(tokens) < cache.block or cache.covers(tokens):
        return False
    snapshot, nbytes = lm.snapshot_prefix(kv, len(tokens))
    return cache.insert(tokens, snapshot, nbytes)
