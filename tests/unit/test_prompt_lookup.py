from specdec.proposers.prompt_lookup import PromptLookupProposer, find_continuation
from specdec.types import ProposeContext


def test_continues_latest_match_of_longest_ngram():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix (5, 2, 3) never occurred; (2, 3) last occurred at 6 -> continues 7, 8, 5
    assert find_continuation(toks, k=3) == (7, 8, 5)


def test_prefers_longer_ngram_over_more_recent_shorter_one():
    toks = [4, 5, 6, 10, 11, 9, 6, 12, 4, 5, 6]
    # (4, 5, 6) matches at 0 -> 10, 11; the more recent (6,) at 6 would give 12
    assert find_continuation(toks, k=2) == (10, 11)


def test_no_match_gives_empty_proposal():
    assert find_continuation([1, 2, 3, 4], k=4) == ()


def test_continuation_is_capped_at_k_and_context_end():
    toks = [7, 1, 2, 7]
    assert find_continuation(toks, k=5) == (1, 2, 7)
    assert find_continuation(toks, k=1) == (1,)


def test_proposer_returns_one_proposal_per_row():
    ctx = ProposeContext(row_ids=(0, 1), token_ids=((1, 2, 1), (3, 4)), k=(2, 2))
    props = PromptLookupProposer().propose(ctx)
    assert [p.token_ids for p in props] == [(2, 1), ()]
    assert all(p.draft_probs is None for p in props)
