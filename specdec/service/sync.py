"""A session's position, as every Propose, Verify and Decode names it, and the one check of it
against the tokens a service's session holds (the draft and the target service share both).

A caller names its committed tokens by their length, the newest of them (those the service has
not seen yet) and the digest of them all. The service keeps the digest of every prefix of what it
holds, so it can tell in O(new) whether the caller continues its tokens, rolled some back, or
names tokens it never held: then the session is refused with NotFound and the caller prefills it
again from its own copy (Redis)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specdec.errors import InvalidRequest, NotFound
from specdec.sessions import PrefixDigests, check_token_ids, extend_digest


@dataclass(frozen=True)
class Position:
    committed_len: int
    new_token_ids: tuple[int, ...]
    digest: int  # token_digest of all committed_len tokens

    @property
    def base(self) -> int:
        """How many of the committed tokens the service must already hold."""
        return self.committed_len - len(self.new_token_ids)


def check_position(pos: Position, vocab_size: int, ahead: int, max_positions: int, model: str = "model") -> Position:
    """InvalidRequest for a position no session can be at: fewer than one committed token, more
    new tokens than committed ones, ids outside the vocabulary, or `ahead` more tokens (a draft
    block, the tokens to decode) past the model's context."""
    if pos.committed_len < 1 or len(pos.new_token_ids) > pos.committed_len:
        raise InvalidRequest(f"committed_len must be >= 1 and >= the {len(pos.new_token_ids)} new tokens")
    check_token_ids(pos.new_token_ids, vocab_size, "new token ids")
    if pos.committed_len + ahead + 1 > max_positions:
        raise InvalidRequest(f"the session would exceed the {model}'s context of {max_positions} tokens")
    return pos


def synced_tokens(session_id: str, tokens: Sequence[int], digests: PrefixDigests, pos: Position) -> list[int]:
    """The caller's committed tokens, built from the session's `tokens` (digests: of each of their
    prefixes) and the position's new tokens; NotFound where the session is behind the caller or
    holds other tokens than it names."""
    if pos.base > len(tokens):
        raise NotFound(f"session {session_id} is behind the caller: prefill it again")
    new = list(pos.new_token_ids)
    if extend_digest(digests.at(pos.base), new) != pos.digest:
        raise NotFound(f"session {session_id} holds other tokens than the caller: prefill it again")
    return list(tokens[: pos.base]) + new
