"""The n-gram pool of Lookahead decoding: insertion rule, bounds, lookup order."""

import pytest

from specdec.ngram_pool import NgramPool


def test_lookup_returns_continuations_of_the_key_newest_first():
    pool = NgramPool(n=3, per_key=4)
    pool.insert_all([(1, 2, 3), (1, 4, 5), (2, 9, 9)])
    assert pool.lookup(1, 10) == [(4, 5), (2, 3)]
    assert pool.lookup(2, 10) == [(9, 9)]


def test_lookup_of_an_unknown_key_is_empty():
    pool = NgramPool(n=3, per_key=2)
    pool.insert((1, 2, 3))
    assert pool.lookup(7, 2) == []


def test_lookup_respects_the_limit():
    pool = NgramPool(n=2, per_key=5)
    pool.insert_all([(1, t) for t in range(5)])
    assert pool.lookup(1, 2) == [(4,), (3,)]
    assert pool.lookup(1, 0) == []


def test_reinserting_a_continuation_makes_it_newest_without_duplicating():
    pool = NgramPool(n=3, per_key=3)
    pool.insert_all([(1, 2, 3), (1, 4, 5), (1, 2, 3)])
    assert pool.lookup(1, 5) == [(2, 3), (4, 5)]
    assert len(pool) == 2


def test_a_full_key_evicts_its_oldest_continuation():
    pool = NgramPool(n=2, per_key=2)
    pool.insert_all([(1, 10), (1, 11), (1, 12)])
    assert pool.lookup(1, 5) == [(12,), (11,)]
    assert (1, 10) not in pool


def test_the_least_recently_touched_key_is_evicted_beyond_max_keys():
    pool = NgramPool(n=2, per_key=2, max_keys=2)
    pool.insert_all([(1, 10), (2, 20), (1, 11), (3, 30)])  # key 2 is the least recently touched
    assert pool.lookup(2, 5) == []
    assert pool.lookup(1, 5) == [(11,), (10,)]
    assert pool.lookup(3, 5) == [(30,)]


def test_insert_from_text_pools_every_ngram_and_prefers_the_latest_occurrence():
    pool = NgramPool(n=3, per_key=4)
    pool.insert_from_text([5, 6, 7, 5, 8, 9])
    assert pool.lookup(5, 4) == [(8, 9), (6, 7)]
    assert pool.lookup(6, 4) == [(7, 5)]
    assert pool.lookup(8, 4) == []  # (8, 9) has no third token
    assert len(pool) == 4


def test_an_ngram_of_the_wrong_size_is_rejected():
    pool = NgramPool(n=3, per_key=2)
    with pytest.raises(ValueError, match="3-gram"):
        pool.insert((1, 2))
