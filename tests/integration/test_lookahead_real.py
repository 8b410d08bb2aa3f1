"""Lookahead decoding on the real embedded target (SmolLM2-135M-Instruct): greedy output equals
plain decoding on 3 dev prompts x 32 tokens, one at a time (defaults) and as a batch of 3
(window n-grams only)."""

import pytest

from specdec.decode import plain_generate, speculative_generate
from specdec.proposers.lookahead import LookaheadProposer
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal

pytestmark = pytest.mark.real_model
MAX_NEW = 32


@pytest.fixture(scope="module")
def plain(real, prompts):
    stop = StopConditions(max_new_tokens=MAX_NEW, eos_token_ids=real.lm.eos_token_ids)
    return plain_generate(real.lm, prompts, stop=stop)


def test_real_target_lookahead_equals_plain_one_at_a_time(real, prompts, plain):
    stop = StopConditions(max_new_tokens=MAX_NEW, eos_token_ids=real.lm.eos_token_ids)
    proposer = LookaheadProposer()  # the defaults
    got = [speculative_generate(real.lm, proposer, [p], stop=stop, k=4)[0] for p in prompts]
    for p, g, w in zip(prompts, got, plain):
        assert_greedy_equal(real.lm, p, g.token_ids, w.token_ids)
    assert sum(g.stats.accepted for g in got) > 0, "no guess was accepted: the tree paths were not exercised"


def test_real_target_lookahead_equals_plain_batched_from_window_ngrams_alone(real, prompts, plain):
    """A batch of 3, without context pooling: every accepted guess is a Jacobi-window n-gram."""
    stop = StopConditions(max_new_tokens=MAX_NEW, eos_token_ids=real.lm.eos_token_ids)
    proposer = LookaheadProposer(window=4, ngram=3, guess=2, pool_from_context=False)
    got = speculative_generate(real.lm, proposer, prompts, stop=stop, k=4)
    for p, g, w in zip(prompts, got, plain):
        assert_greedy_equal(real.lm, p, g.token_ids, w.token_ids)
    assert sum(g.stats.accepted for g in got) > 0
