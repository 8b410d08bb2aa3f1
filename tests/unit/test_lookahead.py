"""Lookahead decoding: the window's attention pattern (by hand), the guess trie, the window
update, the aux logits' meaning, and greedy equality with plain decoding on a tiny model."""

import itertools

import pytest
import torch

from specdec.decode import plain_generate, speculative_generate
from specdec.errors import InvalidRequest
from specdec.testing import tiny_llama
from specdec.proposers.lookahead import (LookaheadConfig, LookaheadProposer, advance_window, build_trie, window_cells,
                                         window_mask, window_ngrams)
from specdec.types import ProposeContext, SamplingParams, StopConditions
from tests.conftest import assert_greedy_equal, full_logits

PROMPTS = [[7, 3, 19, 42, 5, 7, 3, 19, 42], [11, 12, 13], [4, 5, 6, 7, 8, 4, 5, 6, 30, 31, 32, 33]]


# --- the lookahead branch's layout, checked by hand ------------------------------------------


def test_window_cells_put_the_root_at_level_zero_column_zero():
    assert window_cells(3, 2) == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert window_cells(1, 1) == []


def test_window_mask_for_three_columns_and_two_levels():
    mask, depth = window_mask(3, 2)
    # columns: root, L0c1, L0c2, L1c0, L1c1, L1c2
    want = torch.tensor([
        [1, 1, 0, 0, 0, 0],  # L0c1: root, itself
        [1, 1, 1, 0, 0, 0],  # L0c2: root, L0c1, itself
        [1, 0, 0, 1, 0, 0],  # L1c0: root, itself (its level-0 cell is the root)
        [1, 1, 0, 0, 1, 0],  # L1c1: root, L0c1, itself
        [1, 1, 1, 0, 0, 1],  # L1c2: root, L0c1, L0c2, itself
    ], dtype=torch.bool)
    assert torch.equal(mask, want)
    assert depth == (1, 2, 1, 2, 3)


def test_proposal_hides_candidates_from_the_window():
    proposer = LookaheadProposer(window=3, ngram=3, guess=2)
    ctx = ProposeContext(row_ids=(0,), token_ids=((1, 2, 3, 1, 2),), k=(4,))
    [prop] = proposer.propose(ctx)
    n, m = len(prop.token_ids), len(prop.aux.token_ids)
    assert prop.token_ids == (3, 1)  # the context's 3-gram (2, 3, 1), filed under the root 2
    assert prop.aux.mask.shape == (m, 1 + n + m)
    assert not prop.aux.mask[:, 1 : 1 + n].any()


# --- the guess trie ---------------------------------------------------------------------------


def test_trie_shares_common_prefixes():
    tokens, parents = build_trie([(1, 2), (1, 3), (4, 5)])
    assert tokens == (1, 2, 3, 4, 5)
    assert parents == (-1, 0, 0, -1, 3)


def test_trie_adds_nothing_for_duplicates_and_prefixes():
    tokens, parents = build_trie([(1, 2, 3), (1, 2, 3), (1, 2)])
    assert tokens == (1, 2, 3)
    assert parents == (-1, 0, 1)


def test_trie_of_no_guesses_is_empty():
    assert build_trie([]) == ((), ())


# --- n-grams and the window update ------------------------------------------------------------


def test_window_ngrams_read_each_column_up_then_its_guess():
    levels = [[0, 11, 12], [20, 21, 22]]  # levels[0][0] is a placeholder for the root
    assert window_ngrams(levels, [30, 31, 32], root=9) == [(9, 20, 30), (11, 21, 31), (12, 22, 32)]


def _counter():
    it = itertools.count(100)
    return lambda: next(it)


def test_warm_up_adds_a_level_and_shifts_columns_by_the_advance():
    # root r; L0 = [r, a, b] at r+0..r+2; guesses for r+1..r+3. The root moves one: columns shift by 1.
    assert advance_window([[0, 1, 2]], [10, 11, 12], advance=1, max_levels=2, refill=_counter()) == \
        [[1, 2, 100], [11, 12, 101]]


def test_full_window_drops_its_oldest_level_when_one_token_is_emitted():
    assert advance_window([[0, 1, 2], [3, 4, 5]], [10, 11, 12], advance=1, max_levels=2, refill=_counter()) == \
        [[3, 4, 5], [10, 11, 12]]


def test_full_window_also_shifts_columns_when_guesses_are_accepted():
    assert advance_window([[0, 1, 2], [3, 4, 5]], [10, 11, 12], advance=2, max_levels=2, refill=_counter()) == \
        [[4, 5, 100], [11, 12, 101]]


def test_window_restarts_from_one_level_when_every_column_would_be_refilled():
    assert advance_window([[0, 1, 2], [3, 4, 5]], [10, 11, 12], advance=4, max_levels=2, refill=_counter()) == \
        [[100, 101, 102]]


# --- what the target computes for the window --------------------------------------------------


class Recording(LookaheadProposer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.steps = []  # (committed tokens, aux token ids, aux logits)
        self._last = None

    def propose(self, ctx):
        props = super().propose(ctx)
        self._last = (ctx.token_ids[0], props[0].aux)
        return props

    def observe(self, verdicts):
        toks, aux = self._last
        if aux is not None:
            self.steps.append((toks, aux.token_ids, verdicts[0].aux_logits))
        super().observe(verdicts)


def test_each_window_cell_gets_the_logits_of_its_column_chain(tiny_target):
    window = 3
    rec = Recording(window=window, ngram=4, guess=2)
    speculative_generate(tiny_target, rec, [PROMPTS[0]], stop=StopConditions(max_new_tokens=10), k=3)
    assert len(rec.steps) >= 3
    for toks, aux_ids, aux_logits in rec.steps[:4]:
        levels = (len(aux_ids) + 1) // window
        value = dict(zip(window_cells(window, levels), aux_ids))
        for a, (j, i) in enumerate(window_cells(window, levels)):
            chain = [value[(0, c)] for c in range(1, i + 1)] + [value[(lv, i)] for lv in range(1, j + 1)]
            ref = full_logits(tiny_target, list(toks) + chain)[-1]
            assert torch.allclose(aux_logits[a], ref, atol=1e-4), f"cell {(j, i)}"


# --- the proposer end to end ------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("window,ngram,guess,k", [(1, 2, 1, 4), (3, 3, 2, 4), (4, 4, 3, 4), (5, 5, 2, 2),
                                                  (4, 3, 4, 8)])
def test_lookahead_equals_plain_greedy(tiny_target, window, ngram, guess, k, batch):
    stop = StopConditions(max_new_tokens=32)
    prompts = PROMPTS[:batch]
    want = plain_generate(tiny_target, prompts, stop=stop)
    proposer = LookaheadProposer(window=window, ngram=ngram, guess=guess)
    got = speculative_generate(tiny_target, proposer, prompts, stop=stop, k=k)
    for p, g, w in zip(prompts, got, want):
        assert_greedy_equal(tiny_target, p, g.token_ids, w.token_ids)
    assert max(g.stats.drafted for g in got) <= max(g.stats.target_forwards for g in got) * guess * (ngram - 1)


def test_window_ngrams_alone_get_accepted(tiny_target):
    """Without pooling the context, every accepted token came from a Jacobi-window n-gram."""
    stop = StopConditions(max_new_tokens=60)
    proposer = LookaheadProposer(window=4, ngram=3, guess=3, pool_from_context=False)
    [got] = speculative_generate(tiny_target, proposer, [PROMPTS[0]], stop=stop, k=4)
    [want] = plain_generate(tiny_target, [PROMPTS[0]], stop=stop)
    assert_greedy_equal(tiny_target, PROMPTS[0], got.token_ids, want.token_ids)
    assert got.stats.accepted > 0


def test_a_reused_proposer_starts_each_generation_afresh(tiny_target):
    stop = StopConditions(max_new_tokens=30)
    proposer = LookaheadProposer(window=3, ngram=3, guess=2)
    first = speculative_generate(tiny_target, proposer, [PROMPTS[2]], stop=stop, k=4)[0]
    again = speculative_generate(tiny_target, proposer, [PROMPTS[2]], stop=stop, k=4)[0]
    assert again.token_ids == first.token_ids
    assert (again.stats.target_forwards, again.stats.accepted) == (first.stats.target_forwards, first.stats.accepted)


def test_lookahead_sampling_matches_target_distribution():
    """Sampling along the guess trie is exact: first-two-token histogram vs the target's own."""
    from tests.unit.test_sampling_e2e import PROMPT, ROWS, VOCAB, _assert_fits, _histogram, _joint_probs

    lm = tiny_llama(seed=3, vocab_size=VOCAB, num_layers=2, hidden_size=32, eos_token_id=VOCAB + 10)
    sampling = SamplingParams(temperature=1.0, seed=21)
    results = speculative_generate(lm, LookaheadProposer(window=3, ngram=3, guess=2), [PROMPT] * ROWS,
                                   sampling=sampling, stop=StopConditions(max_new_tokens=3), k=2)
    assert sum(r.stats.accepted for r in results) > 0, "no guess was accepted: the test checks nothing"
    _assert_fits(_histogram(results), _joint_probs(lm, sampling))


@pytest.mark.parametrize("field,value", [("window", 0), ("ngram", 1), ("guess", 0)])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(InvalidRequest, match=field if field != "ngram" else "n-gram"):
        LookaheadConfig(**{field: value})
