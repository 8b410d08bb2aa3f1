"""What names a session's state in the services, without the wire: its id, its committed tokens
(checked against the vocabulary, digested so a service can check its cached state before
trusting it), and the per-position seed of a seeded session.

The digest extends token by token, so whoever holds a session's tokens keeps the digest of
every prefix (`PrefixDigests`) and a step costs the digest of its new tokens only, not of the
whole session (a re-hash per call grew with the length: 0.24 ms at 4,000 tokens, three times
a step)."""

from __future__ import annotations

import hashlib
import re
from typing import Iterable, Optional, Sequence

from specdec.errors import InvalidRequest

SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{8,64}$")


def check_session_id(session_id: str) -> str:
    """Session ids become Redis keys and log fields: 8-64 characters of [A-Za-z0-9_-], nothing else."""
    if not isinstance(session_id, str) or not SESSION_ID.match(session_id):
        raise InvalidRequest("malformed session id: expected 8-64 characters of A-Z a-z 0-9 _ -")
    return session_id


# The digest: a polynomial hash of the token ids mod the Mersenne prime 2^61 - 1, so that it
# extends token by token (about 0.15 us a token; a chained blake2b was ten times slower, which a
# 4,000-token prefill paid in every process). It tells a stale or foreign state from the caller's:
# two different lists of n tokens share a digest with probability about n / 2^61. It is no
# defence against forged collisions, which would gain a caller nothing: a session's state is its own.
_DIGEST_MOD = (1 << 61) - 1
_DIGEST_BASE = 0x1F3D5B79A3C1E5


def extend_digest(digest: int, token_ids: Iterable[int]) -> int:
    """The digest of a token list whose prefix has `digest`, extended by token_ids."""
    for t in token_ids:
        digest = (digest * _DIGEST_BASE + int(t) + 1) % _DIGEST_MOD
    return digest


def token_digest(token_ids: Iterable[int]) -> int:
    """A 61-bit digest of a token list: a service checks it before trusting its cached state."""
    return extend_digest(0, token_ids)


class PrefixDigests:
    """The digest of every prefix of one token list that grows at its end and is cut back (a
    session's committed tokens): `at(n)` is token_digest(tokens[:n]); keeping it costs what the
    list's changes cost."""

    def __init__(self, token_ids: Iterable[int] = ()):
        self._at = [0]  # _at[n]: the digest of the first n tokens
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self._at) - 1

    def at(self, n: int) -> int:
        return self._at[n]

    def last(self) -> int:
        return self._at[-1]

    def extend(self, token_ids: Iterable[int]) -> None:
        d, at = self._at[-1], self._at
        for t in token_ids:
            d = (d * _DIGEST_BASE + int(t) + 1) % _DIGEST_MOD  # extend_digest, inlined
            at.append(d)

    def truncate(self, n: int) -> None:
        del self._at[n + 1 :]

    def reset(self, token_ids: Sequence[int], keep: int) -> None:
        """Follow the list replaced by token_ids, which share their first `keep` tokens with it."""
        self.truncate(min(keep, len(self)))
        self.extend(token_ids[len(self) :])


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str = "token ids") -> list[int]:
    ids = [int(t) for t in token_ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{what} outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def step_seed(seed: Optional[int], committed_len: int) -> Optional[int]:
    """A seeded session draws each step's randomness from (seed, position), so its samples do not
    depend on which replica served which step, on restarts, on retries, or on batch neighbours."""
    if seed is None:
        return None
    data = int(seed).to_bytes(16, "little", signed=True) + int(committed_len).to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
