"""Drafts from earlier sessions (specdec.token_history): what followed the longest match of a
context's end among the kept sequences, within a token budget."""

import pytest

from specdec.token_history import HistoryProposer, MatchAcceptance, TokenHistory
from specdec.types import ProposeContext, Verdict


def test_drafts_what_followed_the_longest_match_and_the_newest_among_equal_ones():
    h = TokenHistory(n=2)
    h.add([1, 2, 3, 4, 5, 6, 7, 8])
    h.add([9, 3, 4, 5, 60, 61])
    assert h.continuation([0, 2, 3, 4, 5], 3, min_match=2) == (4, (6, 7, 8))  # 2 3 4 5: only the first
    assert h.continuation([7, 3, 4, 5], 3, min_match=2) == (3, (60, 61))  # 3 4 5 ends both: the newer
    assert h.continuation([0, 3, 4, 5], 3, min_match=4) == (0, ())  # a match shorter than asked: nothing
    assert h.continuation([0, 40, 41], 3, min_match=2) == (0, ())  # no match at all
    assert h.continuation([0, 2, 3, 4, 5], 0, min_match=2) == (0, ())


def test_a_prompt_that_comes_again_drafts_its_earlier_answer():
    prompt, answer = list(range(10, 40)), list(range(50, 70))
    h = TokenHistory()
    h.add(prompt + answer)
    n, draft = h.continuation(prompt, 8, min_match=12)
    assert n >= 12 and draft == tuple(answer[:8])
    n, draft = h.continuation(prompt + answer[:8], 8, min_match=12)  # later in the answer
    assert draft == tuple(answer[8:16])


def test_the_oldest_sequences_go_first_beyond_the_budget_and_what_they_drafted_with_them():
    h = TokenHistory(max_tokens=20, n=2)
    old, new = list(range(100, 112)), list(range(200, 212))
    h.add(old)
    h.add(new)  # 24 tokens: the older goes
    assert (len(h), h.tokens) == (1, 12)
    assert h.continuation(old[:6], 2, min_match=2) == (0, ())
    assert h.continuation(new[:6], 2, min_match=2) == (6, (206, 207))
    h.add(list(range(300, 340)))  # longer than the whole budget: its last 20 tokens are kept, alone
    assert (len(h), h.tokens) == (1, 20)
    assert h.continuation(list(range(320, 326)), 2, min_match=2) == (6, (326, 327))
    assert h.continuation(list(range(300, 306)), 2, min_match=2) == (0, ())


def test_a_sequence_kept_already_is_not_kept_twice():
    h = TokenHistory(max_tokens=100, n=2)
    seq = list(range(30))
    h.add(seq)
    h.add(seq)
    assert (len(h), h.tokens) == (1, 30)
    h.add(seq[:5])  # another sequence, though the start of one kept
    assert len(h) == 2
    h.add([1, 2])  # no n-gram with a continuation: nothing kept
    assert len(h) == 2


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        TokenHistory(n=0)
    with pytest.raises(ValueError):
        HistoryProposer(TokenHistory(n=8), {1: 1.0}, MatchAcceptance(), min_match=4)


FLAT = {1: 1.0, 64: 1.05}  # a forward over 64 tokens costs about one (a GPU)
LINEAR = {1: 1.0, 2: 1.9, 3: 2.8, 5: 4.6, 9: 8.0}  # k tokens cost ~k steps: drafts cannot pay


def _ctx(*rows, k=8):
    return ProposeContext(row_ids=tuple(range(len(rows))), token_ids=tuple(tuple(r) for r in rows),
                          k=(k,) * len(rows))


def test_the_proposer_drafts_per_row_and_abstains_where_nothing_matches_long_enough():
    h = TokenHistory(n=2)
    h.add([1, 2, 3, 4, 5, 6, 7, 8])
    proposer = HistoryProposer(h, FLAT, MatchAcceptance(), min_match=3)
    first, second = proposer.propose(_ctx((9, 2, 3, 4), (9, 9, 3, 4), k=2))
    assert first.token_ids == (5, 6)
    assert second.token_ids == ()  # 3 4 matches only 2 tokens


def test_how_much_it_drafts_follows_the_acceptance_measured_for_matches_that_long():
    h = TokenHistory(n=2)
    h.add(list(range(100, 200)))
    acceptance = MatchAcceptance(prior=0.7)
    proposer = HistoryProposer(h, {1: 1.0, 2: 1.4, 3: 1.8, 5: 2.6, 9: 4.2, 17: 7.4}, acceptance, min_match=12,
                               probe_every=1000)
    short, long = list(range(130, 142)), list(range(100, 170))  # a match of 12 tokens; of 64 (the longest counted)
    start = len(proposer.propose(_ctx(long, k=16))[0].token_ids)
    assert 0 < start < 16
    for _ in range(20):  # drafts from long matches always right: drafted whole
        [p] = proposer.propose(_ctx(long, k=16))
        proposer.observe([Verdict(row_id=0, num_drafted=len(p.token_ids), num_accepted=len(p.token_ids),
                                  emitted=p.token_ids + (0,))])
    assert len(proposer.propose(_ctx(long, k=16))[0].token_ids) == 16
    for _ in range(20):  # drafts from short matches always wrong: not drafted any more
        [p] = proposer.propose(_ctx(short, k=16))
        if p.token_ids:
            proposer.observe([Verdict(row_id=0, num_drafted=len(p.token_ids), num_accepted=0, emitted=(0,))])
    assert proposer.propose(_ctx(short, k=16))[0].token_ids == ()
    assert len(proposer.propose(_ctx(long, k=16))[0].token_ids) == 16  # each length has its own figure


def test_where_drafting_cannot_pay_it_only_probes_one_token_now_and_then():
    h = TokenHistory(n=2)
    h.add(list(range(100, 200)))
    proposer = HistoryProposer(h, LINEAR, MatchAcceptance(prior=0.7), min_match=12, probe_every=4)
    drafts = [proposer.propose(_ctx(list(range(100, 150))))[0].token_ids for _ in range(8)]
    assert [len(d) for d in drafts] == [0, 0, 0, 1, 0, 0, 0, 1]


def test_the_acceptance_by_match_length_starts_at_its_prior_and_follows_what_was_judged():
    a = MatchAcceptance(prior=0.5, prior_weight=4, window=100)
    assert a.bucket(12) == a.bucket(15) == 0 and a.bucket(64) == a.bucket(500) == len(a.BUCKETS) - 1
    assert a.alpha(0) == 0.5
    a.record(0, drafted=4, accepted=2)  # 2 accepted, 1 rejected: 3 judged
    assert a.alpha(0) == pytest.approx((2 + 2) / (3 + 4))
    for _ in range(100):
        a.record(0, drafted=1, accepted=1)
    assert a.alpha(0) > 0.95 and a.alpha(1) == 0.5


def test_the_engine_drafts_a_repeated_prompt_from_its_history_and_equals_plain(tiny_target):
    from specdec.decode import plain_generate
    from specdec.engine import Engine, EngineConfig
    from specdec.models import LoadedModel
    from specdec.types import StopConditions
    from tests.conftest import GPU_LIKE_COST, FixedCosts

    prompt, stop = list(range(3, 20)), StopConditions(max_new_tokens=24)
    want = plain_generate(tiny_target, [prompt], stop=stop)[0]

    def twice(history_tokens: int):
        engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"), costs=FixedCosts(GPU_LIKE_COST),
                                    config=EngineConfig(prefix_cache_mb=0, history_tokens=history_tokens))
        return [engine.generate_ids([prompt], "plain", stop=stop)[0] for _ in range(2)]

    first, second = twice(1 << 10)
    assert first.token_ids == second.token_ids == want.token_ids
    assert first.stats.drafted == 0  # nothing kept before the first call
    assert second.stats.accepted == second.stats.drafted > 0
    assert second.stats.target_forwards < first.stats.target_forwards / 2
    assert all(r.stats.drafted == 0 for r in twice(0))  # off


class _Recorder:
    """A stand-in fallback proposer: drafts (7,) * k, records what it was asked and told."""

    name = "recorder"
    needs_hidden = needs_features = False

    def __init__(self):
        self.asked, self.told = [], []

    def propose(self, ctx):
        from specdec.types import Proposal

        self.asked.append((ctx.token_ids, ctx.k))
        return [Proposal(token_ids=(7,) * k) for k in ctx.k]

    def observe(self, verdicts):
        self.told.extend(verdicts)


def test_where_the_history_has_no_draft_its_fallback_drafts_at_its_own_k():
    h = TokenHistory(n=2)
    h.add([1, 2, 3, 4, 5, 6, 7, 8])
    fallback = _Recorder()
    proposer = HistoryProposer(h, FLAT, MatchAcceptance(), min_match=3, fallback=fallback, fallback_k=2)
    matched, unmatched = proposer.propose(_ctx((9, 2, 3, 4), (9, 9, 3, 4), k=6))
    assert matched.token_ids == (5, 6, 7, 8)  # the history's (all it has after the match)
    assert unmatched.token_ids == (7, 7) and fallback.asked == [(((9, 9, 3, 4),), (2,))]
    verdicts = [Verdict(row_id=0, num_drafted=4, num_accepted=4, emitted=(5, 6, 7, 8, 0)),
                Verdict(row_id=1, num_drafted=2, num_accepted=0, emitted=(1,))]
    proposer.observe(verdicts)
    assert fallback.told == verdicts[1:]  # its own rows' verdicts only
    assert proposer.acceptance.alpha(0) > 0.7  # the history's row counted in the history's figure
