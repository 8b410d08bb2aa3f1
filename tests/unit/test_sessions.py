"""Session ids, token digests and prefix digests (what the services check a session's state by),
and the shared-prefix count the verify loop and the prefix cache use."""

import random

import pytest

from specdec.errors import InvalidRequest
from specdec.sessions import PrefixDigests, check_session_id, extend_digest, token_digest
from specdec.verify import common_prefix_len


def test_session_ids_are_validated_strictly():
    assert check_session_id("abc-DEF_123") == "abc-DEF_123"
    for bad in ("short", "has space in it", "../../etc/passwd", "a" * 65, "ключ-сессии-1", "x\ny" * 5, ""):
        with pytest.raises(InvalidRequest):
            check_session_id(bad)


def test_token_digest_depends_on_every_token_and_the_order():
    base = token_digest([1, 2, 3])
    assert base == token_digest((1, 2, 3))
    assert base != token_digest([1, 2, 4]) and base != token_digest([3, 2, 1])
    assert base != token_digest([1, 2, 3, 0])


def test_prefix_digests_follow_a_token_list_that_grows_and_is_cut_back():
    rng = random.Random(0)
    tokens: list[int] = []
    digests = PrefixDigests()
    for _ in range(200):
        if tokens and rng.random() < 0.3:  # a rollback, then other tokens
            keep = rng.randrange(len(tokens) + 1)
            new = tokens[:keep] + [rng.randrange(50) for _ in range(rng.randrange(4))]
            digests.reset(new, keep)
            tokens = new
        else:
            step = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            assert extend_digest(digests.last(), step) == token_digest(tokens + step)
            digests.extend(step)
            tokens += step
        assert len(digests) == len(tokens)
        n = rng.randrange(len(tokens) + 1)
        assert digests.at(n) == token_digest(tokens[:n]) and digests.last() == token_digest(tokens)


def test_common_prefix_len_counts_the_shared_leading_tokens_of_lists_and_tuples():
    rng = random.Random(1)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randrange(30))]
        b = [rng.randrange(3) for _ in range(rng.randrange(30))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == common_prefix_len(tuple(a), b) == common_prefix_len(a, tuple(b)) == want


def test_a_position_is_synced_forward_and_back_and_refused_when_behind_or_elsewhere():
    from specdec.errors import NotFound
    from specdec.service.sync import Position, check_position, synced_tokens

    held = [5, 6, 7, 8]
    digests = PrefixDigests(held)
    # the caller committed two more tokens, naming them as new
    assert synced_tokens("s", held, digests, Position(6, (9, 10), token_digest(held + [9, 10]))) == held + [9, 10]
    # the caller rolled back one token and committed another in its place
    assert synced_tokens("s", held, digests, Position(4, (11,), token_digest([5, 6, 7, 11]))) == [5, 6, 7, 11]
    with pytest.raises(NotFound, match="behind"):  # names 2 new tokens after 5 held ones: one is missing here
        synced_tokens("s", held, digests, Position(7, (1, 2), token_digest(held + [0, 1, 2])))
    with pytest.raises(NotFound, match="other tokens"):
        synced_tokens("s", held, digests, Position(5, (9,), token_digest([5, 6, 0, 8, 9])))
    for bad, words in ((Position(0, (), 0), "committed_len"), (Position(2, (1, 2, 3), 0), "committed_len"),
                       (Position(3, (99,), 0), "vocabulary"), (Position(8, (), 0), "context of 10")):
        with pytest.raises(InvalidRequest, match=words):
            check_position(bad, vocab_size=50, ahead=2, max_positions=10)
