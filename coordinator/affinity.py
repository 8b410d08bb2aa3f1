"""Prefix affinity: which target replica last read a token prefix, so a session that starts the
same way (a conversation's next turn, a shared system prompt or document) goes where the target's
prefix cache holds it.

The coordinator remembers, per target replica, the block-aligned prefixes of the sessions it
sent there (their prompts at start, their whole tokens at the end), as chain digests of 16-token
blocks (the target's prefix cache keys, specdec.prefix_cache.block_digests), least recently used
forgotten past `max_prefixes`. A new session's home is the replica that holds its longest
remembered prefix, unless that replica is busier than the ring's choice by more than `slack`
sessions (a prefix every session shares must not pull them all onto one replica), or holds fewer
than `min_tokens` of it (then the ring spreads the load as before). It is a hint: a replica that
evicted the prefix meanwhile only prefills more; output never depends on where a session runs.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Sequence

from specdec.prefix_cache import BLOCK, block_digests


class PrefixAffinity:
    def __init__(self, max_prefixes: int = 100_000, min_tokens: int = 2 * BLOCK, slack: int = 2):
        if max_prefixes < 1 or min_tokens < 0 or slack < 0:
            raise ValueError("max_prefixes must be >= 1, min_tokens and slack >= 0")
        self.max_prefixes, self.min_tokens, self.slack = max_prefixes, min_tokens, slack
        self._where: OrderedDict[int, tuple[str, int]] = OrderedDict()  # prefix digest -> (replica, its length)

    def __len__(self) -> int:
        return len(self._where)

    def remember(self, tokens: Sequence[int], replica: str) -> None:
        """`replica` has read these tokens (its prefix cache may hold every block-aligned prefix)."""
        for n, digest in block_digests(tokens):
            self._where[digest] = (replica, n)
            self._where.move_to_end(digest)
        while len(self._where) > self.max_prefixes:
            self._where.popitem(last=False)

    def holder(self, tokens: Sequence[int]) -> tuple[Optional[str], int]:
        """(the replica that read the longest remembered prefix of tokens, its length), or (None, 0)."""
        for n, digest in reversed(block_digests(tokens)):
            found = self._where.get(digest)
            if found is not None and found[1] == n:
                return found
        return None, 0

    def home(self, tokens: Sequence[int], ring_choice: Optional[str], live: Sequence[str],
             load: Callable[[str], int]) -> Optional[str]:
        """Where a new session with these tokens should run: the holder of its longest prefix when
        it is live, holds at least min_tokens, and is not busier than the ring's choice by more
        than slack sessions (load(replica): the sessions running there); else the ring's choice."""
        replica, n = self.holder(tokens)
        if replica is None or replica == ring_choice or replica not in live or n < self.min_tokens:
            return ring_choice
        if ring_choice is not None and load(replica) > load(ring_choice) + self.slack:
            return ring_choice
        return replica
