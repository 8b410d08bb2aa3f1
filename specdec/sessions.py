"""What names a session's state in the services, without the wire: its id, its committed tokens
(checked against the vocabulary, digested so a service can check its cached state before
trusting it), and the per-position seed of a seeded session."""

from __future__ import annotations

import hashlib
import re
from array import array
from typing import Optional, Sequence

from specdec.errors import InvalidRequest

SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{8,64}$")


def check_session_id(session_id: str) -> str:
    """Session ids become Redis keys and log fields: 8-64 characters of [A-Za-z0-9_-], nothing else."""
    if not isinstance(session_id, str) or not SESSION_ID.match(session_id):
        raise InvalidRequest("malformed session id: expected 8-64 characters of A-Z a-z 0-9 _ -")
    return session_id


def token_digest(token_ids: Sequence[int]) -> int:
    """A 64-bit digest of a token list: a service checks it before trusting its cached state."""
    data = array("q", (int(t) for t in token_ids)).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


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
